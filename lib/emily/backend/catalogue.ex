defmodule Emily.Backend.Catalogue do
  @moduledoc false
  # Why an Nx.Backend callback has no native path in Emily.Backend (which falls back to
  # Nx.BinaryBackend for every callback without an `n_<op>`), for its documentation.

  @reasons %{
    gather: "needs MLX's gather/take (not bound yet)",
    indexed_add: "needs MLX's scatter_add (not bound yet)",
    indexed_put: "needs MLX's scatter (not bound yet)",
    sort: "needs MLX's sort (not bound yet)",
    argsort: "needs MLX's argsort (not bound yet)",
    window_scatter_max: "needs MLX's scatter (not bound yet)",
    window_scatter_min: "needs MLX's scatter (not bound yet)",
    conv: "needs MLX's conv_general (not bound yet)",
    triangular_solve: "needs MLX's linalg::solve_triangular (not bound yet)",
    fft: "needs MLX's fft (not bound yet)",
    ifft: "needs MLX's fft (not bound yet)",
    reduce: "applies an Elixir function to each element: no MLX equivalent",
    window_reduce: "applies an Elixir function to each window: no MLX equivalent"
  }

  for file <- Emily.Native.Table.files(), do: @external_resource(file)

  @rows for row <- Emily.Native.Table.rows(),
            row.kind == :generated,
            into: %{},
            do: {row.name, Enum.map(row.args, &elem(&1, 0))}

  @doc "Whether the op table has a generated row `name` whose arguments are `args`."
  def row?(name, args), do: Map.get(@rows, name) == args

  @doc "Why `op` falls back."
  def reason(op), do: Map.get(@reasons, op, "no native path yet")

  @doc "Ops whose MLX CPU kernels have only f32 accuracy on f64 (these fall back on f64)."
  def f64_imprecise, do: [:exp, :sin, :cos, :erf, :erfc, :erf_inv, :sigmoid]
end
