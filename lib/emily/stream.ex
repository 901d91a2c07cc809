defmodule Emily.Stream do
  @moduledoc """
  Streams: an MLX stream on its own worker thread.

  MLX streams are thread-local, so every stream Emily uses lives on one OS thread (a
  *worker*) that builds and evaluates all of that stream's work. Ops queue onto the
  worker and return at once; only calls that need a value wait, in a plain `receive`,
  so no scheduler is ever blocked on MLX.

  Each device has a default stream, started with the application. `new/1` starts
  another (concurrent work on the CPU, or a stream per `Nx.Serving` partition), and
  `with_stream/2` makes it the calling process's stream: `current/0` is what
  `Emily`, `Emily.Backend` and `Emily.Compiler` dispatch to.

  ## Tensors across streams

  A tensor belongs to the stream that made it, and may be used by ops of any other
  stream. An evaluated tensor is read in place, from every stream at once (the shared-
  weights pattern: evaluate the weights once, then run requests on many streams). A lazy
  one is first evaluated on its own stream, then read: no error and no deadlock, whatever
  the streams do concurrently (the native `worker.rs` gives the argument), but the using
  stream waits for that evaluation, so evaluate shared tensors up front.

  ## Lifetime

  A stream lives as long as its handle or any tensor made on it. Then its worker thread
  goes back to an idle pool, with its MLX stream, and the next `new/1` of that device
  takes it instead of starting a thread (its first jobs run once the thread has finished
  the last stream's): MLX never reclaims a stream (nor, on the CPU, the OS thread that
  runs its kernels), so Emily keeps the set of threads that call MLX as small as the
  most streams alive at once, however many come and go (`thread_stats/1`).

  `release/1` lets go of a stream early: it refuses new work at once (an
  `ArgumentError` from any op or tensor creation on it), work already queued completes,
  and tensors already made stay fully usable — readable, and usable as inputs on other
  streams — for as long as they are referenced; the thread is free once the last of them
  is garbage. Default streams cannot be released.
  """

  @type device :: :cpu | :gpu
  @type t :: reference()

  @key {__MODULE__, :current}

  @doc """
  Starts a new stream (and its worker thread) on `device` (default:
  `Emily.default_device/0`). Raises `ArgumentError` if MLX has no such device.
  """
  @spec new(device) :: t
  def new(device \\ Emily.default_device()) when device in [:cpu, :gpu] do
    Emily.Native.stream_new(device)
  end

  @doc "The default stream of `device`."
  @spec default(device) :: t
  def default(device \\ Emily.default_device()) do
    case :persistent_term.get({__MODULE__, :default, device}, nil) do
      nil ->
        raise ArgumentError,
              "no #{device} stream: #{inspect(device)} is not available (#{inspect(Emily.devices())})"

      stream ->
        stream
    end
  end

  @doc """
  The calling process's stream: the one set by `with_stream/2`, else the default
  stream of `Emily.default_device/0`.
  """
  @spec current() :: t
  def current do
    case Process.get(@key) do
      nil -> default()
      stream -> stream
    end
  end

  @doc """
  The stream set for the calling process by `with_stream/2`, or `nil` when none is set
  (then `current/0` is the default stream).
  """
  @spec selected() :: t | nil
  def selected, do: Process.get(@key)

  @doc """
  Runs `fun` with `stream` as the calling process's stream, restoring the previous one
  afterwards (also when `fun` raises).
  """
  @spec with_stream(t, (-> result)) :: result when result: var
  def with_stream(stream, fun) when is_reference(stream) and is_function(fun, 0) do
    if released?(stream) do
      raise ArgumentError, "with_stream: stream #{name(stream)} has been released"
    end

    previous = Process.put(@key, stream)

    try do
      fun.()
    after
      if previous, do: Process.put(@key, previous), else: Process.delete(@key)
    end
  end

  @doc """
  Releases `stream`: it refuses new work from now on (`ArgumentError`), and its thread
  stops once the tensors made on it are garbage. Tensors already made stay usable.
  Idempotent. Raises `ArgumentError` for a default stream.
  """
  @spec release(t) :: :ok
  def release(stream) when is_reference(stream) do
    if Enum.any?(
         Emily.devices(),
         &(:persistent_term.get({__MODULE__, :default, &1}, nil) == stream)
       ) do
      raise ArgumentError, "release: #{name(stream)} is a default stream and cannot be released"
    end

    Emily.Native.stream_release(stream)
  end

  @doc """
  `%{started: n, idle: n}`: the worker threads started so far for `device` and how many
  of them are free for a new stream (a thread is free as soon as its stream is gone,
  even while it still finishes that stream's last work). `started` only grows while more
  streams are alive at once than ever before.
  """
  @spec thread_stats(device) :: %{started: non_neg_integer, idle: non_neg_integer}
  def thread_stats(device \\ Emily.default_device()) when device in [:cpu, :gpu] do
    {started, idle} = Emily.Native.stream_threads(device)
    %{started: started, idle: idle}
  end

  @doc """
  Sets how long, in microseconds, a worker thread keeps polling for new work after a job
  that a caller waited for (`Emily.eval/1`, `Emily.to_binary/1`, ...) before it sleeps,
  and how long a waiting process polls its mailbox before it blocks. Returns the
  previous value. Applies to every stream; `config :emily, spin_us: n` sets it at boot.
  The default, `:auto`, is 50 on a machine with 8 or more logical processors available
  and 0 below (`auto_spin_us/1`); `spin_us: 0` turns it off everywhere.

  Without polling, a small op's round trip is dominated by the OS waking the sleeping
  worker thread; polling trades a busy core for that latency. Lazy ops alone never
  open the window, so a model queueing hundreds of ops is still handled in batches.
  Measured with `bench/foundation.exs` and `bench/gpu/bench.exs`: on an idle 2-core
  machine, 50 us cut one op plus its evaluation from 25-36 to 17-21 us (Python MLX: 13 us); on an H200 host, from 38-52 to
  27-31 us in most runs (Python MLX: 23-28 us). On a machine whose cores are all busy it
  is harmful: with both cores of that machine taken by other work, the same round trip
  went from 26 us to 78-1,300 us, because the poll delays the very threads (MLX's, the
  BEAM's) the caller waits on. Turn it on for latency-bound work on a host with cores
  to spare.
  """
  @spec set_spin(non_neg_integer) :: non_neg_integer
  def set_spin(microseconds) when is_integer(microseconds) and microseconds in 0..1_000_000 do
    previous = Emily.Native.stream_set_spin(microseconds)
    :persistent_term.put({__MODULE__, :spin_us}, microseconds)
    previous
  end

  @doc "The polling time in force (`set_spin/1`), in microseconds."
  @spec spin_us() :: non_neg_integer
  def spin_us, do: :persistent_term.get({__MODULE__, :spin_us}, 0)

  @doc """
  The polling time `config :emily, spin_us: :auto` (the default) sets at boot, for a
  machine with `cores` logical processors available (the VM's count when not given):
  50 microseconds with 8 or more, where a core kept busy for that long after a waited-for
  job is cheap beside the latency it saves (`set_spin/1`), and 0 below, where the poll
  competes with the threads the caller waits on.

      iex> Emily.Stream.auto_spin_us(16)
      50
      iex> Emily.Stream.auto_spin_us(2)
      0
  """
  @spec auto_spin_us(pos_integer | nil) :: non_neg_integer
  def auto_spin_us(cores \\ nil) do
    cores =
      cores ||
        case :erlang.system_info(:logical_processors_available) do
          :unknown -> :erlang.system_info(:schedulers_online)
          n -> n
        end

    if cores >= 8, do: 50, else: 0
  end

  @doc "Whether `release/1` was called on `stream`."
  @spec released?(t) :: boolean
  def released?(stream), do: Emily.Native.stream_released(stream)

  @doc "The device of `stream`."
  @spec device(t) :: device
  def device(stream), do: Emily.Native.stream_device(stream)

  @doc "The name of `stream`'s worker thread, e.g. `\"emily-cpu-1\"`."
  @spec name(t) :: String.t()
  def name(stream), do: Emily.Native.stream_name(stream)
