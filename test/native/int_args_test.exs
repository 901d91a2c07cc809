defmodule Emily.Native.IntArgsTest do
  # Scalar integer arguments: `int` is checked to fit in 32 bits at the call (MLX takes
  # axes, sizes and counts as 32-bit ints, and a wrapped value would quietly mean
  # something else); `int64` takes any signed 64-bit value.
  # Not async: one test changes the process-wide memory limit.
  use Emily.TestCase, async: false

  alias Emily.Program

  @over 2 ** 31
  @under -(2 ** 31) - 1

  defp message(op, name, v), do: "#{op}: #{name} #{v} does not fit in 32 bits"

  describe "int arguments outside 32 bits raise ArgumentError at the call" do
    test "axes" do
      x = t([1.0, 3.0, 2.0])

      for v <- [@over, @under] do
        assert_raise ArgumentError, message("argmax", "axis", v), fn ->
          N.argmax(s(), x, v, false)
        end

        assert_raise ArgumentError, message("cumsum", "axis", v), fn ->
          N.cumsum(s(), x, v, false, true)
        end

        assert_raise ArgumentError, message("concatenate", "axis", v), fn ->
          N.concatenate(s(), [x, x], v)
        end
      end

      # 2^32 would wrap to axis 0, -2^32 - 1 to axis -1.
      assert_raise ArgumentError, message("argmax", "axis", 2 ** 32), fn ->
        N.argmax(s(), x, 2 ** 32, false)
      end

      assert_raise ArgumentError, message("cumsum", "axis", -(2 ** 32) - 1), fn ->
        N.cumsum(s(), x, -(2 ** 32) - 1, false, true)
      end

      # Nothing was queued: the stream carries on.
      assert l(N.argmax(s(), x, 0, false)) == [1]
    end

    test "sizes and counts" do
      x = t([4.0, 1.0, 3.0, 2.0])

      # 2^32 + 4 would wrap to 4 bits.
      assert_raise ArgumentError, message("quantize", "bits", 2 ** 32 + 4), fn ->
        N.quantize(s(), t(List.duplicate(1.0, 64), {:f, 32}, {1, 64}), 64, 2 ** 32 + 4)
      end

      assert_raise ArgumentError, message("topk", "k", @over), fn -> N.topk(s(), x, @over, 0) end
      assert_raise ArgumentError, message("fft", "n", @under), fn -> N.fft(s(), x, @under, 0) end

      assert_raise ArgumentError, message("eye", "k", @over), fn ->
        N.eye(s(), 2, 2, @over, {:f, 32})
      end

      assert l(N.topk(s(), x, 2, 0)) |> Enum.sort() == [3.0, 4.0]
    end

    test "the first bad argument is named" do
      assert_raise ArgumentError, message("eye", "n", @over), fn ->
        N.eye(s(), @over, @under, 0, {:f, 32})
      end
    end

    test "integers beyond 64 bits are refused too" do
      assert_raise ArgumentError, fn -> N.argmax(s(), t([1.0]), 2 ** 64, false) end
    end
  end

  describe "int arguments at the 32-bit extremes reach MLX unchanged" do
    test "an axis of 2^31 - 1 or -2^31 is out of range for MLX, by its own value" do
      x = t([1.0, 2.0])

      e = assert_raise Emily.Error, fn -> Emily.eval(N.argmax(s(), x, 2 ** 31 - 1, false)) end
      assert e.message =~ "2147483647"

      e =
        assert_raise Emily.Error, fn -> Emily.eval(N.cumsum(s(), x, -(2 ** 31), false, true)) end

      assert e.message =~ "-2147483648"

      assert l(N.cumsum(s(), x, -1, false, true)) == [1.0, 3.0]
    end

    test "a diagonal offset of 2^31 - 1 gives an all-zero eye" do
      assert l(N.eye(s(), 2, 3, 2 ** 31 - 1, {:f, 32})) == List.duplicate(0.0, 6)
      assert l(N.eye(s(), 2, 3, 1, {:f, 32})) == [0.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    end
  end

  describe "int64 arguments take 64-bit values" do
    test "a key's seed keeps its high word" do
      assert l(N.key(s(), 2 ** 40)) == [256, 0]
      assert l(N.key(s(), 2 ** 63 - 1)) == [2 ** 31 - 1, 2 ** 32 - 1]
      assert l(N.key(s(), -(2 ** 63))) == [2 ** 31, 0]
    end

    test "randint bounds beyond 32 bits" do
      low = 2 ** 40
      high = low + 2 ** 20
      v = l(N.randint(s(), N.key(s(), 1), low, high, {64}, {:s, 64}))
      assert Enum.all?(v, &(&1 >= low and &1 < high))
      # Wrapped bounds (0 and 2^20) would give values below 2^20.
      assert Enum.any?(v, &(&1 > low))
    end

    test "an as_strided offset beyond 32 bits is bounds-checked by its own value" do
      x = t([1.0, 2.0, 3.0])

      # 2^32 + 1 would wrap to 1, a valid offset.
      e =
        assert_raise Emily.Error, fn ->
          Emily.eval(N.as_strided(s(), x, [2], [1], 2 ** 32 + 1))
        end

      assert e.message =~ "4294967297"
      assert l(N.as_strided(s(), x, [2], [1], 1)) == [2.0, 3.0]
    end

    test "a memory limit above 4 GiB" do
      limit = Emily.Memory.stats().memory_limit
      big = 5 * 2 ** 30 + 3

      try do
        Emily.Memory.set_memory_limit(big)
        assert Emily.Memory.stats().memory_limit == big
      after
        assert Emily.Memory.set_memory_limit(limit) == big
      end
    end

    test "values beyond 64 bits are refused" do
      assert_raise ArgumentError, fn -> N.key(s(), 2 ** 64) end
      assert_raise ArgumentError, fn -> N.key(s(), -(2 ** 63) - 1) end
    end
  end

  describe "programs" do
    test "an instruction with an out-of-range int raises, naming the instruction" do
      msg = "program: instruction 1 (argmax): axis 2147483648 does not fit in 32 bits"

      assert_raise ArgumentError, msg, fn ->
        Program.new([{:exp, [0]}, {:argmax, [1, @over, false]}], inputs: 1)
      end

      assert_raise ArgumentError, ~r/instruction 0 \(quantize\): bits 4294967300 does not/, fn ->
        Program.new([{:quantize, [0, 64, 2 ** 32 + 4]}], inputs: 1)
      end

      p = Program.new([{:argmax, [0, -1, false]}], inputs: 1)
      assert l(hd(Program.run(p, [t([1.0, 5.0, 2.0])], stream: s()))) == [1]
    end

    test "an int64 argument takes 64-bit values" do
      p = Program.new([{:key, [2 ** 40]}], inputs: 0)
      assert l(hd(Program.run(p, [], stream: s()))) == [256, 0]
    end
  end

  # Every row of the table, from its declared types: each `int` argument alone out of
  # range raises, naming the op and the argument; `int64` arguments pass the call.
  defp args(row, target, value, slots?) do
    for {name, type} <- row.args do
      cond do
        name == target -> value
        slots? -> slot_arg(type)
        true -> call_arg(type)
      end
    end
  end

  defp call_arg("tensor"), do: t([1.0])
  defp call_arg("tensors"), do: [t([1.0])]
  defp call_arg(type), do: scalar_arg(type)

  defp slot_arg("tensor"), do: 0
  defp slot_arg("tensors"), do: [0]
  defp slot_arg(type), do: scalar_arg(type)

  defp scalar_arg("tensor?"), do: nil
  defp scalar_arg(int) when int in ["int", "int64"], do: 1
  defp scalar_arg("ints"), do: [0]
  defp scalar_arg("shape"), do: [1]
  defp scalar_arg("float"), do: 1.0
  defp scalar_arg("bool"), do: false
  defp scalar_arg("dtype"), do: {:f, 32}
  defp scalar_arg("str"), do: "affine"

  defp rows_with(type) do
    for row <- Emily.Native.Table.rows(),
        row.kind == :generated,
        {name, ^type} <- row.args,
        do: {row, name}
  end

  test "every int argument of the table is checked, in calls and in programs" do
    rows = rows_with("int")
    assert length(rows) > 40

    for {row, name} <- rows, v <- [@over, @under] do
      assert_raise ArgumentError, message(row.name, name, v), fn ->
        apply(N, row.name, [s() | args(row, name, v, false)])
      end

      if is_integer(row.outputs) do
        msg = "program: instruction 0 (#{row.name}): #{name} #{v} does not fit in 32 bits"

        assert_raise ArgumentError, msg, fn ->
          Program.new([{row.name, args(row, name, v, true)}], inputs: 1)
        end
      end
    end
  end

  test "every int64 argument of the table passes the call with a 64-bit value" do
    rows = rows_with("int64")

    assert Enum.map(rows, fn {row, name} -> {row.name, name} end) |> Enum.sort() ==
             Enum.sort([
               {:debug_count_out_of_bounds, :size},
               {:key, :seed},
               {:randint, :low},
               {:randint, :high},
               {:as_strided, :offset},
               # Emily.Distributed's group handles: ids that are never reused.
               {:all_sum, :group},
               {:all_max, :group},
               {:all_min, :group},
               {:all_gather, :group},
               {:send, :group},
               {:recv, :group}
             ])

    for {row, name} <- rows do
      # Lazy: MLX may still reject the value when the op is built, as an Emily.Error.
      out = apply(N, row.name, [s() | args(row, name, 2 ** 40, false)])
      assert is_reference(out)
      Program.new([{row.name, args(row, name, 2 ** 40, true)}], inputs: 1)
    end
  end
end
