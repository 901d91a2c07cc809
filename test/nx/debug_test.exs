# Emily.Backend under the compile-time debug flags (Emily.Debug). The flags are fixed
# when Emily is compiled, so each test asserts what the compiled state does: with
# :debug_bounds_check, out-of-range indices raise in the op; without it, reads clamp them
# into range and writes drop them. With :debug_detect_nan_inf, a dot with a NaN or an
# infinity in its result raises in the op; without it, the value comes back. Run once as
# is and once with EMILY_DEBUG=bounds,nan_inf (config/config.exs) to cover both states.
if Code.ensure_loaded?(Nx) do
  defmodule Emily.Nx.DebugTest do
    use ExUnit.Case, async: true
    @moduletag :nx

    setup do
      Nx.default_backend(Emily.Backend)
      :ok
    end

    # Without the flag: `fun`'s result is `value`. With it: `fun` raises Emily.Error for
    # `op`, with `message`, naming the flag.
    defp flagged(on?, flag, fun, op, value, message) do
      if on? do
        e = assert_raise Emily.Error, fun
        assert e.op == op
        assert e.message =~ message
        assert e.message =~ "(#{flag})"
      else
        assert Nx.to_list(fun.()) == value
      end
    end

    # Out-of-range indices: clamped (reads) or dropped (writes) without the flag.
    defp out_of_range(fun, op, clamped, message),
      do: flagged(Emily.Debug.bounds_check?(), :debug_bounds_check, fun, op, clamped, message)

    test "Emily was compiled with the configured flags" do
      assert Emily.Debug.bounds_check?() ==
               Application.get_env(:emily, :debug_bounds_check, false)

      assert Emily.Debug.detect_nan_inf?() ==
               Application.get_env(:emily, :debug_detect_nan_inf, false)
    end

    test "take: indices past either end" do
      t = Nx.tensor([10, 20, 30])

      out_of_range(
        fn -> Nx.take(t, Nx.tensor([0, 3, -1])) end,
        "take",
        [10, 30, 10],
        "take: 2 of the indices s32[3] are outside 0..2"
      )

      # Axis 1 has 2 entries (axis 0 has 3): index 2 is out of range for it.
      m = Nx.tensor([[1, 2], [3, 4], [5, 6]])
      assert Nx.to_list(Nx.take(m, Nx.tensor([1, 0]), axis: 1)) == [[2, 1], [4, 3], [6, 5]]

      out_of_range(
        fn -> Nx.take(m, Nx.tensor([2]), axis: 1) end,
        "take",
        [[2], [4], [6]],
        "take: 1 of the indices s32[1] are outside 0..1"
      )
    end

    test "take_along_axis: indices past either end, every index type" do
      t = Nx.tensor([[1, 2, 3], [4, 5, 6]])

      for type <- [:s8, :s32, :s64] do
        idx = Nx.tensor([[0, 5], [-2, 1]], type: type)
        {_, bits} = Nx.Type.normalize!(type)

        out_of_range(
          fn -> Nx.take_along_axis(t, idx, axis: 1) end,
          "take_along_axis",
          [[1, 3], [4, 5]],
          "take_along_axis: 2 of the indices s#{bits}[2, 2] are outside 0..2"
        )
      end

      # Unsigned: only the upper end.
      out_of_range(
        fn -> Nx.take_along_axis(t, Nx.tensor([[2], [3]], type: :u8), axis: 1) end,
        "take_along_axis",
        [[3], [6]],
        "take_along_axis: 1 of the indices u8[2, 1] are outside 0..2"
      )
    end

    test "gather: each column of the indices against its own axis" do
      # {2, 4}: [[0, 1, 2, 3], [4, 5, 6, 7]]
      t = Nx.iota({2, 4})

      # Column 1 holds 3 and 2: in range for axis 1 (4), not for axis 0 (2).
      assert Nx.to_list(Nx.gather(t, Nx.tensor([[1, 3], [0, 2]]))) == [7, 2]

      out_of_range(
        fn -> Nx.gather(t, Nx.tensor([[2, 0], [1, 4], [0, -1], [1, 1]])) end,
        "gather",
        [4, 7, 0, 5],
        "gather: 3 of the indices s32[4, 2] are outside their axes' ranges (0..1, 0..3)"
      )

      # :axes picks the axis a column addresses: [3] is in range for axis 1, [4] is not.
      assert Nx.to_list(Nx.gather(t, Nx.tensor([[3], [0]]), axes: [1])) == [[3, 7], [0, 4]]

      out_of_range(
        fn -> Nx.gather(t, Nx.tensor([[3], [4]]), axes: [1]) end,
        "gather",
        [[3, 7], [3, 7]],
        "gather: 1 of the indices s32[2, 1] are outside their axes' ranges (0..3)"
      )
    end

    test "a vectorized take (a gather with Nx's iota columns) checks only the taken axis" do
      t = Nx.tensor([[1, 2], [11, 12]])

      assert Nx.to_list(Nx.take(t, Nx.vectorize(Nx.tensor([1, 0]), :x)) |> Nx.devectorize()) ==
               [[11, 12], [1, 2]]

      out_of_range(
        fn -> Nx.take(t, Nx.vectorize(Nx.tensor([0, 2]), :x)) |> Nx.devectorize() end,
        "gather",
        [[1, 2], [11, 12]],
        ~r/^gather: \d+ of the indices/
      )
    end

    test "indexed_add: out-of-range updates are dropped without the flag" do
      out_of_range(
        fn ->
          Nx.indexed_add(
            Nx.tensor([1, 2, 3]),
            Nx.tensor([[0], [3], [-1]]),
            Nx.tensor([10, 20, 30])
          )
        end,
        "indexed_add",
        [11, 2, 3],
        "indexed_add: 2 of the indices s32[3, 1] are outside their axes' ranges (0..2)"
      )
    end

    test "indexed_put: each column of the indices against its own axis" do
      zeros = Nx.broadcast(0, {2, 3})

      # [1, 2]: column 1 holds 2, in range for axis 1 (3), not for axis 0 (2).
      assert Nx.to_list(Nx.indexed_put(zeros, Nx.tensor([[1, 2]]), Nx.tensor([5]))) ==
               [[0, 0, 0], [0, 0, 5]]

      out_of_range(
        fn -> Nx.indexed_put(zeros, Nx.tensor([[1, 2], [2, 1]]), Nx.tensor([5, 6])) end,
        "indexed_put",
        [[0, 0, 0], [0, 0, 5]],
        "indexed_put: 1 of the indices s32[2, 2] are outside their axes' ranges (0..1, 0..2)"
      )

      # :axes [1]: one column, for axis 1.
      out_of_range(
        fn ->
          Nx.indexed_put(zeros, Nx.tensor([[2], [3]]), Nx.tensor([[7, 7], [8, 8]]), axes: [1])
        end,
        "indexed_put",
        [[0, 0, 7], [0, 0, 7]],
        "indexed_put: 1 of the indices s32[2, 1] are outside their axes' ranges (0..2)"
      )
    end

    test "take under Emily.Compiler (the evaluator path runs the backend's take)" do
      take = Nx.Defn.jit(&Nx.take(&1, &2), compiler: Emily.Compiler)
      t = Nx.tensor([10, 20, 30])
      assert Nx.to_list(take.(t, Nx.tensor([2, 1]))) == [30, 20]

      out_of_range(
        fn -> take.(t, Nx.tensor([1, 7])) end,
        "take",
        [20, 30],
        "take: 1 of the indices s32[2] are outside 0..2"
      )
    end

    # A NaN or infinite result: with the flag, `fun` itself raises (before anything reads
    # the result).
    defp nonfinite(fun, value, message, op \\ "dot"),
      do: flagged(Emily.Debug.detect_nan_inf?(), :debug_detect_nan_inf, fun, op, value, message)

    test "dot: an infinite or a NaN result" do
      a = Nx.tensor([[1.0e30, 1.0e30]])
      b = Nx.tensor([[1.0e30], [1.0e30]])

      nonfinite(
        fn -> Nx.dot(a, b) end,
        [[:infinity]],
        "dot: 1 NaN or infinite values in a f32[1, 1] result"
      )

      # inf * 0 is NaN.
      a = Nx.tensor([[:infinity, 1.0], [1.0, 2.0]])
      b = Nx.tensor([[0.0], [1.0]])

      nonfinite(
        fn -> Nx.dot(a, b) end,
        [[:nan], [2.0]],
        "dot: 1 NaN or infinite values in a f32[2, 1] result"
      )

      # Finite results pass, batched and integer dots too.
      assert Nx.to_list(Nx.dot(Nx.tensor([[1.0, 2.0]]), Nx.tensor([[3.0], [4.0]]))) == [[11.0]]

      batched =
        Nx.dot(Nx.iota({2, 1, 2}, type: :f32), [2], [0], Nx.iota({2, 2, 1}, type: :f32), [1], [0])

      assert Nx.to_flat_list(batched) == [1.0, 13.0]
      assert Nx.to_list(Nx.dot(Nx.tensor([[1, 2]]), Nx.tensor([[3], [4]]))) == [[11]]
    end

    test "dot and Emily.Fast under Emily.Compiler's native path, checked in the program" do
      import Emily.NxCompiler, only: [with_fallbacks: 1]

      # Two dots of one product (one check, the graph shares the node) and a finite one.
      fun = fn a, b -> {Nx.dot(a, b), Nx.add(Nx.dot(a, b), 1), Nx.dot(b, a)} end
      jit = Nx.Defn.jit(fun, compiler: Emily.Compiler, native: true)

      {{ab, ab1, ba}, fallbacks} =
        with_fallbacks(fn -> jit.(Nx.tensor([[1.0, 2.0]]), Nx.tensor([[3.0], [4.0]])) end)

      assert fallbacks == []

      assert {Nx.to_list(ab), Nx.to_list(ab1), Nx.to_list(ba)} ==
               {[[11.0]], [[12.0]], [[3.0, 6.0], [4.0, 8.0]]}

      a = Nx.tensor([[1.0e30, 1.0e30]])
      b = Nx.tensor([[1.0e30], [1.0e30]])
      # Both products overflow; the first checked result raises.
      nonfinite(
        fn -> elem(jit.(a, b), 0) end,
        [[:infinity]],
        "dot: 1 NaN or infinite values in a f32[1, 1] result"
      )

      norm = Nx.Defn.jit(&Emily.Fast.rms_norm(&1, nil), compiler: Emily.Compiler, native: true)
      {out, fallbacks} = with_fallbacks(fn -> norm.(Nx.tensor([[1.0, 1.0]])) end)
      assert fallbacks == []
      assert Enum.all?(Nx.to_flat_list(out), &(abs(&1 - 1.0) < 1.0e-5))

      nonfinite(
        fn -> norm.(Nx.tensor([[:nan, 1.0]])) end,
        [[:nan, :nan]],
        "rms_norm: 2 NaN or infinite values in a f32[1, 2] result",
        "rms_norm"
      )
    end
  end
else
  defmodule Emily.Nx.DebugTest do
    use ExUnit.Case, async: true
    @moduletag :nx
    require Emily.NxAbsent
    Emily.NxAbsent.placeholders()
  end
end
