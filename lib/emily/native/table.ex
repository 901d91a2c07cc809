defmodule Emily.Native.Table.Source do
  @moduledoc false
  # Parses the op table (`native/emily/optable/*.ops`), the single list of Emily's NIFs,
  # when Emily.Native.Table is compiled. The Rust build (build/optable.rs) parses the same
  # files; the grammar is documented there. This module only needs each row's name,
  # arguments and kind.

  # The argument types of the grammar: `int` is checked to fit in 32 bits, `int64` is not.
  @types ~w(tensor tensor? tensors int int64 ints shape float bool dtype str term stream)

  def types, do: @types

  def rows(files), do: for(file <- files, row <- parse(file), do: row)

  def not_exposed(files) do
    for file <- files,
        text = not_exposed_text(File.read!(file)),
        text != nil,
        do: {Path.basename(file, ".ops"), text}
  end

  defp not_exposed_text(source) do
    case String.split(source, "# Not exposed:", parts: 2) do
      [_, rest] ->
        [first | more] = String.split(rest, "\n")

        continued =
          more
          |> Enum.take_while(&String.starts_with?(&1, "#"))
          |> Enum.map(&String.trim(String.trim_leading(&1, "#")))
          |> Enum.take_while(&(&1 != ""))

        Enum.join([String.trim(first) | continued], " ")

      _ ->
        nil
    end
  end

  defp parse(file) do
    family = Path.basename(file, ".ops")

    file
    |> File.read!()
    |> String.split("\n")
    |> Enum.with_index(1)
    |> Enum.reject(fn {line, _} ->
      String.trim(line) == "" or String.starts_with?(String.trim(line), "#")
    end)
    |> Enum.map(fn {line, n} -> parse_row(String.trim(line), family, "#{file}:#{n}") end)
  end

  # A number, or the name of the argument that gives the count at call time.
  defp output_count(n) do
    case Integer.parse(n) do
      {count, ""} -> count
      _ -> String.to_atom(n)
    end
  end

  defp parse_row(line, family, where) do
    {head, kind, expr} =
      case String.split(line, "=", parts: 2) do
        [head, expr] -> {head, :generated, String.trim(expr)}
        [head] -> {String.replace_suffix(head, "custom", ""), :custom, nil}
      end

    {head, outputs} =
      case String.split(head, "->") do
        [h, n] -> {h, output_count(String.trim(n))}
        [h] -> {h, 1}
      end

    [name | args] = String.split(head)

    args =
      Enum.map(args, fn arg ->
        case String.split(arg, ":") do
          [n, t] when t in @types -> {String.to_atom(n), t}
          _ -> raise "#{where}: bad argument #{inspect(arg)}"
        end
      end)

    %{
      name: String.to_atom(name),
      family: family,
      args: args,
      outputs: outputs,
      kind: kind,
      expr: expr
    }
  end
end

defmodule Emily.Native.Table do
  @moduledoc false
  # The op table's rows, read from `native/emily/optable/*.ops` when this module is
  # compiled and kept in it: Emily.Native and Emily.Program are generated from them, and
  # what reads them at run time (the tests, the fuzzer) must see the table the build
  # used, also where the sources are not there (a bundle, a release).

  alias Emily.Native.Table.Source

  @dir Path.expand("../../../native/emily/optable", __DIR__)
  @files @dir |> Path.join("*.ops") |> Path.wildcard() |> Enum.sort()

  for file <- @files, do: @external_resource(file)
  # The folder too: adding a family file changes its mtime.
  @external_resource @dir

  @rows Source.rows(@files)
  @not_exposed Source.not_exposed(@files)

  @doc "The argument type names the table may use."
  def types, do: Source.types()

  @doc """
  The table's folder and files in the checkout this module was compiled from: for
  `@external_resource` in the modules generated from it. Use `rows/0` to read the table.
  """
  def dir, do: @dir
  def files, do: @files

  @doc "Every row of every table file, in file order."
  def rows, do: @rows

  @doc """
  The MLX ops each family deliberately leaves out, with the reasons: the `# Not exposed:`
  comment of each table file, as `{family, text}`.
  """
  def not_exposed, do: @not_exposed
end
