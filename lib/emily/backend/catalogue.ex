defmodule Emily.Backend.Catalogue do
  @moduledoc false
  # The Nx.Backend callbacks Emily.Backend runs on Nx.BinaryBackend, with the reason.
  # Emily.Backend defines them from this list and prints it in its moduledoc; giving an
  # op a native path means removing it here and listing it with the native ops there.

  @fallbacks [
    {{:gather, 4}, "needs MLX's gather/take (not bound yet)"},
    {{:indexed_add, 5}, "needs MLX's scatter_add (not bound yet)"},
    {{:indexed_put, 5}, "needs MLX's scatter (not bound yet)"},
    {{:sort, 3}, "needs MLX's sort (not bound yet)"},
    {{:argsort, 3}, "needs MLX's argsort (not bound yet)"},
    {{:window_scatter_max, 6}, "needs MLX's scatter (not bound yet)"},
    {{:window_scatter_min, 6}, "needs MLX's scatter (not bound yet)"},
    {{:conv, 4}, "needs MLX's conv_general (not bound yet)"},
    {{:triangular_solve, 4}, "needs MLX's linalg::solve_triangular (not bound yet)"},
    {{:fft, 3}, "needs MLX's fft (not bound yet)"},
    {{:ifft, 3}, "needs MLX's fft (not bound yet)"},
    {{:reduce, 5}, "applies an Elixir function to each element: no MLX equivalent"},
    {{:window_reduce, 6}, "applies an Elixir function to each window: no MLX equivalent"}
  ]

  @doc "Ops whose MLX CPU kernels have only f32 accuracy on f64 (these fall back on f64)."
  def f64_imprecise, do: [:exp, :sin, :cos, :erf, :erfc, :erf_inv, :sigmoid]

  @doc "`[{op_name, reason}]`."
  def fallbacks, do: for({{name, _}, why} <- @fallbacks, do: {name, why})

  @doc "`[{op_name, arity}]`."
  def fallback_arities, do: for({name_arity, _} <- @fallbacks, do: name_arity)
end
