defmodule Emily.StreamsTest do
  use Emily.TestCase, async: false
  doctest Emily.Stream, only: [auto_spin_us: 1]

  defp on(stream, list), do: Emily.from_list(list, {:f, 32}, stream: stream)

  describe "Emily.Stream" do
    test "new/1 starts a stream of that device with its own worker" do
      st = Emily.Stream.new(:cpu)
      assert Emily.Stream.device(st) == :cpu
      assert Emily.Stream.name(st) =~ ~r/^emily-cpu-\d+$/
      refute Emily.Stream.name(st) == Emily.Stream.name(Emily.Stream.default(:cpu))
      assert l(N.add(st, on(st, [1.0]), on(st, [2.0]))) == [3.0]
    end

    test "new/1 rejects unknown devices" do
      assert_raise FunctionClauseError, fn -> Emily.Stream.new(:tpu) end
      assert_raise ArgumentError, ~r/unknown device/, fn -> N.stream_new(:tpu) end

      unless :gpu in Emily.devices() do
        assert_raise ArgumentError, ~r/not available/, fn -> Emily.Stream.new(:gpu) end
      end
    end

    test "with_stream/2 sets the process's stream, nests, and restores it (also on raise)" do
      a = Emily.Stream.new(:cpu)
      b = Emily.Stream.new(:cpu)
      default = Emily.Stream.current()
      assert default == Emily.Stream.default()

      Emily.Stream.with_stream(a, fn ->
        assert Emily.Stream.current() == a
        # Tensor creation dispatches to the current stream.
        assert N.tensor_on_stream(Emily.from_list([1.0], {:f, 32}), a)

        Emily.Stream.with_stream(b, fn ->
          assert Emily.Stream.current() == b
          assert N.tensor_on_stream(Emily.from_list([1.0], {:f, 32}), b)
        end)

        assert Emily.Stream.current() == a

        assert_raise RuntimeError, fn ->
          Emily.Stream.with_stream(b, fn -> raise "boom" end)
        end

        assert Emily.Stream.current() == a
      end)

      assert Emily.Stream.current() == default
    end

    test "the current stream is per process" do
      a = Emily.Stream.new(:cpu)

      Emily.Stream.with_stream(a, fn ->
        other = Task.async(fn -> Emily.Stream.current() end) |> Task.await()
        assert other == Emily.Stream.default()
      end)
    end

    test "a released stream refuses new work; its tensors stay usable" do
      st = Emily.Stream.new(:cpu)
      x = on(st, [1.0, 2.0])
      lazy = N.multiply(st, x, x)
      :ok = Emily.Stream.release(st)
      assert Emily.Stream.released?(st)
      assert :ok = Emily.Stream.release(st)

      assert_raise ArgumentError, ~r/has been released/, fn -> N.add(st, x, x) end
      assert_raise ArgumentError, ~r/has been released/, fn -> on(st, [1.0]) end

      assert_raise ArgumentError, ~r/has been released/, fn ->
        Emily.Stream.with_stream(st, fn -> :ok end)
      end

      refute N.tensor_on_stream(x, st)

      # Queued work completed; tensors are readable and usable on other streams.
      assert l(lazy) == [1.0, 4.0]
      assert l(N.add(s(), lazy, x)) == [2.0, 6.0]
      assert Emily.shape(x) == {2}
    end

    test "a lazy tensor of a released stream is still evaluated there when used elsewhere" do
      st = Emily.Stream.new(:cpu)
      lazy = N.exp(st, on(st, [0.0, 1.0]))
      Emily.Stream.release(st)
      assert_close(l(N.add(s(), lazy, lazy)), [2.0, 5.436564])
    end

    test "default streams cannot be released" do
      assert_raise ArgumentError, ~r/default stream/, fn ->
        Emily.Stream.release(Emily.Stream.default(:cpu))
      end

      refute Emily.Stream.released?(Emily.Stream.default(:cpu))
    end

    test "a released stream's thread is free for a new stream once its tensors are garbage" do
      # Streams of earlier tests may still be winding down.
      settle()
      st = Emily.Stream.new(:cpu)
      holder = spawn_holder(on(st, [1.0]))
      %{started: started, idle: idle} = Emily.Stream.thread_stats(:cpu)
      Emily.Stream.release(st)
      # The tensor still holds the worker.
      assert l(ask(holder)) == [1.0]
      Process.sleep(20)
      assert Emily.Stream.thread_stats(:cpu).idle == idle
      send(holder, :drop)

      wait_until(fn ->
        :erlang.garbage_collect()
        Emily.Stream.thread_stats(:cpu).idle == idle + 1
      end)

      assert Emily.Stream.thread_stats(:cpu) == %{started: started, idle: idle + 1}
      # The next stream takes that thread: no new thread.
      next = Emily.Stream.new(:cpu)
      assert l(N.add(next, on(next, [1.0]), on(next, [2.0]))) == [3.0]
      assert Emily.Stream.thread_stats(:cpu) == %{started: started, idle: idle}
      # The handle is still a valid (released) term.
      assert Emily.Stream.released?(st)
    end
  end

  describe "cross-stream use" do
    test "a lazy tensor of stream A is evaluated there, then used on B" do
      a = Emily.Stream.new(:cpu)
      b = Emily.Stream.new(:cpu)
      x = N.add(a, on(a, [1.0, 2.0]), on(a, [3.0, 4.0]))
      refute N.tensor_evaluated(x)
      y = N.multiply(b, x, on(b, [10.0, 10.0]))
      assert N.tensor_on_stream(y, b)
      assert l(y) == [40.0, 60.0]
      # x was evaluated on A on the way.
      assert N.tensor_evaluated(x)
      assert N.tensor_on_stream(x, a)
    end

    test "the other direction: B's lazy tensor used on A" do
      a = Emily.Stream.new(:cpu)
      b = Emily.Stream.new(:cpu)
      y = N.subtract(b, on(b, [5.0]), on(b, [2.0]))
      z = N.multiply(a, on(a, [2.0]), y)
      assert l(z) == [6.0]
    end

    test "lazy tensors both ways at once, chained across three streams" do
      [a, b, c] = for _ <- 1..3, do: Emily.Stream.new(:cpu)
      xa = N.add(a, on(a, [1.0]), on(a, [1.0]))
      yb = N.add(b, on(b, [10.0]), xa)
      zc = N.add(c, yb, xa)
      wa = N.add(a, zc, yb)
      assert l(wa) == [26.0]
    end

    test "an error in the source stream's graph surfaces on the using stream" do
      a = Emily.Stream.new(:cpu)
      b = Emily.Stream.new(:cpu)
      bad = N.reshape(a, on(a, [1.0, 2.0]), {3})
      y = N.exp(b, bad)
      e = assert_raise Emily.Error, fn -> l(y) end
      assert e.message =~ "reshape"
      # Both streams are fine afterwards.
      assert l(N.add(a, on(a, [1.0]), on(a, [1.0]))) == [2.0]
      assert l(N.add(b, on(b, [1.0]), on(b, [1.0]))) == [2.0]
    end

    test "crossing uses cannot deadlock (many processes, lazy tensors both ways)" do
      streams = for _ <- 1..4, do: Emily.Stream.new(:cpu)

      tasks =
        for i <- 1..32 do
          Task.async(fn ->
            [p, q] = Enum.take_random(streams, 2)
            xp = N.add(p, on(p, [i * 1.0]), on(p, [1.0]))
            xq = N.add(q, on(q, [i * 2.0]), on(q, [1.0]))
            # Each side uses the other's lazy tensor, while other tasks do the same.
            yq = N.add(q, xp, xq)
            yp = N.add(p, xq, xp)
            {l(yq), l(yp), i}
          end)
        end

      for {yq, yp, i} <- Task.await_many(tasks, 20_000) do
        assert yq == [3.0 * i + 2.0]
        assert yp == [3.0 * i + 2.0]
      end
    end

    test "shared weights: evaluated once, read concurrently from many streams" do
      w =
        Emily.from_list(Enum.map(1..16, &(&1 * 1.0)), {:f, 32},
          shape: {4, 4},
          stream: Emily.Stream.new(:cpu)
        )

      Emily.eval(w)
      assert N.tensor_evaluated(w)
      streams = for _ <- 1..8, do: Emily.Stream.new(:cpu)

      results =
        streams
        |> Enum.with_index()
        |> Enum.map(fn {st, i} ->
          Task.async(fn ->
            Emily.Stream.with_stream(st, fn ->
              x = Emily.from_list([1.0 * i, 0.0, 0.0, 1.0], {:f, 32}, shape: {1, 4})
              for _ <- 1..50, do: l(N.matmul(st, x, w))
            end)
          end)
        end)
        |> Task.await_many(30_000)

      for {rows, i} <- Enum.with_index(results) do
        # Row i of x @ w: i * w[0] + w[3] = i * [1, 2, 3, 4] + [13, 14, 15, 16].
        expected = Enum.map(1..4, &(i * &1 + 12.0 + &1))
        assert Enum.uniq(rows) == [expected]
      end
    end
  end

  describe "eval and async_eval" do
    test "eval/1 takes tensors of several streams" do
      a = Emily.Stream.new(:cpu)
      b = Emily.Stream.new(:cpu)
      xa = N.add(a, on(a, [1.0]), on(a, [1.0]))
      xb = N.add(b, on(b, [2.0]), on(b, [2.0]))
      assert Emily.eval([xa, xb, xa]) == :ok
      assert N.tensor_evaluated(xa) and N.tensor_evaluated(xb)
      assert Emily.eval([]) == :ok
    end

    test "eval/1 over several streams raises the error of a failing one, and the others finish" do
      a = Emily.Stream.new(:cpu)
      b = Emily.Stream.new(:cpu)
      good = N.add(a, on(a, [1.0]), on(a, [1.0]))
      bad = N.matmul(b, on(b, [1.0, 2.0]), on(b, [1.0, 2.0, 3.0]))
      assert_raise Emily.Error, ~r/matmul/, fn -> Emily.eval([good, bad]) end
      assert N.tensor_evaluated(good)
    end

    test "async_eval/1 returns at once; a later wait finds the value" do
      st = Emily.Stream.new(:cpu)
      x = N.full(st, {512, 512}, 1.0, {:f, 32})
      y = Enum.reduce(1..4, x, fn _, acc -> N.matmul(st, acc, x) end)
      assert Emily.async_eval(y) == :ok
      assert Emily.async_eval([y, x]) == :ok
      # The worker goes on with later jobs while the evaluation runs.
      assert l(N.add(st, on(st, [1.0]), on(st, [1.0]))) == [2.0]
      assert Enum.take(l(y), 2) == [512.0 ** 4, 512.0 ** 4]
    end

    test "async_eval/1 errors surface at the waiting call; the stream lives on" do
      st = Emily.Stream.new(:cpu)
      bad = N.reshape(st, on(st, [1.0, 2.0]), {3})
      assert Emily.async_eval(bad) == :ok
      assert_raise Emily.Error, ~r/reshape/, fn -> Emily.eval(bad) end
      assert l(N.add(st, on(st, [1.0]), on(st, [1.0]))) == [2.0]
    end
  end

  defp spawn_holder(tensor) do
    spawn_link(fn -> hold(tensor) end)
  end

  defp hold(tensor) do
    receive do
      {:get, from} ->
        send(from, {:tensor, tensor})
        hold(tensor)

      :drop ->
        :ok
    end
  end

  defp ask(holder) do
    send(holder, {:get, self()})
    assert_receive {:tensor, t}
    t
  end

  defp settle(last \\ nil, stable \\ 0) do
    :erlang.garbage_collect()
    Process.sleep(30)
    now = Emily.Stream.thread_stats(:cpu)

    cond do
      stable >= 3 -> :ok
      now == last -> settle(now, stable + 1)
      true -> settle(now, 0)
    end
  end

  defp wait_until(fun, tries \\ 100) do
    cond do
      fun.() -> :ok
      tries == 0 -> :timeout
      true -> Process.sleep(20) && wait_until(fun, tries - 1)
    end
  end
end
