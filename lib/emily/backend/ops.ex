defmodule Emily.Backend.Ops do
  @moduledoc false
  # Which Native op computes each Nx op that maps onto one: the one table shared by
  # Emily.Backend (op by op) and Emily.Compiler's native path (programs).

  @unary %{
    exp: :exp,
    expm1: :expm1,
    log: :log,
    log1p: :log1p,
    sigmoid: :sigmoid,
    cos: :cos,
    sin: :sin,
    tan: :tan,
    cosh: :cosh,
    sinh: :sinh,
    tanh: :tanh,
    acos: :arccos,
    asin: :arcsin,
    atan: :arctan,
    acosh: :arccosh,
    asinh: :arcsinh,
    atanh: :arctanh,
    sqrt: :sqrt,
    rsqrt: :rsqrt,
    erf: :erf,
    erfc: :erfc,
    cbrt: :cbrt,
    round: :round_half_away,
    population_count: :population_count,
    count_leading_zeros: :count_leading_zeros,
    bitwise_not: :bitwise_invert,
    negate: :negative,
    sign: :sign
  }

  @arith %{
    add: :add,
    subtract: :subtract,
    multiply: :multiply,
    divide: :divide,
    pow: :power,
    atan2: :arctan2,
    min: :minimum,
    max: :maximum,
    bitwise_and: :bitwise_and,
    bitwise_or: :bitwise_or,
    bitwise_xor: :bitwise_xor,
    left_shift: :left_shift,
    right_shift: :right_shift,
    # Nx's remainder has the dividend's sign and its quotient truncates; MLX's remainder
    # and floor_divide floor. The table's fmod and trunc_divide are Nx's.
    remainder: :fmod,
    quotient: :trunc_divide
  }

  @compare %{
    equal: :equal,
    not_equal: :not_equal,
    greater: :greater,
    less: :less,
    greater_equal: :greater_equal,
    less_equal: :less_equal
  }

  # Nx's logical_xor is MLX's not_equal of the two as booleans.
  @logical %{logical_and: :logical_and, logical_or: :logical_or, logical_xor: :not_equal}

  @classify %{is_nan: :isnan, is_infinity: :isinf}

  @reduce %{sum: :sum, product: :prod, reduce_max: :max, reduce_min: :min}

  # MLX's CPU kernels for these compute f64 inputs with f32 accuracy: on f64, Emily
  # computes them on Nx.BinaryBackend (and the native path does not lower them).
  @f64_imprecise [:exp, :sin, :cos, :erf, :erfc, :sigmoid]

  # Nx's tie_break: :low takes the first of equal values, :high the last. With NaN (Nx
  # documents any NaN, the tie-break not applying), both report the last NaN, as
  # Nx.BinaryBackend does.
  @arg_reduce %{
    argmax: {:argmax_nan_last, :argmax_last},
    argmin: {:argmin_nan_last, :argmin_last}
  }

  @scatter %{indexed_put: :scatter, indexed_add: :scatter_add}

  @scan %{
    Nx.Block.CumulativeSum => :cumsum,
    Nx.Block.CumulativeProduct => :cumprod,
    Nx.Block.CumulativeMin => :cummin,
    Nx.Block.CumulativeMax => :cummax
  }

  @take %{Nx.Block.Take => :take, Nx.Block.TakeAlongAxis => :take_along_axis}

  @doc "Nx unary op => Native op."
  def unary, do: @unary

  @doc "Nx binary arithmetic and bitwise ops => Native op."
  def arith, do: @arith

  @doc "Nx comparisons => Native op (MLX bool results; Nx wants u8)."
  def compare, do: @compare

  @doc """
  The Native `conv` op's arguments after the input and the kernel, from Nx's `conv`
  options (padding as `{lo, hi}` pairs).
  """
  def conv_args(opts) do
    {lo, hi} = Enum.unzip(opts[:padding])

    [opts[:strides], lo, hi, opts[:input_dilation], opts[:kernel_dilation]] ++
      [opts[:feature_group_size], opts[:batch_group_size]] ++
      [opts[:input_permutation] || [], opts[:kernel_permutation] || []] ++
      [opts[:output_permutation] || []]
  end

  @doc "Nx's window reductions, each the Native op of its name."
  def window, do: [:window_sum, :window_product, :window_max, :window_min]

  @doc "A Native window reduction's arguments after the tensor, from Nx's options."
  def window_args(window, opts) do
    {lo, hi} = Enum.unzip(opts[:padding])
    [Tuple.to_list(window), opts[:strides], lo, hi, opts[:window_dilations]]
  end

  @doc """
  The `{starts, stops}` of a slice of `lengths` at numeric `starts` in `shape`, each
  start clamped so that the slice fits, as Nx clamps it.
  """
  def slice_bounds(shape, starts, lengths) do
    starts =
      [Tuple.to_list(shape), starts, lengths]
      |> Enum.zip_with(fn [dim, start, len] -> start |> max(0) |> min(dim - len) end)

    {starts, Enum.zip_with(starts, lengths, &(&1 + &2))}
  end

  # A reduce or window_reduce whose function is one of these Nx ops on its two
  # arguments: the reduction, the window reduction, and the op combining the result
  # with the accumulator.
  @reduce_funs %{
    add: {:sum, :window_sum, :add},
    multiply: {:prod, :window_product, :multiply},
    max: {:max, :window_max, :maximum},
    min: {:min, :window_min, :minimum}
  }

  @doc "Nx op of a reduce function => `{reduction, window reduction, combining op}`."
  def reduce_funs, do: @reduce_funs

  @doc "Nx logical ops => Native op on booleans (MLX bool results; Nx wants u8)."
  def logical, do: @logical

  @doc "Nx's is_nan and is_infinity => Native op (of floating-point and complex tensors)."
  def classify, do: @classify

  @doc "Nx reductions => Native op."
  def reduce, do: @reduce

  @doc "The Nx ops MLX computes with f32 accuracy on f64."
  def f64_imprecise, do: @f64_imprecise

  @doc "argmax/argmin => `{Native op for tie_break: :low, for tie_break: :high}`."
  def arg_reduce, do: @arg_reduce

  @doc "Nx's indexed ops => Native scatter."
  def scatter, do: @scatter

  @doc "Nx's cumulative blocks (struct module) => Native scan."
  def scan, do: @scan

  @doc "Nx's take blocks (struct module) => Native op."
  def take, do: @take
end
