defmodule Emily.Backend.Catalogue do
  @moduledoc false
  # Why an Nx.Backend callback has no native path in Emily.Backend (which falls back to
  # Nx.BinaryBackend for every callback without an `n_<op>`), for its documentation.

  @reasons %{}

  @doc "Why `op` falls back."
  def reason(op), do: Map.get(@reasons, op, "no native path yet")

  @doc "Ops whose MLX CPU kernels have only f32 accuracy on f64 (these fall back on f64)."
  def f64_imprecise, do: [:exp, :sin, :cos, :erf, :erfc, :sigmoid]
end
