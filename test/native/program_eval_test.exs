defmodule Emily.ProgramEvalTest do
  # Program.eval/3: a program built and evaluated inside the call, on the calling
  # scheduler's own MLX stream (a normal one for a CPU program MLX takes quickly, a
  # dirty one otherwise), when its inputs are evaluated.
  use Emily.TestCase, async: false

  alias Emily.Program

  # Emily.SampleProgram (test/support): exp(-sum((x * w + x)^2, axis 1) / 100).
  alias Emily.SampleProgram, as: Sample

  defp inputs, do: Sample.inputs()

  test "gives the hand-computed values and program_run's results, evaluated" do
    ins = inputs()
    p = Program.new(Sample.instructions(), inputs: 3)
    [out] = Program.eval(p, ins)
    assert_close(l(out), Sample.expected())
    assert l(out) == l(hd(Program.run(p, ins)))
    assert Emily.shape(out) == {2}
    assert N.tensor_on_stream(out, s())
    # Evaluated: its bytes come back without a trip to the worker.
    assert {:ok, bin} = N.to_binary(make_ref(), out)
    assert bin == Emily.to_binary(out)
  end

  test "runs in the call only when every input is evaluated; lazy inputs are evaluated first" do
    p = Program.new([{:add, [0, 1]}], inputs: 2)
    x = N.multiply(s(), t([2.0]), t([3.0]))
    y = t([1.0])
    assert N.program_eval(s(), p, [x, y]) == :pending
    # Nothing was queued or changed: the inputs are still lazy.
    assert is_reference(N.to_binary(make_ref(), x))
    assert l(hd(Program.eval(p, [x, y]))) == [7.0]
    Emily.eval([x, y])
    assert [out] = N.program_eval(s(), p, [x, y])
    assert l(out) == [7.0]
  end

  test "outputs are ordinary tensors of the stream: ops, describe, other streams, release" do
    [a, b] = Enum.map([[1.0, 2.0], [10.0, 20.0]], &t/1)
    Emily.eval([a, b])
    p = Program.new([{:add, [0, 1]}, {:multiply, [0, 1]}], inputs: 2, outputs: [2, 3, 0])
    st = Emily.Stream.new(:cpu)
    [sum, prod, same] = Program.eval(p, [a, b], stream: st)
    assert Enum.all?([sum, prod, same], &N.tensor_on_stream(&1, st))
    # The stream's own worker holds them too (a later op there finds them).
    assert l(N.subtract(st, prod, sum)) == [-1.0, 18.0]
    assert Emily.shape(sum) == {2} and Emily.dtype(sum) == {:f, 32}
    assert l(N.add(s(), sum, same)) == [12.0, 24.0]
    assert Emily.release(sum) == :ok
    assert_raise Emily.Error, ~r/released/, fn -> Program.eval(p, [sum, b]) end
    assert l(prod) == [10.0, 40.0]
  end

  test "strided outputs come back row-contiguous; integer, bool and empty outputs" do
    x = t(Enum.map(1..6, &(&1 * 1.0)), {:f, 32}, {2, 3})
    i = t([1, 2, 3], {:s, 32})
    e = t([], {:f, 32}, {0, 3})
    Emily.eval([x, i, e])

    p =
      Program.new(
        [{:transpose, [0, [1, 0]]}, {:multiply, [1, 1]}, {:greater, [1, 1]}, {:exp, [2]}],
        inputs: 3,
        outputs: [3, 4, 5, 6]
      )

    [tr, sq, gt, empty] = Program.eval(p, [x, i, e])
    assert Emily.shape(tr) == {3, 2}
    assert l(tr) == [1.0, 4.0, 2.0, 5.0, 3.0, 6.0]
    assert l(sq) == [1, 4, 9] and Emily.dtype(sq) == {:s, 32}
    assert l(gt) == [false, false, false]
    assert Emily.shape(empty) == {0, 3} and l(empty) == []
  end

  test "outputs that come out strided on the caller's scheduler are copied, there and after" do
    # On the caller's scheduler the graph is first built without MLX's `contiguous`
    # (most programs' outputs never need it): a transpose, and an op on it, come out
    # column-major, so that run is redone on the dirty path and later runs build it.
    x = t(Enum.map(1..6, &(&1 * 1.0)), {:f, 32}, {2, 3})
    Emily.eval(x)

    for compile <- [false, true] do
      p =
        Program.new([{:transpose, [0, [1, 0]]}, {:negative, [1]}, {:negative, [0]}],
          inputs: 1,
          outputs: [1, 2, 3],
          compile: compile
        )

      # (A compiled program takes the caller's scheduler once a dirty run compiled it.)
      if compile, do: Program.eval(p, [x], stream: cpu())

      for _ <- 1..3 do
        ref = make_ref()
        [tr, neg_tr, neg] = taken(measuring(p, [x], ref), ref)
        assert l(tr) == [1.0, 4.0, 2.0, 5.0, 3.0, 6.0]
        assert l(neg_tr) == [-1.0, -4.0, -2.0, -5.0, -3.0, -6.0]
        assert l(neg) == Enum.map(1..6, &(-&1 * 1.0))
        assert Emily.shape(neg_tr) == {3, 2}
      end
    end
  end

  test "a compiled CPU program runs on the calling thread too, from many at once" do
    ins = inputs()
    Emily.eval(ins)
    p = Program.new(Sample.instructions(), inputs: 3, compile: true)
    assert N.program_compiled(p)
    refute N.program_compiled(Program.new(Sample.instructions(), inputs: 3))
    # On the CPU, first on the dirty scheduler's path (which compiles it), each thread's
    # compile cache holding its own entry; then, for inputs of the shapes it was compiled
    # for, on the caller's own scheduler too. On a GPU, on the stream's worker.
    assert N.program_eval_async(s(), p, ins, make_ref()) == :dirty

    case Emily.Stream.device(s()) do
      :cpu ->
        assert [out] = N.program_eval(s(), p, ins)
        assert {:ok, _} = N.to_binary(make_ref(), out)
        assert_close(l(out), Sample.expected())
        # (It answers :dirty while MLX has other work in flight, as for any program.)
        [out] =
          Enum.find_value(1..100, fn _ ->
            ref = make_ref()

            case N.program_eval_async(s(), p, ins, ref) do
              :dirty ->
                Process.sleep(10)
                nil

              outputs when is_list(outputs) ->
                outputs

              pending ->
                assert :ok = Emily.await(ref)
                N.program_eval_take(pending)
            end
          end)

        assert_close(l(out), Sample.expected())

        # Other shapes: the dirty path again, until compiled for them.
        wide =
          Enum.map(ins, &if(Emily.shape(&1) == {}, do: &1, else: N.concatenate(s(), [&1, &1], 0)))

        Emily.eval(wide)
        assert N.program_eval_async(s(), p, wide, make_ref()) == :dirty

      :gpu ->
        assert N.program_eval(s(), p, ins) == :worker
    end

    [out] = Program.eval(p, ins)
    assert_close(l(out), Sample.expected())

    # Many processes (so every dirty scheduler) on many streams (on a GPU build, both
    # devices: a thread's compiled copies for each device are kept apart), with programs
    # made and dropped meanwhile (each drop erases its entries from every thread's
    # cache); and the same instructions on other inputs' shapes.
    x = t(Enum.map(1..6, &(&1 * 0.5))) |> then(&N.reshape(s(), &1, [2, 3]))
    Emily.eval(x)

    1..64
    |> Task.async_stream(
      fn i ->
        st = if rem(i, 2) == 0, do: s(), else: Emily.Stream.new(:cpu)
        [out] = Program.eval(p, ins, stream: st)
        assert_close(l(out), Sample.expected())
        fresh = Program.new([{:multiply, [0, 0]}, {:add, [1, 0]}], inputs: 1, compile: true)
        [y] = Program.eval(fresh, [x], stream: st)
        assert l(y) == Enum.map(1..6, &(&1 * 0.5 * (&1 * 0.5) + &1 * 0.5))
      end,
      max_concurrency: 8,
      # (A GPU's first compile of a program can take seconds.)
      timeout: 60_000
    )
    |> Enum.each(&assert(&1 == {:ok, true}))
  end

  test "a compiled CPU program is counted by its fused graph, not its instructions" do
    # 64 elementwise instructions: more than the caller's scheduler takes uncounted (40
    # nodes), but one fused kernel once compiled.
    x = t([0.1, 0.2, 0.3])
    Emily.eval(x)
    p = Program.new(sin_cos_chain(64), inputs: 1, compile: true)
    expected = sin_cos_values(64, [0.1, 0.2, 0.3])

    if Emily.Stream.device(s()) == :cpu do
      # The first run, on the dirty scheduler, compiles it and counts its fused graph.
      assert N.program_eval_async(s(), p, [x], make_ref()) == :dirty
      assert [out] = N.program_eval(s(), p, [x])
      assert_close(l(out), expected)

      ref = make_ref()
      [out] = taken(fn -> N.program_eval_async(s(), p, [x], ref) end, ref)
      assert_close(l(out), expected)

      # Over 256 instructions, never: a thread's first call would trace it there.
      q = Program.new(sin_cos_chain(300), inputs: 1, compile: true)
      assert [_] = N.program_eval(s(), q, [x])
      for _ <- 1..10, do: assert(N.program_eval_async(s(), q, [x], make_ref()) == :dirty)
    end

    assert_close(l(hd(Program.eval(p, [x]))), expected)
  end

  # `n` instructions alternating sin and cos, from input 0; and their values from `xs`,
  # computed on the host.
  defp sin_cos_chain(n),
    do: for(k <- 0..(n - 1), do: {if(rem(k, 2) == 0, do: :sin, else: :cos), [k]})

  defp sin_cos_values(n, xs) do
    Enum.map(xs, fn v ->
      Enum.reduce(0..(n - 1), v, fn k, acc ->
        if rem(k, 2) == 0, do: :math.sin(acc), else: :math.cos(acc)
      end)
    end)
  end

  # mx::compile's tracing recurses along the graph: a compiled chain of 2,000 ops
  # overflowed a dirty scheduler's stack, one of 20,000 a worker's, killing the VM.
  test "a compiled program deeper than a thread's stack can trace runs where it fits" do
    x = t([0.1, 0.2, 0.3])
    Emily.eval(x)

    for n <- [3_000, 40_000] do
      p = Program.new(sin_cos_chain(n), inputs: 1, compile: true)
      expected = sin_cos_values(n, [0.1, 0.2, 0.3])

      # Too deep for a dirty scheduler: the stream's worker runs it (compiled at 3,000
      # ops; at 40,000, beyond the worker's stack too, uncompiled).
      assert N.program_eval(s(), p, [x]) == :worker
      assert_close(l(hd(Program.eval(p, [x]))), expected)
      assert_close(l(hd(Program.run(p, [x]))), expected)
    end
  end

  test "MLX errors raise at the call, naming the instruction, shapes and dtypes" do
    x = t([1.0, 2.0])
    Emily.eval(x)
    p = Program.new([{:exp, [0]}, {:reshape, [1, {5}]}, {:negative, [2]}], inputs: 1)
    e = assert_raise Emily.Error, fn -> Program.eval(p, [x]) end
    assert e.message =~ "program_eval"
    assert e.message =~ "instruction 1 (reshape)"
    assert e.message =~ "f32[2]"
    # The thread, and the stream, go on.
    assert l(hd(Program.eval(Program.new([{:exp, [0]}], inputs: 1), [x]))) ==
             l(N.exp(s(), x))
  end

  test "bad calls raise ArgumentError" do
    x = t([1.0])
    Emily.eval(x)
    p = Program.new([{:exp, [0]}], inputs: 1)
    assert_raise ArgumentError, ~r/takes 1 inputs, got 2/, fn -> Program.eval(p, [x, x]) end
    st = Emily.Stream.new(:cpu)
    Emily.Stream.release(st)
    assert_raise ArgumentError, ~r/released/, fn -> Program.eval(p, [x], stream: st) end
  end

  # A 2048^3 f32 matmul: 17 GFLOP outlast the CPU call's wait (about a millisecond) on
  # any CPU. Small integers, so every product and sum is exact in f32.
  defp big do
    x =
      Emily.from_binary(
        :binary.copy(for(v <- 0..7, into: <<>>, do: <<v::32-float-little>>), div(2048 * 2048, 8)),
        {2048, 2048},
        {:f, 32}
      )

    Emily.eval(x)
    x
  end

  # `program_eval_async` declines (`:dirty`) while MLX has much work in flight (another
  # test's): retried until it takes the program.
  defp when_idle(call, tries \\ 1000) do
    case call.() do
      :dirty when tries > 0 ->
        Process.sleep(10)
        when_idle(call, tries - 1)

      result ->
        result
    end
  end

  # The outputs of a call that `program_eval_async` takes (retried while it declines):
  # evaluated within the call's wait, or past it (a pending evaluation and a message),
  # depending on the machine's load; both give the same tensors. The message may come
  # late: the scheduler's MLX stream may still be computing another test's abandoned
  # 2048^3 matmul (MLX counts only every tenth dispatch as a task in flight, so the
  # call may find MLX idle while it runs).
  defp taken(call, ref) do
    case when_idle(call) do
      outs when is_list(outs) ->
        outs

      pending ->
        assert_receive {^ref, :ok}, 60_000

        # (`:dirty` once for a program whose outputs come out strided.)
        with :dirty <- N.program_eval_take(pending), do: taken(call, ref)
    end
  end

  # A `program_eval_async` call for `taken/2` that, each time it declines, runs the
  # program on the dirty scheduler, where its hand-over to MLX is measured.
  defp measuring(program, inputs, ref) do
    fn ->
      with :dirty <- N.program_eval_async(cpu(), program, inputs, ref) do
        Program.eval(program, inputs, stream: cpu())
        :dirty
      end
    end
  end

  # `program_eval_async` takes CPU programs only: these tests name the CPU stream (the
  # default stream of a CUDA build is the GPU's, whose programs go to `program_eval`).
  test "on the CPU a small program is evaluated in the call, without a dirty scheduler" do
    ins = inputs()
    Emily.eval(ins)
    p = Program.new(Sample.instructions(), inputs: 3)
    ref = make_ref()
    assert [out] = taken(fn -> N.program_eval_async(cpu(), p, ins, ref) end, ref)
    assert_close(l(out), Sample.expected())
    assert {:ok, _} = N.to_binary(make_ref(), out)
  end

  test "a larger graph goes to a dirty scheduler until a run shows its hand-over to MLX short" do
    x = t([0.5])
    Emily.eval(x)
    sines = fn n -> Enum.reduce(1..n, 0.5, fn _, v -> :math.sin(v) end) end

    # 60 MLX nodes, over the 40 a graph may have unmeasured; on 1 element each, MLX
    # takes it in well under the 500 us allowed once measured.
    chain = Program.new(for(i <- 0..59, do: {:sin, [i]}), inputs: 1)
    assert N.program_eval_async(cpu(), chain, [x], make_ref()) == :dirty
    [y] = Program.eval(chain, [x], stream: cpu())
    assert_close(l(y), [sines.(60)])

    # Each dirty run measures the hand-over again (a busy machine may make one slow).
    ref = make_ref()
    assert l(hd(taken(measuring(chain, [x], ref), ref))) == l(y)

    # 3000 nodes: building them alone, and MLX's waits for its own earlier work while
    # they are handed over, take milliseconds.
    long = Program.new(for(i <- 0..2999, do: {:sin, [i]}), inputs: 1)
    [z] = Program.eval(long, [x], stream: cpu())
    assert_close(l(z), [sines.(3000)])
    assert N.program_eval_async(cpu(), long, [x], make_ref()) == :dirty
  end

  # While `program_eval_async` queues a graph, MLX's thread for the stream is held (so
  # that it takes the graph in one go); MLX itself waits for that thread once enough of
  # the graph is queued, so the hold ends by itself before.
  test "a graph queued past MLX's limit of tasks in flight is not held up" do
    x = t([0.5])
    Emily.eval(x)
    # 80 nodes: some 160 tasks for MLX, 16 task groups where it waits past 10 (and a
    # hand-over short enough to be taken).
    chain = Program.new(for(i <- 0..79, do: {:sin, [i]}), inputs: 1)
    [want] = Program.eval(chain, [x], stream: cpu())
    ref = make_ref()
    for _ <- 1..20, do: assert(l(hd(taken(measuring(chain, [x], ref), ref))) == l(want))
    assert_close(l(want), [Enum.reduce(1..80, 0.5, fn _, v -> :math.sin(v) end)])
  end

  @tag :gpu
  test "a GPU program goes to a dirty scheduler" do
    ins = inputs()
    Emily.eval(ins)
    p = Program.new(Sample.instructions(), inputs: 3)
    gpu = Emily.Stream.default(:gpu)
    assert N.program_eval_async(gpu, p, ins, make_ref()) == :dirty
    [out] = Program.eval(p, ins, stream: gpu)
    assert N.tensor_on_stream(out, gpu)
    assert_close(l(out), Sample.expected())
  end

  test "a graph that outlasts the wait comes back by message, errors too" do
    x = big()
    p = Program.new([{:matmul, [0, 0]}, {:slice, [1, [5, 0], [6, 16], [1, 1]]}], inputs: 1)
    ref = make_ref()
    pending = when_idle(fn -> N.program_eval_async(cpu(), p, [x], ref) end)
    assert is_reference(pending)
    assert_raise ArgumentError, ~r/not finished/, fn -> N.program_eval_take(pending) end
    assert_receive {^ref, :ok}, 60_000
    [row] = N.program_eval_take(pending)
    assert_raise ArgumentError, ~r/taken already/, fn -> N.program_eval_take(pending) end
    # x[i][k] = k mod 8, so (x . x)[i][j] = sum over k of (k mod 8) * (j mod 8)
    # = (j mod 8) * 256 * (0 + ... + 7).
    assert l(row) == for(j <- 0..15, do: rem(j, 8) * 256 * 28.0)
    # Run again, the call now sleeps at once (no poll): the same values.
    assert l(hd(Program.eval(p, [x], stream: cpu()))) == l(row)

    # An error met on MLX's thread (a singular matrix) arrives the same way, and the
    # stream goes on.
    z = t([0.0, 0.0, 0.0, 0.0], {:f, 32}, {2, 2})
    Emily.eval(z)
    bad = Program.new([{:matmul, [0, 0]}, {:inv, [1]}], inputs: 2, outputs: [2, 3])
    e = assert_raise Emily.Error, fn -> Program.eval(bad, [x, z], stream: cpu()) end
    assert e.message =~ "program_eval"
    assert e.message =~ "f32[2048x2048], f32[2x2]"
    assert l(hd(Program.eval(Program.new([{:exp, [0]}], inputs: 1), [z]))) == [1.0, 1.0, 1.0, 1.0]
  end

  test "a caller that dies while MLX evaluates leaves nothing behind" do
    x = big()
    p = Program.new([{:matmul, [0, 0]}], inputs: 1)
    parent = self()

    {pid, mon} =
      spawn_monitor(fn ->
        pending = when_idle(fn -> N.program_eval_async(cpu(), p, [x], make_ref()) end)
        send(parent, {:pending, is_reference(pending)})
        Process.sleep(:infinity)
      end)

    assert_receive {:pending, true}, 10_000
    Process.exit(pid, :kill)
    assert_receive {:DOWN, ^mon, :process, ^pid, :killed}
    ins = inputs()
    Emily.eval(ins)
    [out] = Program.eval(Program.new(Sample.instructions(), inputs: 3), ins)
    assert_close(l(out), Sample.expected())
  end

  test "many processes at once, each on its own stream or all on one" do
    ins = inputs()
    Emily.eval(ins)
    p = Program.new(Sample.instructions(), inputs: 3)
    shared = Emily.Stream.new(:cpu)

    results =
      for i <- 1..16 do
        Task.async(fn ->
          st = if rem(i, 2) == 0, do: shared, else: Emily.Stream.new(:cpu)
          for _ <- 1..50, do: l(hd(Program.eval(p, ins, stream: st)))
        end)
      end
      |> Task.await_many(60_000)
      |> List.flatten()
      |> Enum.uniq()

    assert length(results) == 2
    assert_close(results, Sample.expected())
  end
end
