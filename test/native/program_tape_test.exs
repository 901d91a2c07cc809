defmodule Emily.ProgramTapeTest do
  # A program's later runs rebuild its graph from a tape (cpp/tape.h): each test runs a
  # program enough times for a tape to be recorded (the second run of a kind of inputs)
  # and used (the third), and checks every run against the op-by-op result.
  use Emily.TestCase, async: false

  alias Emily.Program
  alias Emily.SampleProgram, as: Sample

  defp tapes(program), do: Program.info(program).tapes

  defp sample_by_ops(x, w, k) do
    st = s()
    y = N.sum(st, N.square(st, N.add(st, N.multiply(st, x, w), x)), [1], false)
    l(N.exp(st, N.multiply(st, y, k)))
  end

  defp random(shape, key) do
    N.uniform(s(), N.key(s(), key), -1.0, 1.0, shape, {:f, 32})
  end

  test "the second run of a kind of inputs records a tape, the third rebuilds from it" do
    p = Program.new(Sample.instructions(), inputs: 3)
    [x0, w, k] = Sample.inputs()

    for i <- 1..5 do
      # New values each run: a tape holds the graph, never a result.
      x = N.multiply(s(), x0, t([i * 0.5]))
      [out] = Program.run(p, [x, w, k])
      assert l(out) == sample_by_ops(x, w, k)
      assert tapes(p) == if(i == 1, do: 0, else: 1)
    end
  end

  test "inputs of another shape or dtype get a tape of their own" do
    p = Program.new([{:multiply, [0, 1]}, {:sum, [2, [1], false]}], inputs: 2)

    kinds = [
      {{2, 3}, {:f, 32}},
      {{4, 3}, {:f, 32}},
      {{2, 3}, {:f, 16}}
    ]

    for _ <- 1..3, {{shape, type}, i} <- Enum.with_index(kinds) do
      a = N.astype(s(), random(shape, i), type)
      b = N.astype(s(), random(shape, i + 10), type)
      [out] = Program.run(p, [a, b])
      assert Emily.dtype(out) == type
      assert l(out) == l(N.sum(s(), N.multiply(s(), a, b), [1], false))
    end

    assert tapes(p) == 3
  end

  test "the same tensor passed twice is a kind of inputs of its own" do
    p = Program.new([{:subtract, [0, 1]}], inputs: 2)
    x = t([1.0, 2.0, 3.0])
    y = t([0.5, 0.5, 0.5])

    for _ <- 1..3, do: assert(l(hd(Program.run(p, [x, x]))) == [0.0, 0.0, 0.0])
    for _ <- 1..3, do: assert(l(hd(Program.run(p, [x, y]))) == [0.5, 1.5, 2.5])
    for _ <- 1..3, do: assert(l(hd(Program.run(p, [y, x]))) == [-0.5, -1.5, -2.5])
    assert tapes(p) == 2
  end

  test "a computed input's memory layout is part of its kind" do
    p = Program.new([{:add, [0, 1]}], inputs: 2)
    m = t(Enum.map(0..5, &(&1 * 1.0)), {:f, 32}, {2, 3})
    ones = t(List.duplicate(1.0, 6), {:f, 32}, {2, 3})

    # A transpose that a program left computed but not copied (as a lazy output is, once
    # MLX has run it): of m's shape, with column-major strides. The stream runs its work
    # in order, so once the add after it is read, it is computed.
    [view] =
      Program.run(Program.new([{:transpose, [0, [1, 0]]}], inputs: 1), [
        t(Enum.map(0..5, &(&1 * 1.0)), {:f, 32}, {3, 2})
      ])

    Emily.async_eval(view)
    assert l(N.add(s(), t([1.0]), t([1.0]))) == [2.0]

    for _ <- 1..3 do
      assert l(hd(Program.run(p, [m, ones]))) == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
      assert l(hd(Program.run(p, [view, ones]))) == [1.0, 3.0, 5.0, 2.0, 4.0, 6.0]
    end

    assert tapes(p) == 2
  end

  test "instructions with several outputs, constants and inputs passed through" do
    # dots2 is one node with two outputs (siblings); full makes a constant scalar that
    # every rebuilt graph shares; slot 0 is an output as it came in.
    instrs = [
      {:dots2, [0, 1, 1, 2]},
      {:full, [{1, 2}, 2.0, {:f, 32}]},
      {:multiply, [3, 5]},
      {:add, [4, 4]}
    ]

    p = Program.new(instrs, inputs: 3, outputs: [6, 7, 0, 3])
    w0 = random({4, 2}, 1)
    w1 = random({4, 3}, 2)

    for i <- 1..4 do
      x = random({1, 4}, 100 + i)
      [a, b, same, g0] = Program.run(p, [x, w0, w1])
      st = s()
      assert_close(l(a), l(N.multiply(st, N.matmul(st, x, w0), t([2.0]))), 1.0e-6)
      assert_close(l(b), l(N.multiply(st, N.matmul(st, x, w1), t([2.0]))), 1.0e-6)
      assert_close(l(g0), l(N.matmul(st, x, w0)), 1.0e-6)
      assert l(same) == l(x)
    end

    assert tapes(p) == 1
  end

  test "chains of views rebuild as one reshape, with the same values and shapes" do
    # A tape folds each chain of reshapes, added or removed unit axes and transposes that
    # move only unit axes into one reshape of the chain's start (a chain that ends in its
    # start's shape into nothing). Slot 0 is x {2, 1, 3, 4}.
    instrs = [
      # 1: reshape, reshape: {2, 12}
      {:reshape, [0, {2, 3, 4}]},
      {:reshape, [1, {2, 12}]},
      # 3: a transpose of unit axes only, then a reshape: {6, 4}
      {:transpose, [0, [1, 0, 2, 3]]},
      {:reshape, [3, {6, 4}]},
      # 5: a chain back to x's shape (nothing), then read: x + x
      {:expand_dims, [0, [0]]},
      {:squeeze, [5, [0]]},
      {:add, [6, 0]},
      # 8: a transpose of two axes of size 3 and 4 (not a reshape), then a reshape
      {:transpose, [0, [0, 1, 3, 2]]},
      {:reshape, [8, {2, 12}]},
      # 10: a view read twice (kept), and a chain whose middle is an output
      {:reshape, [0, {24}]},
      {:reshape, [10, {4, 6}]},
      {:add, [10, 10]},
      {:reshape, [0, {8, 3}]},
      {:expand_dims, [13, [0]]},
      {:squeeze, [14, [0]]},
      {:reshape, [15, {24}]},
      # 17: a chain that starts at a transposed (strided) view: {3, 8}
      {:transpose, [0, [2, 1, 0, 3]]},
      {:expand_dims, [17, [0]]},
      {:reshape, [18, {3, 8}]}
    ]

    p = Program.new(instrs, inputs: 1, outputs: [2, 4, 7, 9, 11, 12, 13, 16, 19])

    for i <- 1..4 do
      x = random({2, 1, 3, 4}, 200 + i)
      st = s()
      r = fn a, shape -> N.reshape(st, a, shape) end
      tr = fn a, axes -> N.transpose(st, a, axes) end
      flat = r.(x, {24})

      expected = [
        r.(x, {2, 12}),
        r.(x, {6, 4}),
        N.add(st, x, x),
        r.(tr.(x, [0, 1, 3, 2]), {2, 12}),
        r.(x, {4, 6}),
        N.add(st, flat, flat),
        r.(x, {8, 3}),
        flat,
        r.(tr.(x, [2, 1, 0, 3]), {3, 8})
      ]

      outs = Program.run(p, [x])

      for {out, want} <- Enum.zip(outs, expected) do
        assert Emily.shape(out) == Emily.shape(want)
        assert l(out) == l(want)
      end
    end

    assert tapes(p) == 1
  end

  test "eval/3 rebuilds from the tape too" do
    p = Program.new(Sample.instructions(), inputs: 3)
    [x, w, k] = Sample.inputs()
    Emily.eval([x, w, k])
    for _ <- 1..4, do: assert(l(hd(Program.eval(p, [x, w, k]))) == sample_by_ops(x, w, k))
    assert tapes(p) >= 1
  end

  test "inputs that keep changing kind: at most eight tapes, each run right" do
    p = Program.new([{:exp, [0]}, {:sum, [1, [0], false]}], inputs: 1)

    for _ <- 1..3, n <- 1..10 do
      x = random({n}, n)
      [out] = Program.run(p, [x])
      assert_close(l(out), l(N.sum(s(), N.exp(s(), x), [0], false)), 1.0e-5)
    end

    assert tapes(p) == 8
  end

  test "a run that fails records nothing and leaves the program usable" do
    p = Program.new([{:add, [0, 1]}], inputs: 2)

    for _ <- 1..3 do
      error = eval_error(fn -> Program.run(p, [t([1.0, 2.0]), t([1.0, 2.0, 3.0])]) end)
      assert error.message =~ "instruction 0 (add)"
    end

    assert tapes(p) == 0
    for _ <- 1..3, do: assert(l(hd(Program.run(p, [t([1.0]), t([2.0])]))) == [3.0])
    assert tapes(p) == 1
  end
end
