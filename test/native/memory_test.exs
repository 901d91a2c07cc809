defmodule Emily.MemoryTest do
  # Memory figures and limits are global to the process.
  use Emily.TestCase, async: false
  doctest Emily.Memory

  @mib 1024 * 1024

  test "stats/0 reports active, peak, cache and the limits" do
    stats = Emily.Memory.stats()
    assert Map.keys(stats) |> Enum.sort() == [:active, :cache, :cache_limit, :memory_limit, :peak]
    assert Enum.all?(Map.values(stats), &(is_integer(&1) and &1 >= 0))
    assert stats.peak >= stats.active
    assert stats.memory_limit > 0
  end

  test "active memory holds an evaluated tensor and drops when it is garbage" do
    with_cpu(fn ->
      Emily.Memory.clear_cache()
      # From settled memory: an earlier test's garbage (a 4 MiB matrix, once) can be
      # freed between the two reads otherwise.
      before = settled_active()
      st = s()
      holder = spawn_holding(fn -> N.full(st, {4 * @mib}, 1.0, {:f, 32}) end)
      held = Emily.Memory.stats().active
      # 16 MiB, give or take the small tensors of earlier tests that their workers free
      # meanwhile (one run saw 12 bytes fewer).
      assert held - before >= 16 * @mib - 64 * 1024
      send(holder, :drop)
      # Other streams may still be finishing earlier tests' work: wait for the drop to show
      # (the waiting's own small tensors add a few bytes).
      assert eventually(fn -> Emily.Memory.stats().active < held - 15 * @mib end)
    end)
  end

  test "evaluating strided tensors copies them one at a time" do
    # A model's weights loaded as transposes of their checkpoint's layout are views until
    # evaluated; evaluated, each must be row-contiguous. Eight 4 MiB views (each of its
    # own buffer, which nothing else holds): copied one at a time, each view let go
    # before the next copy, the evaluation needs one matrix more than the eight, where
    # copying them all at once needed eight more.
    with_cpu(fn ->
      st = s()

      views =
        Task.async(fn ->
          for i <- 1..8 do
            m = N.reshape(st, N.arange(st, 0.0, 1024.0 * 1024, 1.0, {:f, 32}), [1024, 1024])
            N.transpose(st, N.add(st, m, t([i * 1.0])), [1, 0])
          end
        end)
        |> Task.await()

      :erlang.garbage_collect()
      Emily.Memory.clear_cache()
      before = settled_active()
      Emily.Memory.reset_peak()
      Emily.evaluate(views)
      stats = Emily.Memory.stats()

      assert stats.active - before >= 32 * @mib - 64 * 1024
      assert stats.peak - before <= 36 * @mib + 1 * @mib
      [first | _] = views
      assert N.slice(st, first, [0, 0], [2, 2], [1, 1]) |> l() == [1.0, 1025.0, 2.0, 1026.0]
    end)
  end

  describe "from_binary of bytes a live tensor was loaded from" do
    # A checkpoint's tied embedding reaches from_binary once for each parameter that
    # names it: the second load shares the first's array instead of copying it. Each test
    # releases its tensors before it ends, and measures from settled memory (an earlier
    # test's process frees its tensors as it exits, after the test).
    setup do
      # 4 MiB of f32 that differ throughout (the samples the worker hashes included).
      bin = for i <- 1..(1024 * 1024), into: <<>>, do: <<i * 0.5::float-32-native>>
      {:ok, bin: bin}
    end

    test "shares the array, with the same values", %{bin: bin} do
      with_cpu(fn ->
        st = s()
        a = loaded(st, bin)
        before = settled_active()
        # A binary of its own, as a second read of the file gives.
        b = loaded(st, :binary.copy(bin))
        assert Emily.Memory.stats().active - before < @mib
        assert Emily.to_binary(b) == bin
        assert N.slice(st, b, [1023, 1022], [1024, 1024], [1, 1]) |> l() == [524_287.5, 524_288.0]
        release([a, b])
      end)
    end

    test "copies bytes that differ away from the samples, or another shape or type", %{bin: bin} do
      with_cpu(fn ->
        st = s()
        a = loaded(st, bin)
        # One float changed at 1 MiB into the bytes, where no sample reads.
        <<head::binary-size(@mib), _::binary-size(4), tail::binary>> = bin
        changed = <<head::binary, -1.0::float-32-native, tail::binary>>

        copies =
          for {bytes, shape, type} <- [
                {changed, [1024, 1024], {:f, 32}},
                {bin, [2048, 512], {:f, 32}},
                {bin, [1024, 1024], {:s, 32}}
              ] do
            before = settled_active()
            c = loaded(st, bytes, shape, type)
            assert Emily.Memory.stats().active - before >= 4 * @mib - 64 * 1024
            assert Emily.to_binary(c) == bytes
            c
          end

        assert Emily.to_binary(a) == bin
        release([a | copies])
      end)
    end

    test "outlives the tensor it was shared with, and is found again through the sharer",
         %{bin: bin} do
      with_cpu(fn ->
        st = s()
        first = spawn_holding(fn -> loaded(st, bin) end)
        second = spawn_holding(fn -> loaded(st, :binary.copy(bin)) end)

        held = settled_active()
        stop(first)
        # The array is the second tensor's too: dropping the first frees nothing.
        assert settled_active() - held > -@mib
        third = loaded(st, :binary.copy(bin))
        assert Emily.Memory.stats().active - held < @mib
        stop(second)
        assert Emily.to_binary(third) == bin
        release([third])
      end)
    end
  end

  # `bytes` as an evaluated tensor (a 1024 x 1024 f32 matrix unless told).
  defp loaded(st, bytes, shape \\ [1024, 1024], type \\ {:f, 32}) do
    t = N.from_binary(st, bytes, shape, type)
    Emily.eval(t)
    t
  end

  # Active memory once the frees queued so far have landed: two reads 50 ms apart, with
  # a round trip on the stream between them, that agree to within the round trip's own
  # small tensors.
  defp settled_active(tries \\ 100) do
    a = Emily.Memory.stats().active
    round_trip()
    Process.sleep(50)
    b = Emily.Memory.stats().active

    if abs(a - b) < 64 * 1024 or tries == 0, do: b, else: settled_active(tries - 1)
  end

  # Releases `tensors` and waits for their frees to land.
  defp release(tensors) do
    Enum.each(tensors, &Emily.release/1)
    settled_active()
  end

  # Sends a spawn_holding/1 process its drop and waits for it to exit.
  defp stop(pid) do
    ref = Process.monitor(pid)
    send(pid, :drop)
    assert_receive {:DOWN, ^ref, :process, ^pid, _}, 10_000
  end

  test "reset_peak/0 resets the peak; it tracks new highs" do
    x = N.full(s(), {2 * @mib}, 1.0, {:f, 32})
    Emily.eval(x)
    assert Emily.Memory.reset_peak() == :ok
    peak = Emily.Memory.stats().peak
    y = N.full(s(), {4 * @mib}, 2.0, {:f, 32})
    Emily.eval(y)
    assert Emily.Memory.stats().peak >= peak + 16 * @mib
    _ = {x, y}
  end

  test "set_cache_limit/1 returns the previous limit and bounds the cache; clear_cache/0 empties it" do
    previous = Emily.Memory.set_cache_limit(64 * @mib)
    assert Emily.Memory.stats().cache_limit == 64 * @mib
    # Earlier suites may have left more than the new limit cached: start from empty.
    assert Emily.Memory.clear_cache() == :ok

    # Freed buffers go to the cache, up to the limit.
    for _ <- 1..3 do
      Emily.eval(N.full(s(), {1 * @mib}, 1.0, {:f, 32}))
    end

    :erlang.garbage_collect()
    assert l(N.add(s(), t([1.0]), t([1.0]))) == [2.0]
    # The VM may run the handles' destructors (which queue the frees) after the collection
    # returns: wait for the freed buffers to show, then check the bound.
    eventually(fn -> Emily.Memory.stats().cache >= 4 * @mib end)
    cache = Emily.Memory.stats().cache
    assert cache >= 4 * @mib and cache <= 64 * @mib, "cache: #{cache} bytes"

    # Tensors of processes that just ended are freed on their workers' next job, and
    # their buffers may land in the cache right after it was cleared: what must hold is
    # that a clear empties it.
    assert Enum.any?(1..10, fn _ ->
             assert Emily.Memory.clear_cache() == :ok
             Emily.Memory.stats().cache < 1 * @mib
           end)

    assert Emily.Memory.set_cache_limit(0) == 64 * @mib
    Emily.eval(N.full(s(), {1 * @mib}, 1.0, {:f, 32}))
    :erlang.garbage_collect()
    assert l(N.add(s(), t([1.0]), t([1.0]))) == [2.0]
    assert Emily.Memory.stats().cache == 0

    assert Emily.Memory.set_cache_limit(previous) == 0
  end

  test "set_memory_limit/1 returns the previous limit" do
    limit = Emily.Memory.stats().memory_limit
    assert Emily.Memory.set_memory_limit(limit + 1) == limit
    assert Emily.Memory.stats().memory_limit == limit + 1
    assert Emily.Memory.set_memory_limit(limit) == limit + 1
  end

  test "a result above the memory limit raises Emily.Error; the VM and the stream live on" do
    limit = Emily.Memory.set_memory_limit(64 * @mib)

    try do
      st = Emily.Stream.new(:cpu)
      # 128 MiB of f32, above the 64 MiB limit.
      big = N.full(st, {32 * @mib}, 1.0, {:f, 32})
      e = assert_raise Emily.Error, fn -> Emily.eval(big) end
      assert e.message =~ "full"
      assert e.message =~ "needs 134217728 bytes, above the memory limit of 67108864 bytes"
      # Ops on the refused result fail too, naming the cause.
      assert_raise Emily.Error, ~r/above the memory limit/, fn ->
        l(N.sum(st, big, [0], false))
      end

      # Below the limit all is well, on that stream and on others.
      assert l(N.sum(st, N.full(st, {1024}, 1.0, {:f, 32}), [0], false)) == [1024.0]
      assert l(N.add(s(), t([1.0]), t([2.0]))) == [3.0]
    after
      Emily.Memory.set_memory_limit(limit)
    end
  end

  test "results too large for the machine (or for size_t) raise instead of crashing" do
    with_cpu(fn ->
      # Just above the limit (it depends on the machine), and 2^93 bytes: MLX would not
      # check the failed allocation.
      over = div(Emily.Memory.stats().memory_limit, 4 * 1024 * 1024 * 1024) + 1

      for shape <- [{over, 1024, 1024, 1024}, {2_147_483_647, 2_147_483_647, 2_147_483_647}] do
        assert_raise Emily.Error, ~r/above the memory limit/, fn ->
          Emily.eval(N.full(s(), shape, 0.0, {:f, 32}))
        end
      end

      assert l(N.add(s(), t([1.0]), t([2.0]))) == [3.0]
    end)
  end

  test "set_wired_limit/1 is a Metal setting: a clear error elsewhere" do
    unless :gpu in Emily.devices() do
      e = assert_raise Emily.Error, fn -> Emily.Memory.set_wired_limit(0) end
      assert e.message =~ "Metal"
      assert e.op == "set_wired_limit"
    end
  end

  test "bad limits: Elixir guards and native checks raise; the worker lives on" do
    assert_raise FunctionClauseError, fn -> Emily.Memory.set_cache_limit(-1) end
    assert_raise FunctionClauseError, fn -> Emily.Memory.set_memory_limit(0) end
    assert_raise FunctionClauseError, fn -> Emily.Memory.set_cache_limit(1.5) end

    assert_raise ArgumentError, ~r/non-negative/, fn ->
      N.set_cache_limit(make_ref(), cpu(), -5)
    end

    assert_raise ArgumentError, fn -> N.memory_stats(make_ref(), :not_a_stream) end
    assert_raise ArgumentError, fn -> N.set_memory_limit(make_ref(), cpu(), 2 ** 70) end
    assert is_map(Emily.Memory.stats())
  end

  test "apply_config/1 applies the configured limits and validates them" do
    previous = Emily.Memory.stats().cache_limit

    try do
      assert Emily.Memory.apply_config(cache_limit: 5 * @mib) == :ok
      assert Emily.Memory.stats().cache_limit == 5 * @mib

      assert_raise ArgumentError, ~r/cache_limit/, fn ->
        Emily.Memory.apply_config(cache_limit: "5MB")
      end
    after
      Emily.Memory.set_cache_limit(previous)
    end
  end

  test "apply_config/1 warns (does not fail) for a wired limit off Metal" do
    unless :gpu in Emily.devices() do
      log =
        ExUnit.CaptureLog.capture_log(fn ->
          assert Emily.Memory.apply_config(wired_limit: 0) == :ok
        end)

      assert log =~ "wired_limit ignored"
    end
  end

  # glibc's malloc: CI and the GPU image are Linux with glibc.
  @glibc? match?({:unix, :linux}, :os.type()) and
            File.read!("/proc/self/maps") =~ ~r/libc\.so\.6|libc-2\./

  test "tune_malloc/1 sets glibc's thresholds; bad values raise before any native call" do
    assert Emily.Memory.tune_malloc(mmap_threshold: 32 * @mib, trim_threshold: 64 * @mib) ==
             @glibc?

    assert Emily.Memory.tune_malloc([]) == @glibc?

    for bad <- [[mmap_threshold: -1], [trim_threshold: 2 ** 31], [mmap_threshold: "1MB"]] do
      assert_raise ArgumentError, ~r/bytes below 2 GiB/, fn -> Emily.Memory.tune_malloc(bad) end
    end

    assert_raise ArgumentError, ~r/unknown options \[:top_pad\]/, fn ->
      Emily.Memory.tune_malloc(top_pad: 0)
    end

    assert_raise ArgumentError, ~r/32 bits/, fn -> N.malloc_tune(2 ** 40, -1) end
  end

  test "apply_config/1 tunes malloc by default, leaves it with `malloc: false`" do
    try do
      Emily.Memory.apply_config(malloc: false)
      assert :persistent_term.get({Emily.Memory, :malloc}) == :untouched
      Emily.Memory.apply_config([])

      assert {@glibc?, [mmap_threshold: _, trim_threshold: _]} =
               :persistent_term.get({Emily.Memory, :malloc})

      assert_raise ArgumentError, ~r/malloc: expected a keyword list or false/, fn ->
        Emily.Memory.apply_config(malloc: true)
      end
    after
      Emily.Memory.apply_config([])
    end
  end

  test "set_collect_after/1 returns the previous budget; apply_config/1 sets and checks it" do
    previous = Emily.Memory.set_collect_after(123)

    try do
      assert Emily.Memory.set_collect_after(false) == 123
      assert Emily.Memory.apply_config(collect_after: 7 * @mib, malloc: false) == :ok
      assert Emily.Memory.set_collect_after(false) == 7 * @mib

      assert_raise ArgumentError, ~r/collect_after: expected a number of bytes or false/, fn ->
        Emily.Memory.apply_config(collect_after: :yes, malloc: false)
      end
    after
      Emily.Memory.apply_config([])
      Emily.Memory.set_collect_after(previous)
    end
  end

  test "results counted past the budget get their process collected, freeing dropped tensors" do
    with_cpu(fn ->
      st = s()
      # Bytes of its own for each tensor (equal ones would share one array), made here:
      # binaries made in the child would grow its heap until the BEAM collected it.
      bins =
        for i <- 1..16,
            do:
              <<i * 1.0::float-32-native,
                :binary.copy(<<1.0::float-32-native>>, @mib - 1)::binary>>

      active = fn -> Emily.Memory.stats().active end

      # Sixteen 4 MiB tensors, each dropped at once, in a process whose heap is large
      # enough that the BEAM would not collect it meanwhile: what frees them is the count.
      # `check` sees the memory they grew by once made, and once collect_due/0 ran.
      run = fn budget, check ->
        previous = Emily.Memory.set_collect_after(budget)
        parent = self()

        try do
          before = settled_active()

          child =
            Process.spawn(
              fn ->
                for bytes <- bins do
                  :ok = Emily.eval(Emily.from_binary(bytes, {@mib}, {:f, 32}, stream: st))
                  Emily.Memory.created(4 * @mib)
                end

                send(parent, :made)
                assert_receive :collect, 10_000
                Emily.Memory.collect_due()
                send(parent, :collected)
                assert_receive :exit, 10_000
              end,
              [:link, min_heap_size: 2_000_000]
            )

          assert_receive :made, 10_000
          check.(:made, fn -> active.() - before end)
          send(child, :collect)
          assert_receive :collected, 10_000
          check.(:collected, fn -> active.() - before end)
          send(child, :exit)
        after
          Emily.Memory.set_collect_after(previous)
        end
      end

      run.(false, fn _, grown ->
        # (Frees are queued to the stream: let any pending one land first.)
        eventually(fn -> false end, 5)
        assert grown.() >= 60 * @mib
      end)

      run.(8 * @mib, fn
        # The two tensors counted since the last collection are left; none after.
        :made, grown -> assert eventually(fn -> grown.() <= 9 * @mib end)
        :collected, grown -> assert eventually(fn -> grown.() <= @mib end)
      end)
    end)
  end

  # A process that makes and evaluates a tensor, holds it until told to drop it, then
  # exits (the tensor is garbage at once) after a round trip that drains the queue.
  defp spawn_holding(make) do
    parent = self()

    pid =
      spawn(fn ->
        t = make.()
        Emily.eval(t)
        send(parent, :held)

        receive do
          :drop -> :ok
        end
      end)

    assert_receive :held, 10_000
    pid
  end

  defp eventually(fun, tries \\ 250) do
    cond do
      fun.() ->
        true

      tries == 0 ->
        false

      true ->
        round_trip()
        Process.sleep(20)
        eventually(fun, tries - 1)
    end
  end

  # A round trip drains the default stream's queue (where drops free arrays).
  defp round_trip, do: Emily.to_list(N.add(s(), t([1.0]), t([1.0])))
end