end

defmodule Emily.Stream.Defaults do
  @moduledoc false
  # Owns, for the application's lifetime, the default stream of each available device,
  # the fallback-warning table and the defn compiler's cache; applies the memory limits
  # of the config at boot.
  use GenServer

  def start_link(_), do: GenServer.start_link(__MODULE__, [], name: __MODULE__)

  @impl true
  def init([]) do
    devices =
      for device <- [:cpu, :gpu], stream = start(device), stream != nil do
        :persistent_term.put({Emily.Stream, :default, device}, stream)
        device
      end

    default = if :gpu in devices, do: :gpu, else: :cpu
    :persistent_term.put({Emily, :devices}, devices)

    :persistent_term.put(
      {Emily, :default_device},
      Application.get_env(:emily, :default_device, default)
    )

    Emily.Fallback.create_table()
    # Emily.Compiler's traced graphs and lowered programs (the compiler exists only with
    # Nx).
    :ets.new(Emily.Compiler.Cache, [:named_table, :public, :set, read_concurrency: true])
    Emily.Memory.apply_config()

    Emily.Stream.set_spin(
      case Application.get_env(:emily, :spin_us, :auto) do
        :auto -> Emily.Stream.auto_spin_us()
        us -> us
      end
    )

    {:ok, devices}
  end

  @impl true
  def terminate(_reason, devices) do
    for device <- devices, do: :persistent_term.erase({Emily.Stream, :default, device})
    :ok
  end

  defp start(device) do
    stream = Emily.Native.stream_new(device)
    # The NIF then refuses to release it, whoever asks.
    :ok = Emily.Native.stream_pin(stream)
    stream
  rescue
    ArgumentError -> nil
  end
end
