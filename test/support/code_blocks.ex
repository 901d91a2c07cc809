defmodule Emily.CodeBlocks do
  @moduledoc false
  # Runs the Elixir code of the guides (guides/*.md) and notebooks (notebooks/*.livemd):
  # every ```elixir block, in order, in one binding and one environment (aliases,
  # imports and requires carry from block to block, as they do between Livebook cells).
  #
  # What a block needs is read from its code: Bumblebee (level :conformance), Axon,
  # Polaris or Emily.MixedPrecision (:training), Nx, a module that exists only with Nx,
  # or :telemetry (an optional dependency, present where Nx is) (:nx), else nothing
  # (:none). A document is run once per level it has, each run
  # taking the blocks up to that level, so that the Nx-free blocks run where Nx is not
  # loaded too. A block preceded by `<!-- requires: nx | axon | bumblebee -->` is at
  # least at that level, for code whose need the scan cannot see (a variable made by
  # an earlier block).
  #
  # A block preceded by `<!-- not run: reason -->` (a mix.exs deps snippet, config, a
  # command for a GPU server) is not run; Livebook's `Mix.install/2` cell is not run
  # either (the test runs against the project's own dependencies).
  #
  # A line `#=> expression` after an expression checks it: the code above it (since the
  # block's start or the last check) must evaluate to the expression's value (==).

  @levels [:none, :nx, :training, :conformance]

  @nx_modules ~w(Backend Compiler Quantization QuantizedWeight Fast)

  defmodule Block do
    @moduledoc false
    defstruct [:code, :line, :level, :skip]
  end

  @doc "The levels, from the least to the most a block can need."
  def levels, do: @levels

  @doc "The ```elixir blocks of the document at `path`."
  def parse(path) do
    path
    |> File.read!()
    |> String.split("\n")
    |> Enum.with_index(1)
    |> blocks(nil, [])
    |> propagate()
  end

  # A block that reads a variable or a module an earlier block made is at least at that
  # block's level. (Any mention counts as a read: that can only raise a level.)
  defp propagate(blocks) do
    {blocks, _made} =
      Enum.map_reduce(blocks, %{}, fn block, made ->
        case Code.string_to_quoted(block.code) do
          {:ok, ast} ->
            level =
              ast
              |> names()
              |> Enum.map(&Map.get(made, &1, :none))
              |> Enum.reduce(block.level, &max_level/2)

            block = %{block | level: level}

            made =
              if block.skip,
                do: made,
                else: Enum.reduce(made_names(ast), made, &Map.put(&2, &1, level))

            {block, made}

          {:error, _} ->
            {block, made}
        end
      end)

    blocks
  end

  defp names(ast) do
    {_, acc} =
      Macro.prewalk(ast, MapSet.new(), fn
        {name, _, ctx} = node, acc when is_atom(name) and is_atom(ctx) ->
          {node, MapSet.put(acc, {:var, name})}

        {:__aliases__, _, parts} = node, acc ->
          {node, MapSet.put(acc, {:module, parts})}

        node, acc ->
          {node, acc}
      end)

    acc
  end

  # The variables a block's top-level matches bind, and the modules it defines.
  defp made_names(ast) do
    exprs =
      case ast do
        {:__block__, _, exprs} -> exprs
        expr -> [expr]
      end

    Enum.flat_map(exprs, fn
      {:=, _, [lhs, rhs]} -> Enum.filter(names(lhs), &match?({:var, _}, &1)) ++ made_names(rhs)
      {:defmodule, _, [{:__aliases__, _, parts} | _]} -> [{:module, parts}]
      _ -> []
    end)
  end

  # `marker` is the last HTML comment seen since the last block or text line.
  defp blocks([], _marker, acc), do: Enum.reverse(acc)

  defp blocks([{"```elixir" <> _, line} | rest], marker, acc) do
    {code, rest} = Enum.split_while(rest, fn {l, _} -> not String.starts_with?(l, "```") end)
    code = Enum.map_join(code, "\n", &elem(&1, 0))
    rest = Enum.drop(rest, 1)
    blocks(rest, nil, [block(code, line + 1, marker) | acc])
  end

  defp blocks([{text, _} | rest], marker, acc) do
    trimmed = String.trim(text)

    marker =
      cond do
        String.starts_with?(trimmed, "<!-- not run:") ->
          {:skip, comment(trimmed, "not run:")}

        String.starts_with?(trimmed, "<!-- requires:") ->
          {:requires, comment(trimmed, "requires:")}

        String.starts_with?(trimmed, "<!--") ->
          marker

        trimmed == "" ->
          marker

        true ->
          nil
      end

    blocks(rest, marker, acc)
  end

  defp comment(text, prefix) do
    text
    |> String.trim_leading("<!--")
    |> String.trim_trailing("-->")
    |> String.trim()
    |> String.trim_leading(prefix)
    |> String.trim()
  end

  defp block(code, line, marker) do
    skip =
      case marker do
        {:skip, reason} -> reason
        _ -> if code =~ ~r/^\s*Mix\.install\(/, do: "Mix.install"
      end

    required =
      case marker do
        {:requires, "nx"} -> :nx
        {:requires, "axon"} -> :training
        {:requires, "bumblebee"} -> :conformance
        {:requires, other} -> raise ArgumentError, "unknown requires: #{other}"
        _ -> :none
      end

    %Block{code: code, line: line, skip: skip, level: max_level(required, scan(code))}
  end

  defp scan(code) do
    cond do
      code =~ ~r/\bBumblebee\b/ -> :conformance
      code =~ ~r/\b(Axon|Polaris)\b|Emily\.MixedPrecision/ -> :training
      code =~ ~r/\bNx\b|\bdefn\b|:telemetry\b|Emily\.(#{Enum.join(@nx_modules, "|")})\b/ -> :nx
      true -> :none
    end
  end

  defp max_level(a, b), do: Enum.max_by([a, b], &index/1)
  defp index(level), do: Enum.find_index(@levels, &(&1 == level))

  @doc "The levels the blocks to run of `blocks` have, in order."
  def levels_of(blocks) do
    blocks
    |> Enum.reject(& &1.skip)
    |> Enum.map(& &1.level)
    |> Enum.uniq()
    |> Enum.sort_by(&index/1)
  end

  @doc "Whether what `level` needs is loaded."
  def available?(:none), do: true
  def available?(:nx), do: Code.ensure_loaded?(Nx)
  def available?(:training), do: Code.ensure_loaded?(Nx) and Code.ensure_loaded?(Axon)
  def available?(:conformance), do: Code.ensure_loaded?(Nx) and Code.ensure_loaded?(Bumblebee)

  @doc "The ExUnit tags of a test at `level` (test/test_helper.exs excludes them)."
  def tags(:none), do: []
  def tags(:nx), do: [:nx]
  def tags(:training), do: [:nx, :training]
  def tags(:conformance), do: [:nx, :conformance]

  # Nx's global default backend and defn options (`Nx.global_default_backend/1`,
  # `Nx.Defn.global_default_options/1`), kept in its application environment.
  @nx_globals [:default_backend, :default_defn_options]

  @doc """
  Runs the blocks of `path` up to `level`, in order, with `cwd` as the working
  directory (the guides' and notebooks' relative paths are the repository's). Returns
  the number of blocks run. A failing block raises with its file and line.
  """
  def run!(path, level, cwd) do
    blocks = for b <- parse(path), b.skip == nil, index(b.level) <= index(level), do: b
    env = Code.env_for_eval(file: path, line: 1)

    {:links, before} = Process.info(self(), :links)
    # Guides and notebooks set Nx's global defaults as a user would; the suites that run
    # after them must not inherit those.
    globals = for key <- @nx_globals, do: {key, Application.fetch_env(:nx, key)}

    try do
      File.cd!(cwd, fn ->
        Enum.reduce(blocks, {[], env}, fn block, {binding, env} ->
          run_block(block, path, binding, env)
        end)
      end)
    after
      # What the blocks started linked to the caller (supervisors of servings, named)
      # stops now, so that the next run can start them again under the same names.
      {:links, now} = Process.info(self(), :links)
      for pid <- now -- before, is_pid(pid), do: stop(pid)

      for {key, value} <- globals do
        case value do
          {:ok, v} -> Application.put_env(:nx, key, v)
          :error -> Application.delete_env(:nx, key)
        end
      end
    end

    length(blocks)
  end

  defp stop(pid) do
    Process.unlink(pid)
    ref = Process.monitor(pid)
    Process.exit(pid, :shutdown)

    receive do
      {:DOWN, ^ref, _, _, _} -> :ok
    after
      10_000 ->
        Process.exit(pid, :kill)
        receive do: ({:DOWN, ^ref, _, _, _} -> :ok)
    end
  end

  defp run_block(%Block{code: code, line: line}, path, binding, env) do
    code
    |> String.split("\n")
    |> Enum.with_index(line)
    |> Enum.chunk_while(
      {[], line},
      fn {text, n}, {acc, start} ->
        case Regex.run(~r/^\s*#=>\s*(.+)$/, text) do
          [_, want] -> {:cont, {Enum.reverse(acc), start, {want, n}}, {[], n + 1}}
          nil -> {:cont, {[text | acc], start}}
        end
      end,
      fn {acc, start} -> {:cont, {Enum.reverse(acc), start, nil}, nil} end
    )
    |> Enum.reduce({binding, env}, fn {lines, start, check}, {binding, env} ->
      {value, binding, env} = eval(Enum.join(lines, "\n"), path, start, binding, env)

      if check do
        {want, n} = check
        {expected, _, _} = eval(want, path, n, binding, env)

        if value != expected do
          raise ExUnit.AssertionError,
            message:
              "#{Path.relative_to_cwd(path)}:#{n}: the code above gives #{inspect(value)}, " <>
                "the document says #{want}"
        end
      end

      {binding, env}
    end)
  end

  defp eval(code, path, line, binding, env) do
    quoted = Code.string_to_quoted!(code, file: path, line: line)
    Code.eval_quoted_with_env(quoted, binding, %{env | file: path, line: line})
  end
end
