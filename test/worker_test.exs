defmodule Emily.WorkerTest do
  use Emily.TestCase, async: false

  test "an MLX error leaves the worker usable" do
    stream = Emily.Stream.new(:cpu)
    x = Emily.from_list([1.0, 2.0], {:f, 32}, stream: stream)
    bad = N.matmul(stream, x, Emily.from_list([1.0, 2.0, 3.0], {:f, 32}, stream: stream))
    assert_raise Emily.Error, ~r/matmul/, fn -> Emily.eval(bad) end
    # The failed tensor keeps its error; everything else on the worker goes on.
    assert_raise Emily.Error, fn -> Emily.to_binary(bad) end
    assert l(N.add(stream, x, x)) == [2.0, 4.0]
  end

  test "errors propagate through lazy chains and name the failing op" do
    x = t([1.0, 2.0])
    bad = N.reshape(s(), x, {3})
    chained = N.exp(s(), N.add(s(), bad, x))
    e = assert_raise Emily.Error, fn -> l(chained) end
    assert e.message =~ "reshape:"
    assert e.message =~ "f32[2]"
  end

  test "a long eval on one worker does not stall other processes" do
    stream = Emily.Stream.new(:cpu)
    # Elementwise kernels run on the worker's one thread (BLAS would take every core and
    # measure the OS, not the schedulers): about a second of MLX work.
    a = N.full(stream, {4_000_000}, 0.5, {:f, 32})
    chain = Enum.reduce(1..40, a, fn _, acc -> N.sin(stream, N.exp(stream, acc)) end)

    parent = self()

    ticker =
      spawn_link(fn ->
        ticks = for _ <- 1..20, do: measure_tick()
        send(parent, {:ticks, ticks})
      end)

    task = Task.async(fn -> :timer.tc(fn -> Emily.eval(chain) end) end)
    assert_receive {:ticks, ticks}, 10_000
    {eval_us, :ok} = Task.await(task, 60_000)
    refute Process.alive?(ticker)
    # Each tick sleeps 5 ms; a blocked scheduler would stretch one to the eval's length.
    # (On a loaded machine the OS may delay a tick too, so the bound is relative.)
    eval_ms = div(eval_us, 1000)
    assert eval_ms > 200, "the eval was too short (#{eval_ms} ms) to show anything"

    assert Enum.max(ticks) < max(50, div(eval_ms, 4)),
           "a 5 ms sleep took #{Enum.max(ticks)} ms during a #{eval_ms} ms eval"
  end

  test "other streams keep working while one worker is busy" do
    busy = Emily.Stream.new(:cpu)
    n = 1536
    a = N.full(busy, {n, n}, 1.0, {:f, 32})
    chain = Enum.reduce(1..6, a, fn _, acc -> N.matmul(busy, acc, a) end)
    task = Task.async(fn -> Emily.eval(chain) end)

    other = Emily.Stream.new(:cpu)

    {us, value} =
      :timer.tc(fn ->
        l(
          N.add(
            other,
            Emily.from_list([1.0], {:f, 32}, stream: other),
            Emily.from_list([2.0], {:f, 32}, stream: other)
          )
        )
      end)

    assert value == [3.0]
    Task.await(task, 60_000)
    assert us < 2_000_000
  end

  test "dropped streams give their threads back: churn does not grow the thread count" do
    churn = fn ->
      for _ <- 1..20 do
        # Each stream and its tensors are garbage when the task ends.
        Task.async(fn ->
          st = Emily.Stream.new(:cpu)
          one = Emily.from_list([1.0], {:f, 32}, stream: st)
          [2.0] = Emily.to_list(N.add(st, one, one))
        end)
        |> Task.await()

        # A task replies before it exits, and its heap (the stream's last handles) is
        # freed as it exits, on a busy machine a while later: the next stream is made
        # once this one's thread is idle.
        wait_until(fn -> Emily.Stream.thread_stats(:cpu).idle > 0 end)
      end
    end

    churn.()
    Process.sleep(100)
    before = thread_count()
    for _ <- 1..3, do: churn.()
    Process.sleep(100)
    # Neither Emily's threads nor MLX's (one per stream it ever saw) grew with the 60
    # streams, even where a stream started while the thread of the one dropped just
    # before was still ending its session.
    assert thread_count() <= before
  end

  test "with_stream/2 sets the process's stream and selected/0 reports it" do
    assert Emily.Stream.selected() == nil
    assert Emily.Stream.current() == Emily.Stream.default()
    a = Emily.Stream.new(:cpu)

    Emily.Stream.with_stream(a, fn ->
      assert Emily.Stream.selected() == a
      assert Emily.Stream.current() == a
      assert Emily.Native.tensor_on_stream(Emily.from_list([1.0], {:f, 32}), a)
    end)

    assert Emily.Stream.selected() == nil
    assert_raise RuntimeError, fn -> Emily.Stream.with_stream(a, fn -> raise "boom" end) end
    assert Emily.Stream.selected() == nil
  end

  defp measure_tick do
    {us, _} = :timer.tc(fn -> Process.sleep(5) end)
    div(us, 1000)
  end

  defp wait_until(done?, tries \\ 5_000) do
    cond do
      done?.() ->
        :ok

      tries == 0 ->
        flunk("timed out")

      true ->
        Process.sleep(1)
        wait_until(done?, tries - 1)
    end
  end

  defp thread_count do
    case File.ls("/proc/self/task") do
      {:ok, tasks} -> length(tasks)
      _ -> 0
    end
  end
end
