defmodule Emily.Memory do
  @moduledoc """
  MLX's memory: how much is in use, the cache of freed buffers, and their limits.

  MLX keeps freed buffers in a cache for reuse. Without a cache limit that cache can grow
  with every new shape a service sees (on Metal and CUDA it defaults to the memory limit):
  set one with `set_cache_limit/1` or at boot. All figures are bytes, and global to the
  process (MLX has one allocator per device, shared by all streams).

  ## Configuration

  Applied when the application starts:

      config :emily,
        memory_limit: 8 * 1024 ** 3,   # set_memory_limit/1
        cache_limit: 512 * 1024 ** 2,  # set_cache_limit/1
        wired_limit: 0,                # set_wired_limit/1 (Metal only; ignored elsewhere with a warning)
        malloc: [mmap_threshold: 32 * 1024 ** 2, trim_threshold: 64 * 1024 ** 2],
                                       # tune_malloc/1 (the default); `false` leaves malloc alone
        collect_after: 64 * 1024 ** 2  # set_collect_after/1 (the default); `false` turns it off

  ## Results the BEAM has not collected yet

  An MLX array lives as long as a term refers to it. That term is a few words on its
  process's heap, and the BEAM collects a process's garbage when its heap fills: it does
  not see the megabytes behind each term. So a loop whose every pass makes large new
  tensors and drops the last ones (a training loop's parameters and optimizer state)
  holds several passes' worth until its process is collected, the more the larger its
  heap: training steps of a 21M-parameter MLP with Adam (240 MiB of parameters and
  moments) peaked at 1.5 GiB of MLX memory from a loop process of the smallest heap,
  and at 5.5 GiB (and 60% slower) from one of 200,000 words, against 1.25 GiB with the
  process collected after every step (`bench/collect.exs`).

  `Emily.Backend` and `Emily.Compiler` therefore count the bytes of the results they
  hand to each process, and once those pass the `collect_after` budget (64 MiB by
  default) since the last collection, collect that process's garbage
  (`:erlang.garbage_collect/0`) at its next op or compiled function's run, emitting
  `[:emily, :memory, :collect]`. That loop then peaks at 1.25 GiB whatever its heap. A
  process that holds a large heap of its own pays for a full collection each time:
  raise the budget, or turn it off with `false`, for those.

  ## Host memory on Linux: glibc's malloc

  On the CPU, MLX allocates its buffers with `malloc`. glibc serves a block above its
  mmap threshold with a fresh `mmap`, which the kernel zero-fills page by page, and gives
  it back with `munmap`, which interrupts every core to flush its TLB. In most programs
  glibc raises that threshold as they free large blocks, so the buffers of a graph run
  again and again come from the heap (this is what Python MLX and NumPy get). The BEAM
  sets malloc's trim threshold at boot, which turns that adaptation off: the threshold
  stays at 128 KiB, and every run of a graph maps and unmaps each of its buffers above
  that size. At boot Emily therefore sets the threshold to 32 MiB, and the trim
  threshold (how much free memory at the top of the heap is kept rather than returned
  to the system) to 64 MiB, the values glibc itself adapts to (`tune_malloc/1`,
  `config :emily, :malloc`). The price is that up to that much freed memory may stay
  with the process. `malloc: false` leaves malloc as the VM set it (including a trim
  threshold set with `+MYtt`). Elsewhere (macOS, musl) it does nothing.

  ## The memory limit, and what happens above it

  MLX treats its memory limit as a guideline: on Metal it makes allocations wait for (or
  evict) cached memory, and it raises where none can be found. On the CPU it does not
  enforce it at all, and does not check that an allocation succeeded: a result larger
  than the machine can hold crashes the process when it is evaluated. So Emily refuses,
  on every device, any op result (an op's output, or a program instruction's) whose size
  is above the limit: that op fails with an `Emily.Error` ("... needs N bytes, above the
  memory limit of M bytes") at the next waiting call, and the VM and the stream go on.

  What this does not cover: many results that are each below the limit but together
  above what the machine has, and scratch buffers MLX allocates inside a kernel. Keep
  the limit below the machine's memory (MLX's default is 80% of RAM on the CPU).

  Every function here but `tune_malloc/1` runs on the default CPU stream's worker: it
  waits for the work queued there before it, and `clear_cache/0` and `set_cache_limit/1`
  also wait for the work running on every CPU stream.
  """

  require Emily.Telemetry

  @type stats :: %{
          active: non_neg_integer,
          peak: non_neg_integer,
          cache: non_neg_integer,
          memory_limit: non_neg_integer,
          cache_limit: non_neg_integer
        }

  @doc """
  MLX's memory figures, in bytes: `active` (held by live arrays), `peak` (the most
  `active` has been since start or `reset_peak/0`), `cache` (freed buffers kept for
  reuse), `memory_limit` and `cache_limit`. Emits `[:emily, :memory, :stats]`.

      iex> %{active: active, memory_limit: limit} = Emily.Memory.stats()
      iex> is_integer(active) and limit > 0
      true
  """
  @spec stats() :: stats
  def stats do
    stats = call(&Emily.Native.memory_stats/2)

    Emily.Telemetry.execute(
      [:memory, :stats],
      Emily.Telemetry.memory_measurements(stats),
      %{}
    )

    stats
  end

  @doc "Resets the peak figure to zero; from then on it tracks the highest active memory again."
  @spec reset_peak() :: :ok
  def reset_peak, do: call(&Emily.Native.reset_peak_memory/2)

  @doc "Returns the cached buffers to the system."
  @spec clear_cache() :: :ok
  def clear_cache, do: call(&Emily.Native.clear_cache/2)

  @doc """
  Sets the cache limit (bytes; `0` disables the cache) and returns the previous one. The
  cache shrinks to the limit at once.
  """
  @spec set_cache_limit(non_neg_integer) :: non_neg_integer
  def set_cache_limit(bytes) when is_integer(bytes) and bytes >= 0,
    do: call(&Emily.Native.set_cache_limit(&1, &2, bytes))

  @doc """
  Sets the memory limit (bytes) and returns the previous one. Results above it fail with
  `Emily.Error` (see the moduledoc).
  """
  @spec set_memory_limit(pos_integer) :: non_neg_integer
  def set_memory_limit(bytes) when is_integer(bytes) and bytes > 0,
    do: call(&Emily.Native.set_memory_limit(&1, &2, bytes))

  @doc """
  Sets Metal's wired limit (bytes kept resident) and returns the previous one. Raises
  `Emily.Error` where MLX does not run on Metal.
  """
  @spec set_wired_limit(non_neg_integer) :: non_neg_integer
  def set_wired_limit(bytes) when is_integer(bytes) and bytes >= 0,
    do: call(&Emily.Native.set_wired_limit(&1, &2, bytes))

  @collect_after 64 * 1024 ** 2

  @doc """
  Sets the bytes of results a process takes from `Emily.Backend` and `Emily.Compiler`
  between two collections of its garbage (`false`: none), and returns the previous
  setting. See "Results the BEAM has not collected yet".
  """
  @spec set_collect_after(non_neg_integer | false) :: non_neg_integer | false
  def set_collect_after(bytes) when (is_integer(bytes) and bytes >= 0) or bytes == false do
    previous = collect_after()
    :persistent_term.put({__MODULE__, :collect_after}, bytes)
    previous
  end

  defp collect_after, do: :persistent_term.get({__MODULE__, :collect_after}, @collect_after)

  @created {__MODULE__, :created}

  @doc false
  # Counts `bytes` of results handed to the calling process, collecting its garbage
  # first if the results counted before passed the budget.
  @spec created(non_neg_integer) :: :ok
  def created(bytes) do
    case collect_after() do
      false ->
        :ok

      budget ->
        case Process.get(@created, 0) do
          total when total >= budget ->
            collect(total)
            Process.put(@created, bytes)

          total ->
            Process.put(@created, total + bytes)
        end

        :ok
    end
  end

  @doc false
  # Collects the calling process's garbage if the results counted since its last
  # collection passed the budget. Emily.Compiler calls it before each run, when the
  # caller has dropped what the last run replaced (a training step's old parameters).
  @spec collect_due() :: :ok
  def collect_due do
    with budget when budget != false <- collect_after(),
         total when total >= budget <- Process.get(@created, 0) do
      collect(total)
      Process.put(@created, 0)
    end

    :ok
  end

  # Collects the calling process's garbage; returns the bytes counted before.
  defp collect(total) do
    :erlang.garbage_collect()
    Emily.Telemetry.execute([:memory, :collect], %{bytes: total}, %{})
    total
  end

  @malloc_defaults [mmap_threshold: 32 * 1024 ** 2, trim_threshold: 64 * 1024 ** 2]

  @doc """
  Sets glibc malloc's mmap threshold and trim threshold (bytes, each below 2 GiB; an
  option left out is left alone; see "Host memory on Linux" above). Returns `true` when
  applied, `false` where the C library is not glibc or glibc refused a value. Both are
  the whole process's settings: a small mmap threshold sends every allocation above it,
  the VM's included, through `mmap`.

      iex> Emily.Memory.tune_malloc(mmap_threshold: 32 * 1024 ** 2) in [true, false]
      true
  """
  @spec tune_malloc(keyword) :: boolean
  def tune_malloc(opts \\ @malloc_defaults) when is_list(opts) do
    values =
      for key <- [:mmap_threshold, :trim_threshold] do
        case Keyword.get(opts, key) do
          nil ->
            -1

          v when is_integer(v) and v >= 0 and v < 2_147_483_648 ->
            v

          v ->
            raise ArgumentError,
                  "tune_malloc: #{key} must be a number of bytes below 2 GiB, got #{inspect(v)}"
        end
      end

    case Keyword.keys(opts) -- [:mmap_threshold, :trim_threshold] do
      [] -> :ok
      other -> raise ArgumentError, "tune_malloc: unknown options #{inspect(other)}"
    end

    [mmap_threshold, trim_threshold] = values
    Emily.Native.malloc_tune(mmap_threshold, trim_threshold)
  end

  @doc false
  # Applies the limits of the application environment (at boot).
  def apply_config(env \\ Application.get_all_env(:emily)) do
    case Keyword.get(env, :malloc, @malloc_defaults) do
      false ->
        :persistent_term.put({__MODULE__, :malloc}, :untouched)

      opts when is_list(opts) ->
        :persistent_term.put({__MODULE__, :malloc}, {tune_malloc(opts), opts})

      other ->
        raise ArgumentError,
              "config :emily, malloc: expected a keyword list or false, got #{inspect(other)}"
    end

    case Keyword.get(env, :collect_after, @collect_after) do
      bytes when (is_integer(bytes) and bytes >= 0) or bytes == false ->
        set_collect_after(bytes)

      other ->
        raise ArgumentError,
              "config :emily, collect_after: expected a number of bytes or false, got #{inspect(other)}"
    end

    for {key, setter} <- [
          memory_limit: &set_memory_limit/1,
          cache_limit: &set_cache_limit/1,
          wired_limit: &set_wired_limit/1
        ],
        value = env[key],
        value != nil do
      unless is_integer(value) and value >= 0 do
        raise ArgumentError,
              "config :emily, #{key}: expected a non-negative number of bytes, got #{inspect(value)}"
      end

      try do
        setter.(value)
      rescue
        e in Emily.Error ->
          require Logger
          Logger.warning("config :emily, #{key} ignored: #{Exception.message(e)}")
      end
    end

    :ok
  end

  defp call(fun) do
    ref = make_ref()
    fun.(ref, Emily.Stream.default(:cpu))

    receive do
      {^ref, {:ok, value}} -> value
      {^ref, {:error, exception}} -> raise exception
    end
  end
end
