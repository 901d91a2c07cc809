# Runs every ```elixir block of the guides (guides/*.md), checks the fallback catalogue of
# guides/fallbacks.md against Emily.Backend, and builds the docs (mix.exs's `docs:`) with
# ExDoc where it is on the code path. How blocks are picked and checked:
# test/support/code_blocks.ex.
defmodule Emily.GuidesTest do
  use ExUnit.Case, async: false

  alias Emily.CodeBlocks

  # The :nx tests call Nx and Emily.Backend, which exist only where Nx is loaded.
  @compile {:no_warn_undefined, [Nx, Nx.Type, Emily.Backend, Mix.Tasks.Docs]}

  @root Path.expand("..", __DIR__)
  @guides Path.wildcard(Path.join(@root, "guides/*.md")) |> Enum.sort()

  @tag :mix_project
  test "there are guides, and mix.exs's docs list each of them" do
    assert length(@guides) >= 8
    extras = Emily.MixProject.project()[:docs][:extras] |> Enum.map(&extra_path/1)
    for path <- @guides, do: assert(Path.relative_to(path, @root) in extras, path)
  end

  defp extra_path({path, _opts}), do: to_string(path)
  defp extra_path(path), do: to_string(path)

  for path <- @guides,
      blocks = CodeBlocks.parse(path),
      level <- CodeBlocks.levels_of(blocks),
      level in [:none, :nx] or CodeBlocks.available?(level) do
    name = Path.relative_to(path, @root)

    @tag Enum.map(CodeBlocks.tags(level), &{&1, true})
    @tag timeout: 300_000
    test "#{name}: its code blocks up to level #{level} run and give what the guide says" do
      n = CodeBlocks.run!(unquote(path), unquote(level), @root)
      assert n > 0
    end
  end

  test "every guide has code that runs, and every skipped block says why" do
    for path <- @guides do
      blocks = CodeBlocks.parse(path)
      assert Enum.any?(blocks, &(&1.skip == nil)), "#{path}: no runnable block"

      for %{skip: reason, line: line} <- blocks, reason != nil do
        assert String.length(reason) > 3, "#{path}:#{line}: a block not run needs a reason"
      end
    end
  end

  test "the block parser: markers, levels and checks" do
    path = Path.join(System.tmp_dir!(), "emily_guides_#{System.unique_integer([:positive])}.md")
    on_exit(fn -> File.rm(path) end)

    File.write!(path, """
    Text.

    <!-- not run: configuration -->
    ```elixir
    raise "never run"
    ```

    ```elixir
    x = 1 + 1
    #=> 2
    import Integer, only: [is_even: 1]
    ```

    <!-- requires: bumblebee -->
    ```elixir
    x
    ```

    ```elixir
    {is_even(x), x * 10}
    #=> {true, 20}
    ```

    ```elixir
    t = Nx.tensor(1)
    ```

    A block reading what an Nx block made needs Nx too:

    ```elixir
    {t, x}
    ```
    """)

    blocks = CodeBlocks.parse(path)
    assert Enum.map(blocks, & &1.skip) == ["configuration", nil, nil, nil, nil, nil]
    assert Enum.map(blocks, & &1.level) == [:none, :none, :conformance, :none, :nx, :nx]
    assert Enum.map(blocks, & &1.line) == [5, 9, 16, 20, 25, 31]
    assert CodeBlocks.levels_of(blocks) == [:none, :conformance, :nx] |> Enum.sort_by(&level/1)
    # The Nx-free blocks run in one binding and environment (the import carries over).
    assert CodeBlocks.run!(path, :none, @root) == 2

    File.write!(path, "```elixir\n1 + 1\n#=> 3\n```\n")
    error = assert_raise ExUnit.AssertionError, fn -> CodeBlocks.run!(path, :none, @root) end
    assert error.message =~ ":3: the code above gives 2, the document says 3"
  end

  defp level(l), do: Enum.find_index(CodeBlocks.levels(), &(&1 == l))

  describe "the fallback catalogue (guides/fallbacks.md)" do
    @describetag :nx

    @guide Path.join(@root, "guides/fallbacks.md")
    @begin ~r/<!-- fallbacks:begin[^>]*-->\n/
    @end_marker "<!-- fallbacks:end -->"

    test "is the one Emily.Backend's tables give" do
      text = File.read!(@guide)
      [before, rest] = Regex.split(@begin, text, parts: 2, include_captures: true) |> head2()
      [current, after_] = String.split(rest, @end_marker, parts: 2)
      expected = catalogue()

      if current != expected and System.get_env("EMILY_WRITE_GUIDES") == "1" do
        File.write!(@guide, before <> expected <> @end_marker <> after_)
      else
        assert current == expected, """
        guides/fallbacks.md is out of date with Emily.Backend. Regenerate it with
        EMILY_WRITE_GUIDES=1 (in this test's run), or replace its section with:

        #{expected}
        """
      end
    end

    # Each row of the table, against what the backend does with `:fallback, :raise`.
    setup do
      previous = Application.get_env(:emily, :fallback)
      Application.put_env(:emily, :fallback, :raise)
      Nx.default_backend(Emily.Backend)

      on_exit(fn ->
        if previous,
          do: Application.put_env(:emily, :fallback, previous),
          else: Application.delete_env(:emily, :fallback)
      end)
    end

    test "every op on a listed type falls back, and none on the others" do
      {fallback, native} = Enum.split_with(nx_types(), &(&1 not in native_types()))
      assert fallback != [] and native != []

      for type <- fallback do
        t = Nx.tensor([1, 0], type: type)
        assert_raise ArgumentError, ~r/no native path for add/, fn -> Nx.add(t, t) end
      end

      for type <- native do
        t = Nx.tensor([1, 0], type: type)
        assert Nx.add(t, t) |> Nx.to_flat_list() |> length() == 2
      end
    end

    test "the listed f64 functions fall back on f64 only; the other unary functions do not" do
      x64 = Nx.tensor([0.25, 0.5], type: :f64)
      x32 = Nx.tensor([0.25, 0.5], type: :f32)

      for op <- f64_imprecise() do
        assert_raise ArgumentError, ~r/no native path for #{op}/, fn -> apply(Nx, op, [x64]) end
        assert apply(Nx, op, [x32]) |> Nx.to_flat_list() |> length() == 2
      end

      for op <- [:log, :tan, :tanh, :sqrt, :rsqrt, :expm1, :log1p, :atan] do
        assert apply(Nx, op, [x64]) |> Nx.to_flat_list() |> length() == 2, "#{op}"
      end
    end

    test "reduce and window_reduce fall back with any function but the listed ones" do
      t = Nx.iota({4}, type: :f32)

      for name <- Map.keys(reduce_funs()) do
        fun = Function.capture(Nx, name, 2)
        assert Nx.reduce(t, 0, fun) |> Nx.to_flat_list() |> length() == 1
        assert Nx.window_reduce(t, 0, {2}, fun) |> Nx.to_flat_list() |> length() == 3
      end

      other = fn a, b -> Nx.add(a, Nx.multiply(b, 2)) end
      assert_raise ArgumentError, ~r/no native path for reduce/, fn -> Nx.reduce(t, 0, other) end

      assert_raise ArgumentError, ~r/no native path for window_reduce/, fn ->
        Nx.window_reduce(t, 0, {2}, other)
      end
    end
  end

  defp head2([before, marker, rest]), do: [before <> marker, rest]

  # The catalogue, from the code: the callbacks without a native path, the Nx types MLX
  # has no dtype for, the f64 functions MLX computes with f32 accuracy and the reduce
  # functions Emily maps onto MLX's reductions.
  defp catalogue do
    callbacks =
      case Emily.Backend.fallbacks() do
        [] -> "none: every callback has an MLX path"
        list -> Enum.map_join(list, "; ", fn {name, why} -> "`#{name}` (#{why})" end)
      end

    types =
      nx_types() |> Enum.reject(&(&1 in native_types())) |> Enum.map_join(", ", &code_type/1)

    f64 = Enum.map_join(f64_imprecise(), ", ", &"`#{&1}`")

    reducers =
      reduce_funs() |> Map.keys() |> Enum.sort() |> Enum.map_join(", ", &"`Nx.#{&1}/2`")

    """
    | what | on | why |
    |---|---|---|
    | every op | tensors of #{types} | MLX has no such dtype: Emily holds these tensors in MLX (sub-byte integers one element per byte, the others as their bytes) and computes on them on `Nx.BinaryBackend` |
    | #{f64} | `f64` inputs | MLX's CPU kernels compute them with f32 accuracy; `Nx.BinaryBackend` is accurate to the last bit |
    | `reduce`, `window_reduce` | a function other than one of #{reducers} of its two arguments | MLX reduces only with its own reductions (the function is traced once to find out which it is) |
    | callbacks without an MLX path | | #{callbacks} |
    """
  end

  defp code_type(type), do: "`#{type_name(type)}`"
  defp type_name({:f8_e4m3fn, 8}), do: "f8_e4m3fn"
  defp type_name({kind, bits}), do: "#{kind}#{bits}"

  # The types the Nx in use accepts.
  defp nx_types do
    for kind <- [:s, :u, :f, :bf, :c, :f8_e4m3fn],
        bits <- [1, 2, 4, 8, 16, 32, 64, 128],
        valid_type?({kind, bits}),
        do: {kind, bits}
  end

  defp valid_type?(type) do
    Nx.Type.normalize!(type) == type
  rescue
    ArgumentError -> false
  end

  defp native_types, do: Emily.Backend.Storage.native_types()
  defp f64_imprecise, do: Emily.Backend.Ops.f64_imprecise()
  defp reduce_funs, do: Emily.Backend.Ops.reduce_funs()

  describe "mix docs" do
    # ExDoc is not a dependency: Debian's elixir-ex-doc puts it in Elixir's lib path
    # (scripts/setup installs it), and `mix do compile --no-deps-check + docs` builds
    # the docs without Hex. This test runs the same task on the compiled app, where ExDoc
    # is loadable; with Nx loaded, so that Emily.Backend and the rest are documented.
    @describetag :nx

    if not Code.ensure_loaded?(Mix.Tasks.Docs) do
      @describetag skip: "ExDoc is not on the code path (Debian: apt-get install elixir-ex-doc)"
    end

    @tag timeout: 300_000
    @tag :mix_project
    test "builds the HTML docs with every guide and no warning" do
      out = Path.join(System.tmp_dir!(), "emily_docs_#{System.unique_integer([:positive])}")
      config = Emily.MixProject.project()
      ebin = Path.dirname(:code.which(Emily.Backend))
      docs = Keyword.put(config[:docs], :source_beam, ebin)

      try do
        stderr =
          ExUnit.CaptureIO.capture_io(:stderr, fn ->
            ExUnit.CaptureIO.capture_io(fn ->
              File.cd!(@root, fn ->
                Mix.Tasks.Docs.run(["-o", out, "-f", "html"], Keyword.put(config, :docs, docs))
              end)
            end)
          end)

        for path <- @guides do
          page = Path.join(out, Path.basename(path, ".md") <> ".html")
          assert File.exists?(page), page
        end

        for path <- Path.wildcard(Path.join(@root, "notebooks/*.livemd")) do
          page = Path.join(out, "notebook_" <> Path.basename(path, ".livemd") <> ".html")
          assert File.exists?(page), page
        end

        assert File.exists?(Path.join(out, "Emily.Backend.html"))
        assert File.exists?(Path.join(out, "Emily.Quantization.html"))
        assert stderr == "", stderr
      after
        File.rm_rf!(out)
      end
    end
  end
end
