defmodule Emily.Fuzz do
  @moduledoc false
  # Calls Emily.Native functions with random and malformed terms. Every failure must be
  # an Elixir exception of an expected kind (ArgumentError for bad terms, Emily.Error for
  # what MLX refuses), and every reply of a waiting call a well-formed {ref, result}.
  # A VM crash ends the run, which is the failure this exists to catch. To find the call
  # behind a crash, rerun its seed with `trace: path, eval_each: true`: each call's line
  # then names its tensors' shapes and dtypes, and its results are evaluated at once, so
  # the last line written is the culprit.

  alias Emily.Native, as: N

  @expected [ArgumentError, Emily.Error]

  # Not called: the NIF loader itself.
  @skip [:__load_nif__]

  # Bytes: results above it are refused (Emily.Memory), so evaluating random tensors
  # stays cheap.
  @memory_limit 64 * 1024 * 1024

  def functions do
    for {name, arity} <- N.__info__(:functions), name not in @skip, do: {name, arity}
  end

  @doc "Runs `count` random calls with `seed`. Returns a summary map; raises on a bad outcome."
  def run(count, seed, opts \\ []) do
    :rand.seed(:exsss, {seed, seed * 7 + 1, seed * 13 + 2})
    trace = opts[:trace] && File.open!(opts[:trace], [:write, :raw])
    previous_limit = Emily.Memory.set_memory_limit(@memory_limit)
    previous_cache = Emily.Memory.stats().cache_limit
    previous_spin = Emily.Stream.spin_us()
    probes = :ets.new(:emily_fuzz_probes, [:bag, :public])
    Process.put(:emily_fuzz_probes, probes)

    try do
      state = new_state()
      types = Map.new(Emily.Native.Table.rows(), &{&1.name, arg_types(&1)})
      fns = functions()

      {state, stats} =
        Enum.reduce(1..count, {state, %{calls: 0, ok: 0, raised: %{}, replies: 0}}, fn i,
                                                                                       {st, stats} ->
          {name, arity} = Enum.random(fns)
          args = for k <- 0..(arity - 1)//1, do: arg(st, Enum.at(types[name] || [], k))
          args = constrain(name, args)

          if trace,
            do: :ok = :file.write(trace, [inspect({name, traced(args, opts)}, limit: 20), ?\n])

          {st, stats} = call(st, stats, name, args)
          if opts[:eval_each], do: eval_all(st.tensors)
          st = if rem(i, 200) == 0, do: refresh(st), else: st
          stats = if rem(i, 50) == 0, do: drain(stats), else: stats
          stats = if rem(i, 10) == 0, do: read_one(st, stats), else: stats
          {st, stats}
        end)

      # Every stream's queue is drained (a waiting call runs after all queued work), so
      # no fuzzed call is still running (or setting limits) once this returns.
      Emily.eval(Enum.filter(state.tensors, &good_tensor?/1))
      # (A waiting call drains its stream even when it fails, e.g. on a released probe.)
      for {_, probe} <- :ets.tab2list(probes), do: good_tensor?(probe)
      stats = drain(stats, 200)
      Map.put(stats, :functions, length(fns))
    after
      Emily.Memory.set_memory_limit(previous_limit)
      Emily.Memory.set_cache_limit(previous_cache)
      Emily.Stream.set_spin(previous_spin)
      :ets.delete(probes)
      if trace, do: File.close(trace)
    end
  end

  defp good_tensor?(t) do
    try do
      Emily.eval(t)
      true
    rescue
      _ in @expected -> false
    end
  end

  defp call(st, stats, name, args) do
    stats = %{stats | calls: stats.calls + 1}
    stats = Map.update(stats, :called, MapSet.new([name]), &MapSet.put(&1, name))

    try do
      result = apply(N, name, args) |> chain(args)
      {remember(st, result), %{stats | ok: stats.ok + 1}}
    rescue
      e ->
        unless e.__struct__ in @expected do
          raise "#{inspect(name)}(#{inspect(args, limit: 10)}) raised #{inspect(e)}"
        end

        {st, %{stats | raised: Map.update(stats.raised, e.__struct__, 1, &(&1 + 1))}}
    end
  end

  # Most tensor results get an elementwise op built on them while they are still lazy,
  # and are then released: MLX may reuse a released input's buffer for the op's result,
  # which is where an output that misstates its own size writes past its buffer (MLX's
  # LU did; see guards.h).
  defp chain(result, [stream | _]) do
    outs = List.wrap(result)

    if outs != [] and Enum.all?(outs, &(is_reference(&1) and tensor?(&1))) and
         :rand.uniform() < 0.7 do
      chained =
        Enum.map(outs, fn out ->
          op = Enum.random([:exp, :negative, :abs, :square])
          y = apply(N, op, [stream, out])
          y = if :rand.uniform() < 0.5, do: N.add(stream, y, out), else: y
          N.tensor_release(out)
          y
        end)

      if is_list(result), do: chained, else: hd(chained)
    else
      result
    end
  rescue
    _ in @expected -> result
  end

  defp chain(result, _args), do: result

  # The arguments as the trace shows them: with `eval_each`, tensors by shape and dtype.
  defp traced(args, opts) do
    if opts[:eval_each] do
      Enum.map(args, fn a ->
        try do
          {:tensor, Emily.shape(a), Emily.dtype(a)}
        rescue
          _ in Emily.Error -> :failed_tensor
          _ -> a
        end
      end)
    else
      args
    end
  end

  defp eval_all(tensors) do
    Enum.each(tensors, fn t ->
      try do
        Emily.eval(t)
      rescue
        _ in @expected -> :ok
      end
    end)
  end

  # Evaluates and reads a random tensor of the pool: the graphs random calls built.
  defp read_one(st, stats) do
    Emily.to_binary(Enum.random(st.tensors))
    Map.update(stats, :read, 1, &(&1 + 1))
  rescue
    e in @expected ->
      Map.update(
        stats,
        :read_raised,
        %{e.__struct__ => 1},
        &Map.update(&1, e.__struct__, 1, fn n -> n + 1 end)
      )
  end

  # Replies: {ref, {:ok, value}} or {ref, {:error, %Emily.Error{}}}.
  defp drain(stats, wait \\ 0) do
    receive do
      {_ref, {:ok, _}} ->
        drain(%{stats | replies: stats.replies + 1}, wait)

      {_ref, {:error, %Emily.Error{}}} ->
        drain(%{stats | replies: stats.replies + 1}, wait)

      other ->
        raise "malformed reply: #{inspect(other, limit: 10)}"
    after
      wait -> stats
    end
  end

  # --- the pool of terms ---------------------------------------------------------------

  defp new_state do
    a = Emily.Stream.new(:cpu)
    b = Emily.Stream.new(:cpu)
    released = Emily.Stream.new(:cpu)
    t_released = Emily.from_list([1.0, 2.0], {:f, 32}, stream: released)
    Emily.Stream.release(released)

    # A tensor of each stream, evaluated at the end to drain its queue.
    for st <- [a, b] do
      :ets.insert(
        Process.get(:emily_fuzz_probes),
        {:probe, Emily.from_list([0.0], {:f, 32}, stream: st)}
      )
    end

    :ets.insert(Process.get(:emily_fuzz_probes), {:probe, t_released})

    tensors = [
      Emily.from_list([1.0, 2.0, 3.0, 4.0], {:f, 32}, stream: a, shape: {2, 2}),
      Emily.from_list([1, -2, 3], {:s, 32}, stream: a),
      Emily.from_list([-2_147_483_648, -1], {:s, 32}, stream: b),
      Emily.from_list([true, false], :bool, stream: b),
      Emily.from_list([0.5], {:f, 16}, stream: b, shape: {}),
      Emily.from_list([], {:f, 32}, stream: a, shape: {0, 3}),
      Emily.from_list([1.0, :nan, :infinity], {:f, 64}, stream: a),
      Emily.from_list([{1.0, 2.0}], {:c, 64}, stream: b),
      # Matrices and batches, so that linear algebra and the like get past their checks.
      Emily.from_list(Enum.map(1..9, &(&1 * 0.37 + 1.0)), {:f, 32}, stream: a, shape: {3, 3}),
      Emily.from_list(Enum.map(1..16, &(:math.sin(&1) + 2.0)), {:f, 32}, stream: b, shape: {4, 4}),
      Emily.from_list(Enum.map(1..24, &(&1 * 0.1)), {:f, 32}, stream: a, shape: {2, 3, 4}),
      Emily.from_list(Enum.map(1..8, &(&1 * 1.0)), {:f, 64}, stream: a, shape: {2, 2, 2}),
      Emily.from_list(Enum.to_list(1..6), {:s, 32}, stream: b, shape: {2, 3}),
      N.add(
        a,
        Emily.from_list([1.0], {:f, 32}, stream: a),
        Emily.from_list([1.0], {:f, 32}, stream: a)
      ),
      N.reshape(a, Emily.from_list([1.0, 2.0], {:f, 32}, stream: a), {3}),
      t_released
    ]

    programs = [
      N.program_new(2, [{:add, [0, 1]}], [2], false),
      N.program_new(1, [{:exp, [0]}, {:negative, [1]}], [2], true),
      N.program_new(0, [{:full, [{2}, 1.0, {:f, 32}]}], [0], false)
    ]

    %{streams: [a, b, released], tensors: tensors, programs: programs}
  end

  # Keeps the pools small and fresh.
  defp refresh(st) do
    fresh = new_state()
    %{fresh | tensors: fresh.tensors ++ Enum.take(Enum.shuffle(st.tensors), 10)}
  end

  defp remember(st, result) do
    new =
      cond do
        is_reference(result) -> [result]
        is_list(result) and proper?(result) -> result
        true -> []
      end
      |> Enum.filter(&(is_reference(&1) and tensor?(&1)))

    %{st | tensors: Enum.take(new ++ st.tensors, 40)}
  end

  defp proper?(list) do
    _ = length(list)
    true
  rescue
    ArgumentError -> false
  end

  defp tensor?(ref) do
    try do
      N.tensor_evaluated(ref)
      true
    rescue
      ArgumentError -> false
    end
  end

  defp arg_types(row) do
    types = Enum.map(row.args, &elem(&1, 1))
    if row.kind == :generated, do: ["stream" | types], else: types
  end

  # Mostly a term of the slot's type (so calls get past decoding and into MLX),
  # else anything at all.
  defp arg(st, type) do
    if :rand.uniform() < 0.85, do: typed(st, type), else: any(st)
  end

  defp typed(st, "stream"), do: Enum.random(st.streams)
  defp typed(st, "tensor"), do: Enum.random(st.tensors)
  defp typed(st, "tensor?"), do: Enum.random([nil, Enum.random(st.tensors)])
  defp typed(st, "tensors"), do: Enum.take_random(st.tensors, :rand.uniform(4) - 1)
  defp typed(_st, "int"), do: int()
  defp typed(_st, "int64"), do: Enum.random([int(), 2 ** 40, -(2 ** 40)])
  defp typed(_st, "ints"), do: for(_ <- 1..:rand.uniform(4)//1, do: small_int())
  defp typed(_st, "shape"), do: shape()
  defp typed(_st, "float"), do: Enum.random([float(), int(), :nan, :infinity, :neg_infinity])
  defp typed(_st, "bool"), do: Enum.random([true, false])
  defp typed(_st, "dtype"), do: dtype()
  defp typed(_st, "str"), do: Enum.random(["", "causal", "affine", <<255, 0>>])
  defp typed(st, _term), do: any(st)

  defp any(st) do
    case :rand.uniform(16) do
      1 -> int()
      2 -> float()
      3 -> Enum.random([nil, true, false, :nan, :infinity, :cpu, :gpu, :foo, :ok])
      4 -> :rand.bytes(:rand.uniform(16) - 1)
      5 -> shape()
      6 -> dtype()
      7 -> Enum.random([[], [1, 2], [[1]], [1 | 2], Enum.to_list(1..70), ~c"abc"])
      8 -> Enum.random([{}, {1}, {:a, :b}, {2, 3, 4}, %{}, %{a: 1}])
      9 -> Enum.random([self(), make_ref(), fn -> :ok end, Enum.random(st.programs)])
      10 -> Enum.random(st.streams)
      11 -> Enum.random(st.tensors)
      12 -> Enum.random(st.programs)
      13 -> Enum.take_random(st.tensors, 2)
      14 -> instrs(st)
      15 -> {Enum.random([:add, :exp, :sum, :nope, "add"]), [0, 1]}
      16 -> Emily.Codec.pack([1.0, 2.0], {:f, 32})
    end
  end

  defp instrs(_st) do
    for _ <- 1..:rand.uniform(3) do
      op = Enum.random([:add, :exp, :sum, :reshape, :full, :concatenate, :slice, :nope, :eval])

      {op,
       Enum.take_random(
         [0, 1, 2, -1, [0], {2}, false, {:f, 32}, 1.0, nil, [1, 0]],
         :rand.uniform(4) - 1
       )}
    end
  end

  defp small_int, do: Enum.random([0, 1, 2, -1, -2, 3, 7, 2 ** 31 - 1, -(2 ** 31), 2 ** 32])

  defp int do
    Enum.random([
      0,
      1,
      -1,
      2,
      5,
      64,
      1024,
      2 ** 31 - 1,
      2 ** 31,
      -(2 ** 31) - 1,
      2 ** 63 - 1,
      -(2 ** 63),
      2 ** 64,
      2 ** 100,
      -(2 ** 100)
    ])
  end

  defp float,
    do: Enum.random([0.0, -0.0, 0.5, -1.5, 1.0e308, -1.0e-320, 3.0e38, 65_504.0, 1.0e10])

  defp shape do
    Enum.random([
      {},
      {0},
      {1},
      {2, 2},
      {3},
      [2, 2],
      {4, 1, 1},
      {-1},
      {2 ** 31},
      {2 ** 31 - 1, 2 ** 31 - 1},
      {65_536, 65_536},
      {1, 2, 3, 4, 5, 6, 7, 8},
      {1.5},
      {:a},
      {2 ** 64}
    ])
  end

  defp dtype do
    Enum.random([
      :bool,
      {:u, 8},
      {:u, 32},
      {:s, 8},
      {:s, 32},
      {:s, 64},
      {:f, 16},
      {:bf, 16},
      {:f, 32},
      {:f, 64},
      {:c, 64},
      {:f, 8},
      {:c, 128},
      {:u, 4},
      {:s, 7},
      :f32,
      {:f}
    ])
  end

  # Limits above the fuzz run's memory limit would let random results through it: those
  # calls still run (with every other argument random), with the limit kept.
  defp constrain(name, [ref, stream, limit])
       when name in [:set_memory_limit, :set_cache_limit, :set_wired_limit] and is_integer(limit) and
              limit > @memory_limit,
       do: [ref, stream, @memory_limit]

  defp constrain(:stream_release, [stream]) do
    # Never the default streams (the application's); any other term goes through.
    if Enum.any?(Emily.devices(), &(Emily.Stream.default(&1) == stream)),
      do: [make_ref()],
      else: [stream]
  end

  # A long poll would make every worker spin after each job for the rest of the run:
  # valid times are capped (every other term goes through), and the run resets it.
  defp constrain(:stream_set_spin, [us]) when is_integer(us) and us > 100, do: [100]

  # malloc's thresholds are the whole process's: a random small mmap threshold would send
  # every later allocation of the VM through mmap, for the rest of the run and beyond.
  # Valid integers become "leave it" (-1); every other term goes through.
  defp constrain(:malloc_tune, args),
    do: Enum.map(args, &if(is_integer(&1) and &1 >= 0 and &1 < 2 ** 31, do: -1, else: &1))

  defp constrain(_, args), do: args
end
