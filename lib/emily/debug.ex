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

  Where they apply:

    * `check_finite/3` runs after `Emily.eval/1` and `Emily.to_binary/1` on their
      (floating-point and complex) results, and is the hook for `Emily.Backend` to call
      after matmul, norms and attention.
    * `check_bounds/4` is the hook for the indexed ops (take, gather, scatter and their
      kin): `Emily.Backend` calls it on their indices before the op.

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
  With `:debug_bounds_check`, raises `Emily.Error` unless every value of `indices` is in
  `0..size-1`; otherwise expands to `:ok` (nothing is evaluated).
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
  list) holds NaN or an infinity; otherwise expands to `:ok` (nothing is evaluated).
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
  Raises `Emily.Error` unless every value of `indices` (an integer tensor) is in
  `0..size-1`. Evaluates `indices`. Always checks, whatever the flags.
  """
  @spec assert_in_bounds!(Emily.Stream.t(), Emily.tensor(), non_neg_integer, String.t() | atom) ::
          :ok
  def assert_in_bounds!(stream, indices, size, op) when is_integer(size) and size >= 0 do
    case Emily.to_list(Emily.Native.debug_count_out_of_bounds(stream, indices, size)) do
      [0] ->
        :ok

      [n] ->
        raise Emily.Error,
          op: to_string(op),
          message:
            "#{op}: #{n} of the indices #{describe(indices)} are outside 0..#{size - 1} " <>
              "(debug_bounds_check)"
    end
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
      case Emily.to_list(Emily.Native.debug_count_nonfinite(stream, tensor)) do
        [0] ->
          :ok

        [n] ->
          raise Emily.Error,
            op: to_string(op),
            message:
              "#{op}: #{n} NaN or infinite values in a #{describe(tensor)} result " <>
                "(debug_detect_nan_inf)"
      end
    else
      :ok
    end
  end

  defp floating?({kind, _}), do: kind in [:f, :bf, :c]
  defp floating?(_), do: false

  defp describe(tensor) do
    {kind, bits} =
      case Emily.dtype(tensor) do
        :bool -> {:bool, ""}
        t -> t
      end

    "#{kind}#{bits}#{inspect(Tuple.to_list(Emily.shape(tensor)))}"
  end
end
