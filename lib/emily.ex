defmodule Emily do
  @moduledoc """
  MLX for Elixir: tensors on Apple's MLX array framework, on Metal, CUDA or the CPU.

  This module is the low-level tensor API: make a tensor from bytes or numbers, read it
  back, ask its shape and dtype, evaluate it. `Emily.Backend` (an `Nx.Backend`) and
  `Emily.Compiler` (a `defn` compiler) build on it; `Emily.Native` is the op-by-op NIF.

  MLX is lazy: ops build a graph, and `eval/1`, `to_binary/1` and friends evaluate it.
  Dtypes use Nx's names (`{:f, 32}`, `{:bf, 16}`, `{:s, 64}`, …) plus `:bool`.

      iex> t = Emily.from_list([1.0, 2.0, 3.0], {:f, 32})
      iex> Emily.shape(t)
      {3}
      iex> Emily.dtype(t)
      {:f, 32}
      iex> Emily.to_list(Emily.Native.multiply(Emily.Stream.current(), t, t))
      [1.0, 4.0, 9.0]
  """

  alias Emily.Native
  require Emily.Debug
  require Emily.Telemetry

  @type tensor :: reference()
  @type device :: :cpu | :gpu
  @type dtype :: :bool | {:u | :s, 8 | 16 | 32 | 64} | {:f, 16 | 32 | 64} | {:bf, 16} | {:c, 64}
  @type shape :: tuple()

  @doc """
  The devices this MLX build can use, e.g. `[:cpu]` or `[:cpu, :gpu]`.

      iex> :cpu in Emily.devices()
      true
  """
  @spec devices() :: [device]
  def devices, do: :persistent_term.get({Emily, :devices}, [])

  @doc """
  The device new tensors go to when no stream or device is given: `:gpu` where MLX has
  one, else `:cpu`. `config :emily, default_device: :cpu` overrides it.
  """
  @spec default_device() :: device
  def default_device, do: :persistent_term.get({Emily, :default_device}, :cpu)

  @doc "The version of the libmlx Emily is linked against."
  @spec mlx_version() :: String.t()
  def mlx_version, do: Native.mlx_version()

  @doc """
  A tensor of `shape` and `dtype` from native-endian `binary` (one copy). A binary of 1
  MiB or more whose shape, type and bytes equal those of an array made from a binary on
  the same stream, which a tensor still holds, gets that array instead (the Memory guide,
  "The same bytes loaded twice").

  Options: `:device` (`:cpu` or `:gpu`) or `:stream` (an `Emily.Stream`); by default the
  calling process's stream (`Emily.Stream.current/0`).

      iex> t = Emily.from_binary(<<1::32-native, 2::32-native>>, {2}, {:s, 32})
      iex> Emily.to_binary(t)
      <<1::32-native, 2::32-native>>
  """
  @spec from_binary(binary, shape | [non_neg_integer], dtype, keyword) :: tensor
  def from_binary(binary, shape, dtype, opts \\ []) when is_binary(binary) do
    Native.from_binary(stream(opts), binary, shape, dtype)
  end

  @doc """
  A tensor from a flat list of numbers (or `:nan`, `:infinity`, `:neg_infinity`;
  `{re, im}` for `{:c, 64}`). `shape` defaults to `{length(list)}`. Options as in
  `from_binary/4`.

      iex> Emily.from_list([1, 2, 3, 4], {:u, 8}, shape: {2, 2}) |> Emily.shape()
      {2, 2}
  """
  @spec from_list([number | atom | {number, number}], dtype, keyword) :: tensor
  def from_list(list, dtype, opts \\ []) when is_list(list) do
    shape = Keyword.get(opts, :shape, {length(list)})
    from_binary(Emily.Codec.pack(list, dtype), shape, dtype, opts)
  end

  @doc """
  The bytes of `tensor`, row-major and native-endian, after evaluating it. The binary
  is a view of MLX's buffer (no copy). A read that waits for the tensor's evaluation
  emits `[:emily, :to_binary, *]` (`Emily.Telemetry`); one of an evaluated tensor
  returns at once and emits nothing.
  """
  @spec to_binary(tensor) :: binary
  def to_binary(tensor) do
    ref = make_ref()

    bin =
      case Native.to_binary(ref, tensor) do
        {:ok, bin} ->
          bin

        ^ref ->
          Emily.Telemetry.span :to_binary,
                               Emily.Telemetry.to_binary_metadata(tensor),
                               &Emily.Telemetry.to_binary_stop/1 do
            await(ref)
          end
      end

    Emily.Debug.check_finite(Emily.Stream.current(), tensor, "to_binary")
    bin
  end

  @doc """
  The values of `tensor` as a flat list (row-major).

      iex> Emily.from_list([true, false], :bool) |> Emily.to_list()
      [true, false]
  """
  @spec to_list(tensor) :: list
  def to_list(tensor), do: tensor |> to_binary() |> Emily.Codec.unpack(dtype(tensor))

  @doc """
  Evaluates a tensor or a list of tensors, and waits until they are evaluated. The
  tensors may belong to several streams: each stream evaluates its own in one graph
  evaluation, the streams in parallel. Raises the first `Emily.Error` met. Emits
  `[:emily, :eval, *]` (`Emily.Telemetry`).
  """
  @spec eval(tensor | [tensor]) :: :ok
  def eval(tensors) do
    tensors = List.wrap(tensors)

    Emily.Telemetry.span :eval, Emily.Telemetry.eval_metadata(tensors) do
      evaluate(tensors)
      Emily.Debug.check_finite(Emily.Stream.current(), tensors, "eval")
      :ok
    end
  end

  @doc false
  # `eval/1` without its telemetry span and debug check: for evaluations Emily makes on
  # its own account (a program's lazy inputs), which the caller did not ask to read.
  @spec evaluate([tensor]) :: :ok
  def evaluate(tensors) when is_list(tensors) do
    ref = make_ref()
    Native.eval(ref, tensors)
    :ok = await(ref)
  end

  @doc """
  Starts evaluating a tensor or a list of tensors (on their own streams) and returns at
  once. A stream goes on queueing later ops while MLX computes, so work can be
  pipelined: `async_eval` step N, build step N + 1, then wait on step N with `eval/1` or
  `to_binary/1`. Errors surface at that waiting call.
  """
  @spec async_eval(tensor | [tensor]) :: :ok
  def async_eval(tensors), do: Native.async_eval(List.wrap(tensors))

  @doc """
  Frees `tensor`'s array now, instead of when the BEAM garbage-collects the handle, so
  that MLX can reuse its memory at once (MLX frees an array when its last holder lets go;
  an Elixir handle lets go only when collected, which for a process holding large
  intermediates can be much later). Returns `:ok`, or `:already_released`.

  Using `tensor` afterwards raises `Emily.Error`. Tensors already computed from it, and
  binaries returned by `to_binary/1`, are unaffected.

      iex> t = Emily.from_list([1.0, 2.0], {:f, 32})
      iex> Emily.release(t)
      :ok
      iex> Emily.release(t)
      :already_released
  """
  @spec release(tensor) :: :ok | :already_released
  def release(tensor), do: Native.tensor_release(tensor)

  @doc "The shape of `tensor`, as a tuple."
  @spec shape(tensor) :: shape
  def shape(tensor), do: tensor |> describe() |> elem(0)

  @doc "The dtype of `tensor`."
  @spec dtype(tensor) :: dtype
  def dtype(tensor), do: tensor |> describe() |> elem(1)

  @doc "The number of bytes `tensor` holds."
  @spec nbytes(tensor) :: non_neg_integer
  def nbytes(tensor) do
    {shape, dtype} = describe(tensor)
    Tuple.product(shape) * dtype_size(dtype)
  end

  @doc false
  def dtype_size(:bool), do: 1
  def dtype_size({_, bits}), do: div(bits, 8)

  defp describe(tensor) do
    ref = make_ref()
    Native.describe(ref, tensor)
    await(ref)
  end

  # The worker's reply to `ref`. With `Emily.Stream.set_spin/1`, polls the mailbox for a
  # while first: a process that blocks in `receive` lets its scheduler thread sleep, and
  # waking it costs the OS several microseconds, which is most of a small op's round trip.
  @doc false
  # Waits for the `{ref, result}` reply of a native call (polling first, see
  # `Emily.Stream.set_spin/1`) and returns its value or raises its error.
  def await(ref) do
    case Emily.Stream.spin_us() do
      0 -> receive do: ({^ref, result} -> unwrap!(result))
      us -> poll(ref, System.monotonic_time(:microsecond) + us)
    end
  end

  defp poll(ref, deadline) do
    receive do
      {^ref, result} -> unwrap!(result)
    after
      0 ->
        if System.monotonic_time(:microsecond) < deadline do
          poll(ref, deadline)
        else
          receive do: ({^ref, result} -> unwrap!(result))
        end
    end
  end

  defp unwrap!({:ok, value}), do: value
  defp unwrap!(:ok), do: :ok
  defp unwrap!({:error, exception}), do: raise(exception)

  defp stream(opts) do
    cond do
      stream = opts[:stream] -> stream
      device = opts[:device] -> Emily.Stream.default(device)
      true -> Emily.Stream.current()
    end
  end
end
