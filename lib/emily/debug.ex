defmodule Emily.Debug do
  @moduledoc """
  Compile-time debug checks.

      config :emily,
        debug_bounds_check: true,    # indexed ops raise on out-of-range indices
        debug_detect_nan_inf: true   # checked results raise on NaN or infinity

  Both are read with `Application.compile_env/3` and default to `false`. When a flag is
  off, its check macros expand to `:ok`, so the check costs nothing, not even a function
  call (Emily must be recompiled after changing them). When on, each check evaluates
  what it checks and reads one number back, so it is for debugging, not production.
  (This repository's own config turns them on from the environment, for its test
  suites: `EMILY_DEBUG=bounds,nan_inf`.)

  Where they apply:

    * `:debug_bounds_check`: `Emily.Backend` calls `check_bounds/4` on the indices of
      `Nx.take/3`, `Nx.take_along_axis/3`, `Nx.gather/3`, `Nx.indexed_add/4` and
      `Nx.indexed_put/4` before the op, so also under `Emily.Compiler` (with the flag,
      its native path leaves graphs with these ops to its evaluator path). An index is
      out of range when it is negative (Nx does not wrap indices around) or not below
      the size of the axis it addresses; the indices of gather and the indexed ops,
      `{..., k}`, are checked column by column against the `k` axes they address. Without the flag, Emily clamps read indices into range and
      drops writes at out-of-range indices (MLX itself does not check). Slices with
      tensor start indices are not checked: Nx clamps their starts by definition.
    * `:debug_detect_nan_inf`: `check_finite/3` runs on the result of every `Nx.dot/2`
      (and `Nx.dot/6`) in `Emily.Backend`, and after `Emily.eval/1` and
      `Emily.to_binary/1` on their results, which covers every tensor read back to
      Elixir, and on the results of `Emily.Fast`'s norms and attention on
      `Emily.Backend`. `Emily.Compiler`'s native path checks the same results inside
      its program: the program also returns each one's count of non-finite values, and
      the run raises the same error when one is not zero.

  Only floating-point and complex results are checked for NaN and infinities.
  Each raises `Emily.Error` naming the op and how many values failed.
  """

  @bounds Application.compile_env(:emily, :debug_bounds_check, false)
  @nan_inf Application.compile_env(:emily, :debug_detect_nan_inf, false)

  @doc "Whether `:debug_bounds_check` was on when Emily was compiled."
  @spec bounds_check?() :: boolean
  def bounds_check?, do: @bounds

  @doc "Whether `:debug_detect_nan_inf` was on when Emily was compiled."
  @spec detect_nan_inf?() :: boolean
  def detect_nan_inf?, do: @nan_inf

  @doc """
  Whether `:debug_detect_nan_inf` checks the results of the `Emily.Native` op `op`
  (matmul, norms, attention), in `Emily.Backend` and in `Emily.Compiler`'s native path.
  """
  @spec checks_finite?(atom) :: boolean
  if @nan_inf do
    def checks_finite?(op),
      do: op in [:dot, :rms_norm, :layer_norm, :scaled_dot_product_attention]
  else
    def checks_finite?(_op), do: false
  end

  @doc """
  With `:debug_bounds_check`, raises `Emily.Error` unless every index of `indices` is in
  range (`size` an axis size, or a list of sizes for `{..., k}` indices: see
  `assert_in_bounds!/4`); otherwise expands to `:ok` (no argument is evaluated).
  """
  defmacro check_bounds(stream, indices, size, op) do
    if @bounds do
      quote do
        Emily.Debug.assert_in_bounds!(
          unquote(stream),
          unquote(indices),
          unquote(size),
          unquote(op)
        )
      end
    else
      :ok
    end
  end

  @doc """
  With `:debug_detect_nan_inf`, raises `Emily.Error` if `tensor` (or any tensor of a
  list) holds NaN or an infinity; otherwise expands to `:ok` (no argument is evaluated).
  """
  defmacro check_finite(stream, tensor, op) do
    if @nan_inf do
      quote do
        Emily.Debug.assert_finite!(unquote(stream), unquote(tensor), unquote(op))
      end
    else
      :ok
    end
  end

  @doc """
  Raises `Emily.Error` unless every index of `indices` (an integer tensor) is in range:

    * `size` an integer: every value in `0..size-1` (the indices of `Nx.take/3` and
      `Nx.take_along_axis/3`, which all address one axis);
    * `size` a list of `k` sizes: `indices` has shape `{..., k}` and its column `j` (along
      the last axis) addresses an axis of `Enum.at(size, j)` (the indices of
      `Nx.gather/3` and the indexed ops, `{..., k}` addressing `k` axes).

  Negative indices are out of range (Nx does not wrap them around). Evaluates `indices`
  and reads one count back. Always checks, whatever the flags.
  """
  @spec assert_in_bounds!(
          Emily.Stream.t(),
          Emily.tensor(),
          non_neg_integer | [non_neg_integer],
          String.t() | atom
        ) :: :ok
  def assert_in_bounds!(stream, indices, size, op) when is_integer(size) and size >= 0 do
    count = Emily.Native.debug_count_out_of_bounds(stream, indices, size)
    report_out_of_bounds(stream, count, indices, "outside 0..#{size - 1}", op)
  end

  def assert_in_bounds!(stream, indices, sizes, op) when is_list(sizes) do
    # One count per column, summed on the device: one value read back.
    rank = tuple_size(Emily.shape(indices))

    count =
      sizes
      |> Enum.with_index()
      |> Enum.map(fn {size, j} when is_integer(size) and size >= 0 ->
        Emily.Native.debug_count_out_of_bounds(stream, column(stream, indices, rank, j), size)
      end)
      |> Enum.reduce(
        Emily.Native.full(stream, {}, 0, {:s, 32}),
        &Emily.Native.add(stream, &1, &2)
      )

    ranges = Enum.map_join(sizes, ", ", &"0..#{&1 - 1}")
    report_out_of_bounds(stream, count, indices, "outside their axes' ranges (#{ranges})", op)
  end

  defp report_out_of_bounds(stream, count, indices, where, op) do
    case read_count(stream, count) do
      0 ->
        :ok

      n ->
        raise Emily.Error,
          op: to_string(op),
          message:
            "#{op}: #{n} of the indices #{describe(indices)} are #{where} (debug_bounds_check)"
    end
  end

  # Column `j` of the last axis of a rank-`rank` tensor (MLX clamps the other stops).
  defp column(stream, x, rank, j) do
    big = 2_147_483_647
    starts = List.duplicate(0, rank - 1) ++ [j]
    stops = List.duplicate(big, rank - 1) ++ [j + 1]
    Emily.Native.slice(stream, x, starts, stops, List.duplicate(1, rank))
  end

  @doc """
  Raises `Emily.Error` if `tensor` (or a tensor of a list) holds NaN or an infinity.
  Integer and bool tensors pass without a check. Evaluates the tensors. Always checks,
  whatever the flags.
  """
  @spec assert_finite!(Emily.Stream.t(), Emily.tensor() | [Emily.tensor()], String.t() | atom) ::
          :ok
  def assert_finite!(stream, tensors, op) when is_list(tensors) do
    Enum.each(tensors, &assert_finite!(stream, &1, op))
  end

  def assert_finite!(stream, tensor, op) do
    if floating?(Emily.dtype(tensor)) do
      case read_count(stream, Emily.Native.debug_count_nonfinite(stream, tensor)) do
        0 ->
          :ok

        n ->
          nonfinite!(op, n, Emily.dtype(tensor), Emily.shape(tensor))
      end
    else
      :ok
    end
  end

  @doc false
  # The error of a `:debug_detect_nan_inf` check that found `n` non-finite values in an
  # `op` result of `type` and `shape` (also raised by Emily.Compiler's native path).
  @spec nonfinite!(String.t() | atom, pos_integer, Emily.dtype(), tuple) :: no_return
  def nonfinite!(op, n, type, shape) do
    raise Emily.Error,
      op: to_string(op),
      message:
        "#{op}: #{n} NaN or infinite values in a #{describe(type, shape)} result " <>
          "(debug_detect_nan_inf)"
  end

  # A count as an integer. (Over a scalar, MLX's sum has no axis to reduce and keeps the
  # bool of the comparison.)
  defp read_count(stream, count) do
    [n] = Emily.to_list(Emily.Native.astype(stream, count, {:s, 32}))
    n
  end

  defp floating?({kind, _}), do: kind in [:f, :bf, :c]
  defp floating?(_), do: false

  defp describe(tensor), do: describe(Emily.dtype(tensor), Emily.shape(tensor))

  defp describe(type, shape) do
    {kind, bits} =
      case type do
        :bool -> {:bool, ""}
        t -> t
      end

    "#{kind}#{bits}#{inspect(Tuple.to_list(shape))}"
  end
end
