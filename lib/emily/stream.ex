defmodule Emily.Stream do
  @moduledoc """
  Streams: an MLX stream on its own worker thread.

  MLX streams are thread-local, so every stream Emily uses lives on one OS thread (a
  *worker*) that builds and evaluates all of that stream's work. Ops queue onto the
  worker and return at once; only calls that need a value wait, in a plain `receive`,
  so no scheduler is ever blocked on MLX.

  Each device has a default stream, started with the application. `new/1` starts
  another (concurrent work on the CPU, or a stream per `Nx.Serving` partition), and
  `with_stream/2` makes it the calling process's stream. A stream's thread stops once
  the stream and every tensor made on it are garbage.
  """

  @type device :: :cpu | :gpu
  @type t :: reference()

  @key {__MODULE__, :current}

  @doc "Starts a new stream (and its worker thread) on `device`."
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
    previous = Process.put(@key, stream)

    try do
      fun.()
    after
      if previous, do: Process.put(@key, previous), else: Process.delete(@key)
    end
  end

  @doc "The device of `stream`."
  @spec device(t) :: device
  def device(stream), do: Emily.Native.stream_device(stream)

  @doc "The name of `stream`'s worker thread, e.g. `\"emily-cpu-1\"`."
  @spec name(t) :: String.t()
  def name(stream), do: Emily.Native.stream_name(stream)
end

defmodule Emily.Stream.Defaults do
  @moduledoc false
  # Owns the default stream of each available device for the application's lifetime.
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

    {:ok, devices}
  end

  @impl true
  def terminate(_reason, devices) do
    for device <- devices, do: :persistent_term.erase({Emily.Stream, :default, device})
    :ok
  end

  defp start(device) do
    Emily.Native.stream_new(device)
  rescue
    ArgumentError -> nil
  end
end
