defmodule Emily.TestCase do
  @moduledoc false
  # Helpers for tests of the native layer: build tensors from lists, read them back,
  # compare with tolerances.
  use ExUnit.CaseTemplate

  using do
    quote do
      import Emily.TestCase
      alias Emily.Native, as: N
    end
  end

  @doc "The calling process's stream."
  def s, do: Emily.Stream.current()

  @doc "The default CPU stream: for f64 and the ops MLX runs only on the CPU."
  def cpu, do: Emily.Stream.default(:cpu)

  @doc """
  Runs `fun` with the CPU stream as the current one: for f64 (CPU only in MLX) and for
  values only the CPU kernels define (integer division by zero, the winner of a repeated
  scatter), so the suite means the same on a GPU build.
  """
  def with_cpu(fun), do: Emily.Stream.with_stream(cpu(), fun)

  @doc "A tensor from a flat list, with an optional shape."
  def t(list, dtype \\ {:f, 32}, shape \\ nil) do
    Emily.from_list(list, dtype, shape: shape || {length(list)})
  end

  @doc "A tensor's values as a flat list."
  def l(tensor), do: Emily.to_list(tensor)

  @doc """
  The `Emily.Error` that evaluating `fun`'s result (a tensor or a list of tensors)
  raises; fails the test if none is raised.
  """
  def eval_error(fun) do
    ExUnit.Assertions.assert_raise(Emily.Error, fn -> Emily.eval(List.wrap(fun.())) end)
  end

  @doc "The generated op-table rows of the given families (`optable/<family>.ops`)."
  def family_rows(families) do
    for row <- Emily.Native.Table.rows(), row.family in families, row.kind == :generated, do: row
  end

  @doc """
  Valid arguments for a table row, except that the first tensor argument is not a tensor,
  so a call with them must raise `ArgumentError` before any native work.
  """
  def bad_args(row) do
    {args, _} =
      Enum.map_reduce(row.args, false, fn
        {_, "tensor"}, false -> {:not_a_tensor, true}
        {_, "tensor"}, true -> {t([1.0]), true}
        {_, "tensor?"}, done -> {nil, done}
        {_, "tensors"}, false -> {[:not_a_tensor], true}
        {_, "tensors"}, true -> {[t([1.0])], true}
        {_, "int"}, done -> {0, done}
        {_, "int64"}, done -> {0, done}
        {_, "ints"}, done -> {[0], done}
        {_, "shape"}, done -> {[1], done}
        {_, "float"}, done -> {1.0, done}
        {_, "bool"}, done -> {false, done}
        {_, "dtype"}, done -> {{:f, 32}, done}
        {_, "str"}, done -> {"left", done}
      end)

    args
  end

  @doc "Asserts two flat lists are equal within `tol` (absolute + relative); :nan matches :nan."
  def assert_close(actual, expected, tol \\ 1.0e-5) when is_list(actual) and is_list(expected) do
    ExUnit.Assertions.assert(length(actual) == length(expected),
      message:
        "length #{length(actual)} != #{length(expected)}: #{inspect(actual)} vs #{inspect(expected)}"
    )

    for {a, e} <- Enum.zip(actual, expected) do
      ExUnit.Assertions.assert(close?(a, e, tol),
        message: "#{inspect(actual)}\n  is not close to\n#{inspect(expected)}"
      )
    end

    :ok
  end

  defp close?(a, a, _), do: true
  defp close?({ar, ai}, {er, ei}, tol), do: close?(ar, er, tol) and close?(ai, ei, tol)
  defp close?(a, e, tol) when is_number(a) and is_number(e), do: abs(a - e) <= tol * (1 + abs(e))
  defp close?(_, _, _), do: false
end
