defmodule Emily.ProgramTest do
  use Emily.TestCase, async: false

  alias Emily.Program

  # Emily.SampleProgram (test/support): exp(-sum((x * w + x)^2, axis 1) / 100).
  alias Emily.SampleProgram, as: Sample

  defp inputs, do: List.to_tuple(Sample.inputs())

  defp by_ops({x, w, k}) do
    st = s()
    y = N.sum(st, N.square(st, N.add(st, N.multiply(st, x, w), x)), [1], false)
    N.exp(st, N.multiply(st, y, k))
  end

  defp program(opts), do: Program.new(Sample.instructions(), [inputs: 3] ++ opts)

  defp run(program, {x, w, k}, opts \\ []), do: Program.run(program, [x, w, k], opts)

  test "a program gives the op-by-op results (and the hand-computed values)" do
    ins = inputs()
    [out] = run(program([]), ins)
    assert_close(l(out), Sample.expected(), 1.0e-5)
    assert l(out) == l(by_ops(ins))
    assert Emily.shape(out) == {2}
  end

  test "build_time/0 counts each run/3 and the time spent building its graph" do
    # x + x + ... + x, 2001 terms: a graph of 2000 nodes takes the worker measurable time
    # to build. (The suite is not async: no other test runs programs meanwhile.)
    chain = Program.new(for(i <- 0..1999, do: {:add, [i, 0]}), inputs: 1)
    {runs0, us0} = Program.build_time()
    outs = for _ <- 1..3, do: Program.run(chain, [t([1.0])])
    assert Enum.map(outs, fn [out] -> l(out) end) == List.duplicate([2001.0], 3)
    {runs1, us1} = Program.build_time()
    assert runs1 - runs0 == 3
    assert us1 > us0
  end

  test "dynamic updates sharing start indices clamp them per target, as one by one" do
    # (A program's replay clamps each starts array once per limit: cpp/index.h.)
    instrs = [
      {:slice_update_dynamic, [0, 2, 3, [0]]},
      {:slice_update_dynamic, [1, 2, 3, [0]]},
      {:slice_update_dynamic, [0, 2, 4, [0]]},
      {:slice_update_dynamic, [1, 2, 3, [0]]}
    ]

    p = Program.new(instrs, inputs: 5, outputs: [5, 6, 7, 8])
    a6 = t(Enum.map(0..5, &(&1 * 1.0)))
    a4 = t([0.0, 1.0, 2.0, 3.0])
    u = t([-1.0, -2.0])
    ins = [a6, a4, u, t([4], {:s, 32}), t([1], {:s, 64})]

    for compile <- [false, true] do
      outs =
        Program.run(
          if(compile,
            do: Program.new(instrs, inputs: 5, outputs: [5, 6, 7, 8], compile: true),
            else: p
          ),
          ins
        )

      assert Enum.map(outs, &l/1) == [
               [0.0, 1.0, 2.0, 3.0, -1.0, -2.0],
               [0.0, 1.0, -1.0, -2.0],
               [0.0, -1.0, -2.0, 3.0, 4.0, 5.0],
               [0.0, 1.0, -1.0, -2.0]
             ]
    end
  end

  test "a compiled program equals the uncompiled one, run after run" do
    ins = inputs()
    compiled = program(compile: true)
    plain = program([])
    for _ <- 1..3, do: assert_close(l(hd(run(compiled, ins))), l(hd(run(plain, ins))), 1.0e-6)

    assert Program.info(compiled) == %{
             inputs: 3,
             instructions: 6,
             outputs: 1,
             compile: true,
             tapes: 0
           }
  end

  test "a compiled program retraces for new shapes" do
    compiled = program(compile: true)
    {_x, _w, k} = inputs()
    x = t([1.0, 2.0], {:f, 32}, {1, 2})
    w = t([1.0, 1.0], {:f, 32}, {1, 2})
    # (1*1+1)^2 + (2*1+2)^2 = 4 + 16 = 20; exp(-0.2) = 0.818731.
    assert_close(l(hd(Program.run(compiled, [x, w, k]))), [0.818731])
    assert_close(l(hd(run(compiled, inputs()))), Sample.expected())
  end

  test "compiled programs fuse on the CPU: MLX's compiler runs inside the VM" do
    with_cpu(fn ->
      # A long elementwise chain is what MLX fuses into a generated kernel: built with the
      # system C++ compiler (forked from the VM) the first time, cached on disk, and loaded
      # into the VM. Without a working compiler MLX silently runs the ops unfused.
      chain = for i <- 0..9, do: if(rem(i, 2) == 0, do: {:sin, [i]}, else: {:cos, [i]})
      p = Program.new(chain, inputs: 1, compile: true)
      plain = Program.new(chain, inputs: 1)
      x = t(Enum.map(1..64, &(&1 / 64)))
      assert_close(l(hd(Program.run(p, [x]))), l(hd(Program.run(plain, [x]))), 1.0e-5)

      loaded = Regex.scan(~r{/mlx/[^/\s]+/cpu/lib\S*Sin\S*\.so}, File.read!("/proc/self/maps"))
      assert loaded != [], "MLX loaded no fused kernel (is a C++ compiler on the PATH?)"
    end)
  end

  test "outputs: any slots, inputs included, in order; default is the last instruction's" do
    {x, w, k} = inputs()
    p = Program.new([{:add, [0, 1]}, {:negative, [2]}], inputs: 2, outputs: [3, 0, 2, 3])
    [a, b, c, d] = Program.run(p, [x, w])
    assert l(a) == [-1.5, -1.0, -5.0, -5.0, -5.0, -5.5]
    assert l(b) == l(x)
    assert l(c) == [1.5, 1.0, 5.0, 5.0, 5.0, 5.5]
    assert l(d) == l(a)
    assert Program.info(Program.new([{:add, [0, 1]}, {:negative, [2]}], inputs: 2)).outputs == 1
    _ = k
  end

  test "all argument kinds: shapes, dtypes, floats, tensor lists, no tensors at all" do
    p =
      Program.new(
        [
          {:full, [{2, 2}, :infinity, {:f, 32}]},
          {:arange, [0, 4, 1, {:f, 32}]},
          {:reshape, [1, [2, 2]]},
          {:minimum, [0, 2]},
          {:concatenate, [[3, 3], 0]},
          {:astype, [4, {:s, 32}]}
        ],
        inputs: 0
      )

    [out] = Program.run(p, [])
    assert Emily.dtype(out) == {:s, 32}
    assert Emily.shape(out) == {4, 2}
    assert l(out) == [0, 1, 2, 3, 0, 1, 2, 3]
  end

  test "inputs from other streams, lazy or not; runs on any stream, concurrently" do
    a = Emily.Stream.new(:cpu)
    p = Program.new([{:add, [0, 1]}], inputs: 2, compile: true)

    x =
      N.multiply(
        a,
        Emily.from_list([2.0], {:f, 32}, stream: a),
        Emily.from_list([3.0], {:f, 32}, stream: a)
      )

    y = Emily.from_list([1.0], {:f, 32})

    results =
      for _ <- 1..8 do
        Task.async(fn ->
          st = Emily.Stream.new(:cpu)
          [out] = Program.run(p, [x, y], stream: st)
          true = N.tensor_on_stream(out, st)
          l(out)
        end)
      end
      |> Task.await_many(20_000)

    assert Enum.uniq(results) == [[7.0]]
  end

  test "MLX errors name the instruction and surface at the waiting call" do
    p = Program.new([{:exp, [0]}, {:reshape, [1, {5}]}, {:negative, [2]}], inputs: 1)
    [out] = Program.run(p, [t([1.0, 2.0])])
    e = assert_raise Emily.Error, fn -> l(out) end
    assert e.message =~ "program_run"
    assert e.message =~ "instruction 1 (reshape)"
    # Compiled too, and the stream lives on.
    pc =
      Program.new([{:exp, [0]}, {:reshape, [1, {5}]}, {:negative, [2]}], inputs: 1, compile: true)

    assert_raise Emily.Error, ~r/instruction 1 \(reshape\)/, fn ->
      l(hd(Program.run(pc, [t([1.0, 2.0])])))
    end

    assert l(N.add(s(), t([1.0]), t([1.0]))) == [2.0]
  end

  test "malformed programs raise ArgumentError when built" do
    bad = [
      {[{:nope, [0]}], ~r/not an op of the op table/},
      {[{:add, [0]}], ~r/expected 2 arguments, got 1/},
      {[{:add, [0, 5]}], ~r/slot index below 1/},
      {[{:add, [0, -1]}], ~r/slot index/},
      {[{:add, [0, :x]}], ~r/slot index/},
      {[{:sum, [0, :axes, false]}], ~r/bad argument `axes`/},
      {[{:full, [{-1}, 1.0, {:f, 32}]}],
       ~r/instruction 0 \(full\): bad argument `shape`: \{-1\}/},
      {[{:astype, [0, {:f, 8}]}], ~r/bad argument `dtype`/},
      {[{:sum, [0, [0 | 1], false]}], ~r/bad argument `axes`/},
      {[{:concatenate, [0, 0]}], ~r/list of slots/},
      {[{:add, [0, 0], :extra}], ~r/instruction 0 must be/},
      {[:add], ~r/instruction 0 must be/},
      {[{"add", [0, 0]}], ~r/instruction 0 must be/},
      {[{:add, :args}], ~r/instruction 0 must be/},
      # Custom NIFs are not program ops.
      {[{:eval, [0]}], ~r/not an op of the op table/}
    ]

    for {instrs, message} <- bad do
      assert_raise ArgumentError, message, fn -> Program.new(instrs, inputs: 1) end
    end

    assert_raise ArgumentError, ~r/output slot 9/, fn ->
      Program.new([{:exp, [0]}], inputs: 1, outputs: [9])
    end

    assert_raise ArgumentError, ~r/bad input count/, fn -> N.program_new(-1, [], [], false) end

    assert_raise ArgumentError, ~r/takes 1 inputs, got 2/, fn ->
      Program.run(Program.new([{:exp, [0]}], inputs: 1), [t([1.0]), t([1.0])])
    end
  end

  test "a released stream refuses programs" do
    st = Emily.Stream.new(:cpu)
    Emily.Stream.release(st)
    p = Program.new([{:exp, [0]}], inputs: 1)
    assert_raise ArgumentError, ~r/released/, fn -> Program.run(p, [t([1.0])], stream: st) end
  end

  test "dropping a compiled program on a live stream is safe; ids are not reused" do
    st = Emily.Stream.new(:cpu)

    for i <- 1..20 do
      p = Program.new([{:add, [0, 0]}, {:exp, [1]}], inputs: 1, compile: true)
      assert_close(l(hd(Program.run(p, [t([i * 0.0])], stream: st))), [1.0])
    end

    :erlang.garbage_collect()
    p = Program.new([{:negative, [0]}], inputs: 1, compile: true)
    assert l(hd(Program.run(p, [t([3.0])], stream: st))) == [-3.0]
  end

  test "ops/0 lists the generated ops of the op table, with their ids" do
    ops = Program.ops()
    names = for {name, _, _} <- ops, do: name
    generated = for row <- Emily.Native.Table.rows(), row.kind == :generated, do: row.name
    assert Enum.sort(names) == Enum.sort(generated)
    ids = for {_, id, _} <- ops, do: id
    assert length(Enum.uniq(ids)) == length(ids)

    for row <- Emily.Native.Table.rows(), row.kind == :generated do
      {_, _, outputs} = List.keyfind(ops, row.name, 0)
      # A count given by an argument (`-> sizes`) is 0 here: such ops stay out of programs.
      assert outputs == if(is_integer(row.outputs), do: row.outputs, else: 0)
    end
  end

  test "input_slots/1 and map_slots/2 follow the op table's tensor arguments" do
    dot = {:dot, [3, [1], [], 4, [0], []]}
    assert Program.input_slots(dot) == [3, 4]
    assert Program.map_slots(dot, &(&1 + 10)) == {:dot, [13, [1], [], 14, [0], []]}

    cat = {:concatenate, [[0, 2, 1], 1]}
    assert Program.input_slots(cat) == [0, 2, 1]
    assert Program.map_slots(cat, &(&1 * 2)) == {:concatenate, [[0, 4, 2], 1]}

    clip = {:clip, [5, nil, 2]}
    assert Program.input_slots(clip) == [5, 2]
    assert Program.map_slots(clip, &(&1 + 1)) == {:clip, [6, nil, 3]}

    full = {:full, [{2, 2}, 1.0, {:f, 32}]}
    assert Program.input_slots(full) == []
    assert Program.map_slots(full, fn _ -> flunk("no slot") end) == full
  end
end
