defmodule Emily.Native.IndexTest do
  use Emily.TestCase, async: true

  setup do
    # [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    {:ok, x: t(Enum.to_list(0..11), {:s, 32}, {3, 4})}
  end

  defp i32(list, shape \\ nil), do: t(list, {:s, 32}, shape)

  # The stream still evaluates after an error.
  defp alive!, do: assert(l(N.add(s(), t([1.0]), t([2.0]))) == [3.0])

  describe "slice_dynamic" do
    test "in range", %{x: x} do
      assert l(N.slice_dynamic(s(), x, i32([1, 1]), [0, 1], {2, 3}, [])) == [5, 6, 7, 9, 10, 11]
      # Unlisted axes start at 0.
      assert l(N.slice_dynamic(s(), x, i32([2]), [1], {3, 2}, [])) == [2, 3, 6, 7, 10, 11]
      # A scalar start for one axis.
      assert l(N.slice_dynamic(s(), x, t([1], {:s, 32}, {}), [0], {1, 4}, [])) == [4, 5, 6, 7]
    end

    test "clamps starts so the slice fits, like Nx", %{x: x} do
      # start = min(max(start, 0), dim - size): {2, 3} -> {1, 2}; {-5, -1} -> {0, 0}.
      assert l(N.slice_dynamic(s(), x, i32([2, 3]), [0, 1], {2, 2}, [])) == [6, 7, 10, 11]
      assert l(N.slice_dynamic(s(), x, t([-5, -1], {:s, 64}), [0, 1], {2, 2}, [])) == [0, 1, 4, 5]

      assert l(N.slice_dynamic(s(), x, t([200, 9], {:u, 8}), [0, 1], {1, 4}, [])) == [
               8,
               9,
               10,
               11
             ]

      assert l(N.slice_dynamic(s(), x, t([1_000_000], {:s, 64}), [1], {3, 1}, [])) == [3, 7, 11]
    end

    test "with strides", %{x: x} do
      # Rows 0..2 step 2, columns 1..3 step 2 after clamping start 3 -> 1.
      assert l(N.slice_dynamic(s(), x, i32([0, 3]), [0, 1], {3, 3}, [2, 2])) == [1, 3, 9, 11]
    end

    test "errors", %{x: x} do
      assert_raise Emily.Error, ~r/slice_dynamic.*does not fit/, fn ->
        l(N.slice_dynamic(s(), x, i32([0]), [0], {4, 4}, []))
      end

      assert_raise Emily.Error, ~r/integer tensor/, fn ->
        l(N.slice_dynamic(s(), x, t([0.0]), [0], {1, 4}, []))
      end

      assert_raise Emily.Error, ~r/axis 2 is out of range/, fn ->
        l(N.slice_dynamic(s(), x, i32([0]), [2], {1, 4}, []))
      end

      assert_raise Emily.Error, ~r/2 start indices for 1 axes/, fn ->
        l(N.slice_dynamic(s(), x, i32([0, 0]), [0], {1, 4}, []))
      end

      assert_raise ArgumentError, fn -> N.slice_dynamic(s(), x, :nope, [0], {1, 4}, []) end
      alive!()
    end
  end

  describe "slice_update" do
    test "static, with strides", %{x: x} do
      u = i32([-1, -2], {1, 2})

      assert l(N.slice_update(s(), x, u, [1, 1], [2, 3], [1, 1])) ==
               [0, 1, 2, 3, 4, -1, -2, 7, 8, 9, 10, 11]

      assert l(N.slice_update(s(), x, u, [2, 0], [3, 4], [1, 2])) ==
               [0, 1, 2, 3, 4, 5, 6, 7, -1, 9, -2, 11]
    end

    test "dynamic, clamped like Nx", %{x: x} do
      u = i32([-1, -2, -3, -4], {2, 2})

      assert l(N.slice_update_dynamic(s(), x, u, i32([0, 1]), [0, 1])) ==
               [0, -1, -2, 3, 4, -3, -4, 7, 8, 9, 10, 11]

      # {5, 9} clamps to {1, 2}.
      assert l(N.slice_update_dynamic(s(), x, u, i32([5, 9]), [0, 1])) ==
               [0, 1, 2, 3, 4, 5, -1, -2, 8, 9, -3, -4]

      # Only axis 1 listed: axis 0 starts at 0; -7 clamps to 0.
      assert l(N.slice_update_dynamic(s(), x, u, i32([-7]), [1])) ==
               [-1, -2, 2, 3, -3, -4, 6, 7, 8, 9, 10, 11]
    end

    # On a GPU the dynamic update is a scatter of the whole update (cpp/index.cc): the
    # CPU's values, for any type, clamped starts, a broadcast update, and a program's
    # replay whose updates share their starts.
    @tag :gpu
    test "dynamic on a GPU: the CPU's values" do
      gpu = Emily.Stream.default(:gpu)

      on_gpu = fn t ->
        Emily.from_binary(Emily.to_binary(t), Emily.shape(t), Emily.dtype(t), stream: gpu)
      end

      cache = t(Enum.map(0..(2 * 6 * 4 * 3 - 1), &(&1 * 1.0)), {:f, 32}, {2, 6, 4, 3})
      row = t(Enum.map(1..(2 * 2 * 3), &(-&1 * 1.0)), {:f, 32}, {2, 1, 2, 1, 3})

      for type <- [{:f, 32}, {:bf, 16}, {:s, 64}, {:u, 8}],
          starts <- [[0, 3, 0, 0], [9, 9, 9, 9], [-1, -4, 0, 2]] do
        a = N.astype(s(), cache, type)
        # Each head of `row` twice, as a broadcast (stride 0), then merged into 4 heads.
        u =
          row |> then(&N.astype(s(), &1, type)) |> then(&N.broadcast_to(s(), &1, {2, 1, 2, 2, 3}))

        u4 = N.reshape(s(), u, {2, 1, 4, 3})
        idx = i32(starts)
        want = l(N.slice_update_dynamic(s(), a, u4, idx, [0, 1, 2, 3]))

        [ga, gu, gi] = Enum.map([a, row, idx], on_gpu)

        gu =
          gu |> then(&N.astype(gpu, &1, type)) |> then(&N.broadcast_to(gpu, &1, {2, 1, 2, 2, 3}))

        gu4 = N.reshape(gpu, gu, {2, 1, 4, 3})

        assert l(N.slice_update_dynamic(gpu, ga, gu4, gi, [0, 1, 2, 3])) == want,
               inspect({type, starts})

        # The split view of the same update, as the lowering writes Bumblebee's cache.
        ga5 = N.reshape(gpu, ga, {2, 6, 2, 2, 3})
        i5 = on_gpu.(i32(List.insert_at(starts, 3, 0)))
        assert l(N.slice_update_dynamic(gpu, ga5, gu, i5, [0, 1, 2, 3, 4])) == want
      end

      # One axis listed; an update of several rows along it.
      x = t(Enum.to_list(0..11), {:s, 32}, {3, 4})
      u = i32([-1, -2, -3, -4, -5, -6], {3, 2})
      want = l(N.slice_update_dynamic(s(), x, u, i32([1]), [1]))
      assert want == [0, -1, -2, 3, 4, -3, -4, 7, 8, -5, -6, 11]
      [gx, gu, gi] = Enum.map([x, u, i32([1])], on_gpu)
      assert l(N.slice_update_dynamic(gpu, gx, gu, gi, [1])) == want

      # A replay whose updates share one starts array (cpp/index.h's memo).
      instrs = [
        {:slice_update_dynamic, [0, 2, 3, [0]]},
        {:slice_update_dynamic, [1, 2, 3, [0]]},
        {:slice_update_dynamic, [0, 2, 4, [0]]}
      ]

      ins = [
        t(Enum.map(0..5, &(&1 * 1.0))),
        t([0.0, 1.0, 2.0, 3.0]),
        t([-1.0, -2.0]),
        i32([4]),
        i32([1])
      ]

      cpu_outs =
        Emily.Program.new(instrs, inputs: 5, outputs: [5, 6, 7]) |> Emily.Program.run(ins)

      gpu_outs =
        Emily.Program.new(instrs, inputs: 5, outputs: [5, 6, 7])
        |> Emily.Program.run(Enum.map(ins, on_gpu), stream: gpu)

      assert Enum.map(gpu_outs, &l/1) == Enum.map(cpu_outs, &l/1)
    end

    # A {2, 5, 4, 3} cache of 4 heads written from 2 heads, each standing for 2: the
    # update materialised by a broadcast, written by slice_update_dynamic.
    defp repeated_case(stream \\ nil) do
      stream = stream || s()
      a = t(Enum.map(0..(2 * 5 * 4 * 3 - 1), &(&1 * 1.0)), {:f, 32}, {2, 5, 4, 3})
      u = t(Enum.map(1..(2 * 1 * 2 * 3), &(-&1 * 1.0)), {:f, 32}, {2, 1, 2, 3})

      full =
        N.reshape(stream, u, {2, 1, 2, 1, 3})
        |> then(&N.broadcast_to(stream, &1, {2, 1, 2, 2, 3}))
        |> then(&N.reshape(stream, &1, {2, 1, 4, 3}))

      {a, u, full}
    end

    test "repeated along an axis: the repeated update's values, clamped like Nx" do
      {a, u, full} = repeated_case()

      for {starts, axes} <- [{[3], [1]}, {[9], [1]}, {[-2], [1]}, {[1, 2, 3, 0], [0, 1, 2, 3]}] do
        want = l(N.slice_update_dynamic(s(), a, full, i32(starts), axes))
        assert l(N.slice_update_repeated(s(), a, u, i32(starts), axes, 2, 2)) == want
        assert l(N.slice_update_repeated(s(), a, u, i32(starts), axes, -2, 2)) == want
      end

      # One repeat is the plain update.
      want = l(N.slice_update_dynamic(s(), a, full, t([4], {:s, 64}), [1]))
      assert l(N.slice_update_repeated(s(), a, full, t([4], {:s, 64}), [1], 0, 1)) == want
    end

    test "repeated along an axis: errors" do
      {a, u, _full} = repeated_case()

      # One head twice: two of the four.
      one_head = N.slice(s(), u, [0, 0, 0, 0], [2, 1, 1, 3], [1, 1, 1, 1])

      assert_raise Emily.Error, ~r/must cover it/, fn ->
        l(N.slice_update_repeated(s(), a, one_head, i32([0]), [1], 2, 2))
      end

      assert_raise Emily.Error, ~r/does not fit/, fn ->
        l(N.slice_update_repeated(s(), a, u, i32([0]), [1], 2, 3))
      end

      # 65536 * 65537 wraps to 65536 in 32 bits: refused, not written outside the tensor.
      big = t([0.0], {:f, 32}, {1}) |> then(&N.broadcast_to(s(), &1, {65_536}))

      assert_raise Emily.Error, ~r/repeated 65537 times along axis 0 does not fit/, fn ->
        l(N.slice_update_repeated(s(), big, big, i32([0]), [0], 0, 65_537))
      end

      assert_raise Emily.Error, ~r/repeats must be positive/, fn ->
        l(N.slice_update_repeated(s(), a, u, i32([0]), [1], 2, 0))
      end

      assert_raise Emily.Error, ~r/out of range/, fn ->
        l(N.slice_update_repeated(s(), a, u, i32([0]), [1], 4, 2))
      end

      alive!()
    end

    # On a GPU the repeated update is Emily's kernel (cpp/cuda_put_slice.cc), which writes
    # in place where the cache may be donated (an intermediate of a program) and copies
    # it first where not (a tensor the caller holds, which stays as it was; a transposed
    # view, read through its strides): each the CPU's values, for types of each width,
    # clamped int32 and int64 starts, starts on every axis (the repeated one's clamps to
    # 0) and an update read through strides.
    @tag :gpu
    test "repeated along an axis on a GPU: the CPU's values, in place and copied" do
      gpu = Emily.Stream.default(:gpu)
      {a, u, full} = repeated_case()

      on_gpu = fn t ->
        Emily.from_binary(Emily.to_binary(t), Emily.shape(t), Emily.dtype(t), stream: gpu)
      end

      # The cache as maximum(a, a): an intermediate no one else holds. Then the cache as
      # a transpose of its transpose: a view of the input, copied.
      in_place = [{:maximum, [0, 0]}, {:slice_update_repeated, [3, 1, 2, [1], 2, 2]}]
      strided = [{:transpose, [0, [1, 0, 2, 3]]}, {:slice_update_repeated, [3, 1, 2, [1], 2, 2]}]

      for type <- [{:f, 32}, {:bf, 16}, {:s, 64}, {:u, 8}],
          starts <- [i32([3]), i32([-2]), t([7], {:s, 64})] do
        [a, u, full] = Enum.map([a, u, full], &N.astype(s(), &1, type))
        want = l(N.slice_update_dynamic(s(), a, full, starts, [1]))
        [ga, gu, gi] = Enum.map([a, u, starts], on_gpu)
        assert l(N.slice_update_repeated(gpu, ga, gu, gi, [1], 2, 2)) == want, inspect(type)

        [out] =
          Emily.Program.new(in_place, inputs: 3, outputs: [4])
          |> Emily.Program.run([ga, gu, gi], stream: gpu)

        assert l(out) == want, inspect({type, :in_place})
        assert l(ga) == l(a), inspect({type, :caller_unchanged})

        ga_t = on_gpu.(N.transpose(s(), a, [1, 0, 2, 3]))

        [out] =
          Emily.Program.new(strided, inputs: 3, outputs: [4])
          |> Emily.Program.run([ga_t, gu, gi], stream: gpu)

        assert l(out) == want, inspect({type, :strided_cache})

        # Every axis listed, the axis counted from the end, the update transposed back
        # from its transpose (a strided view).
        every = i32([1, 2, 3, 0])
        want = l(N.slice_update_dynamic(s(), a, full, every, [0, 1, 2, 3]))
        gu_t = N.transpose(gpu, on_gpu.(N.transpose(s(), u, [0, 1, 3, 2])), [0, 1, 3, 2])
        got = N.slice_update_repeated(gpu, ga, gu_t, on_gpu.(every), [0, 1, 2, 3], -2, 2)
        assert l(got) == want, inspect({type, :every_axis})
      end
    end

    test "errors", %{x: x} do
      assert_raise Emily.Error, ~r/slice_update/, fn ->
        l(N.slice_update(s(), x, i32([1, 2, 3], {1, 3}), [0, 0], [1, 2], [1, 1]))
      end

      assert_raise Emily.Error, ~r/does not fit/, fn ->
        l(N.slice_update_dynamic(s(), x, i32(Enum.to_list(1..5), {1, 5}), i32([0]), [0]))
      end

      assert_raise Emily.Error, ~r/differ in rank/, fn ->
        l(N.slice_update_dynamic(s(), x, i32([1, 2]), i32([0]), [0]))
      end

      alive!()
    end
  end

  describe "gather" do
    test "full indices", %{x: x} do
      idx = i32([1, 2, 0, 0, 2, 3], {3, 2})
      y = N.gather(s(), x, idx, [0, 1])
      assert Emily.shape(y) == {3}
      assert l(y) == [6, 0, 11]
    end

    test "partial indices keep the other axes; batch shape is kept", %{x: x} do
      # Rows 2 and 0: the result is {2, 4}.
      assert l(N.gather(s(), x, i32([2, 0], {2, 1}), [0])) == [8, 9, 10, 11, 0, 1, 2, 3]
      # Columns 3 and 1 (axes: [1]): each index picks a column of 3 values.
      y = N.gather(s(), x, i32([3, 1], {2, 1}), [1])
      assert Emily.shape(y) == {2, 3}
      assert l(y) == [3, 7, 11, 1, 5, 9]
      # A {2, 2, 2} batch of full indices gives {2, 2}.
      z =
        N.gather(s(), x, i32([0, 0, 0, 1, 1, 0, 1, 1, 2, 2, 2, 3, 1, 3, 0, 3], {2, 2, 2, 2}), [
          0,
          1
        ])

      assert Emily.shape(z) == {2, 2, 2}
      assert l(z) == [0, 1, 4, 5, 10, 11, 7, 3]
      # Axes in the other order address (column, row).
      assert l(N.gather(s(), x, i32([3, 0, 0, 2], {2, 2}), [1, 0])) == [3, 8]
    end

    test "no indices give an empty result", %{x: x} do
      y = N.gather(s(), x, t([], {:s, 32}, {0, 2}), [0, 1])
      assert Emily.shape(y) == {0}
      assert l(y) == []
      assert Emily.shape(N.gather(s(), x, t([], {:s, 32}, {0, 1}), [1])) == {0, 3}
    end

    test "out-of-range indices are clamped (as XLA does)", %{x: x} do
      assert l(N.gather(s(), x, i32([9, -4, -1, 7], {2, 2}), [0, 1])) == [8, 3]
      assert l(N.gather(s(), x, t([255, 1], {:u, 8}, {2, 1}), [0])) == [8, 9, 10, 11, 4, 5, 6, 7]
    end

    test "errors", %{x: x} do
      assert_raise Emily.Error, ~r/address 2 axes, but 1 axes/, fn ->
        l(N.gather(s(), x, i32([0, 0], {1, 2}), [0]))
      end

      assert_raise Emily.Error, ~r/integer tensor/, fn ->
        l(N.gather(s(), x, t([0.0, 1.0], {:f, 32}, {1, 2}), [0, 1]))
      end

      assert_raise Emily.Error, ~r/appears twice/, fn ->
        l(N.gather(s(), x, i32([0, 0], {1, 2}), [0, 0]))
      end

      alive!()
    end
  end

  describe "take" do
    test "along an axis", %{x: x} do
      y = N.take(s(), x, i32([2, 0, 2], {3}), 0)
      assert Emily.shape(y) == {3, 4}
      assert l(y) == [8, 9, 10, 11, 0, 1, 2, 3, 8, 9, 10, 11]
      z = N.take(s(), x, i32([3, 0, 1, 1], {2, 2}), 1)
      assert Emily.shape(z) == {3, 2, 2}
      assert l(z) == [3, 0, 1, 1, 7, 4, 5, 5, 11, 8, 9, 9]
      assert l(N.take(s(), x, i32([1]), -1)) == [1, 5, 9]
    end

    test "flat", %{x: x} do
      y = N.take_flat(s(), x, i32([11, 0, 5, 6], {2, 2}))
      assert Emily.shape(y) == {2, 2}
      assert l(y) == [11, 0, 5, 6]
    end

    test "clamps out-of-range indices", %{x: x} do
      assert l(N.take(s(), x, i32([-1, 5]), 1)) == [0, 3, 4, 7, 8, 11]
      assert l(N.take_flat(s(), x, t([-3, 100], {:s, 64}))) == [0, 11]
    end

    test "errors", %{x: x} do
      assert_raise Emily.Error, ~r/take: axis 2 is out of range/, fn ->
        l(N.take(s(), x, i32([0]), 2))
      end

      assert_raise Emily.Error, ~r/integer tensor/, fn -> l(N.take_flat(s(), x, t([0.5]))) end
      assert_raise ArgumentError, fn -> N.take(s(), x, i32([0]), :zero) end
      alive!()
    end
  end

  describe "take_along_axis / put_along_axis / add_along_axis" do
    test "take_along_axis", %{x: x} do
      idx = i32([3, 0, 1, 1, 2, 2], {3, 2})
      assert l(N.take_along_axis(s(), x, idx, 1)) == [3, 0, 5, 5, 10, 10]
      idx0 = i32([2, 1, 0, 0], {1, 4})
      assert l(N.take_along_axis(s(), x, idx0, 0)) == [8, 5, 2, 3]
      # Clamped: 7 -> 3, -2 -> 0.
      assert l(N.take_along_axis(s(), x, i32([7, -2, 0, 0, 0, 0], {3, 2}), 1)) ==
               [3, 0, 4, 4, 8, 8]
    end

    test "put_along_axis: writes, drops out-of-range", %{x: x} do
      idx = i32([0, 3, 9, 1, -1, 2], {3, 2})
      v = i32([-1, -2, -3, -4, -5, -6], {3, 2})

      assert l(N.put_along_axis(s(), x, idx, v, 1)) ==
               [-1, 1, 2, -2, 4, -4, 6, 7, 8, 9, -6, 11]
    end

    test "add_along_axis: repeated indices add up, out-of-range are dropped", %{x: x} do
      idx = i32([1, 1, 3, 0, 4, 0], {3, 2})
      v = i32([10, 20, 30, 40, 50, 60], {3, 2})

      assert l(N.add_along_axis(s(), x, idx, v, 1)) ==
               [0, 31, 2, 3, 44, 5, 6, 37, 68, 9, 10, 11]
    end

    test "errors", %{x: x} do
      assert_raise Emily.Error, ~r/differ in rank/, fn ->
        l(N.take_along_axis(s(), x, i32([0]), 1))
      end

      assert_raise Emily.Error, ~r/put_along_axis: axis 5/, fn ->
        l(N.put_along_axis(s(), x, i32([0], {1, 1}), i32([0], {1, 1}), 5))
      end

      assert_raise Emily.Error, ~r/integer tensor/, fn ->
        l(N.add_along_axis(s(), x, t([0.0], {:f, 32}, {1, 1}), i32([0], {1, 1}), 0))
      end

      alive!()
    end
  end

  describe "scatter (Nx indexed_put) and scatter_add (Nx indexed_add)" do
    test "scalar updates at full indices" do
      # Nx's doctest: iota({1, 2, 3}), indices [[0,0,0], [0,1,1], [0,0,2]], updates [1, 3, -2].
      target = i32(Enum.to_list(0..5), {1, 2, 3})
      idx = i32([0, 0, 0, 0, 1, 1, 0, 0, 2], {3, 3})
      assert l(N.scatter(s(), target, idx, i32([1, 3, -2]), [0, 1, 2])) == [1, 1, -2, 3, 3, 5]

      # Nx's indexed_add doctest: repeated [0, 0, 0] adds both.
      idx = i32([0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 2, 0, 1, 2], {5, 3})
      upd = i32([1, 3, 1, -2, 5])
      assert l(N.scatter_add(s(), target, idx, upd, [0, 1, 2])) == [2, 1, 0, 3, 7, 10]
    end

    test "slices of the other axes, and the axes option" do
      # Nx's doctest: iota({1, 3, 2}), indices [[0, 0], [0, 2]], updates [[0, 10], [40, 50]].
      target = i32(Enum.to_list(0..5), {1, 3, 2})
      idx = i32([0, 0, 0, 2], {2, 2})
      upd = i32([0, 10, 40, 50], {2, 2})
      assert l(N.scatter(s(), target, idx, upd, [0, 1])) == [0, 10, 2, 3, 40, 50]

      # axes: [0, 2] on iota({1, 2, 3}): updates run along axis 1.
      target = i32(Enum.to_list(0..5), {1, 2, 3})
      upd = i32([0, 30, 20, 50], {2, 2})
      assert l(N.scatter(s(), target, idx, upd, [0, 2])) == [0, 1, 20, 30, 4, 50]
    end

    test "update slices smaller than the target start at 0", %{x: x} do
      # Row 1 gets a 2-long update in its first two columns.
      assert l(N.scatter(s(), x, i32([1], {1, 1}), i32([-1, -2], {1, 2}), [0])) ==
               [0, 1, 2, 3, -1, -2, 6, 7, 8, 9, 10, 11]
    end

    test "repeated indices: add sums all, put keeps one (the last, on the CPU)" do
      with_cpu(fn ->
        z = t([0, 0, 0, 0], {:s, 32})
        idx = i32([1, 3, 1, 1], {4, 1})
        upd = i32([10, 20, 30, 40])
        assert l(N.scatter_add(s(), z, idx, upd, [0])) == [0, 80, 0, 20]
        # Nx leaves the winner of a repeated put unspecified; MLX's CPU kernel applies the
        # updates in order.
        assert l(N.scatter(s(), z, idx, upd, [0])) == [0, 40, 0, 20]
      end)
    end

    test "max / min / prod" do
      z = t([5.0, 5.0, 5.0])
      idx = i32([0, 0, 2, 1], {4, 1})
      upd = t([7.0, 9.0, 1.0, 2.0])
      assert l(N.scatter_max(s(), z, idx, upd, [0])) == [9.0, 5.0, 5.0]
      assert l(N.scatter_min(s(), z, idx, upd, [0])) == [5.0, 2.0, 1.0]
      assert l(N.scatter_prod(s(), z, idx, upd, [0])) == [315.0, 10.0, 5.0]
    end

    test "updates are cast to the target's dtype" do
      assert l(N.scatter_add(s(), t([1, 1], {:s, 32}), i32([1], {1, 1}), t([2.7]), [0])) == [1, 3]
    end

    test "out-of-range indices are dropped", %{x: x} do
      idx = i32([0, 0, 3, 0, -1, 2, 2, 4, 2, 3], {5, 2})
      upd = i32([100, 200, 300, 400, 500])
      assert l(N.scatter(s(), x, idx, upd, [0, 1])) == [100, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 500]

      assert l(N.scatter_add(s(), x, idx, upd, [0, 1])) ==
               [100, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 511]

      assert l(N.scatter_max(s(), x, idx, i32([-1, 50, 50, 50, 50]), [0, 1])) ==
               [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 50]

      assert l(N.scatter_min(s(), t([1.0, 2.0]), i32([5, 1], {2, 1}), t([-9.0, 0.5]), [0])) ==
               [1.0, 0.5]

      assert l(N.scatter_prod(s(), t([1.0, 2.0]), i32([-1, 1], {2, 1}), t([0.0, 3.0]), [0])) ==
               [1.0, 6.0]
    end

    test "no indices leaves the target", %{x: x} do
      assert l(N.scatter(s(), x, t([], {:s, 32}, {0, 2}), t([], {:s, 32}, {0}), [0, 1])) ==
               Enum.to_list(0..11)
    end

    test "errors", %{x: x} do
      assert_raise Emily.Error, ~r/indices must have shape \{n, k\}/, fn ->
        l(N.scatter(s(), x, i32([0, 0]), i32([1]), [0, 1]))
      end

      assert_raise Emily.Error, ~r/updates \{3\} do not match indices \{2, 2\}/, fn ->
        l(N.scatter_add(s(), x, i32([0, 0, 1, 1], {2, 2}), i32([1, 2, 3]), [0, 1]))
      end

      assert_raise Emily.Error, ~r/do not fit/, fn ->
        l(N.scatter(s(), x, i32([0], {1, 1}), i32([1, 2, 3, 4, 5], {1, 5}), [0]))
      end

      assert_raise Emily.Error, ~r/integer tensor/, fn ->
        l(N.scatter_max(s(), x, t([0.0, 0.0], {:f, 32}, {1, 2}), i32([1]), [0, 1]))
      end

      assert_raise Emily.Error, ~r/axis -3 is out of range/, fn ->
        l(N.scatter_min(s(), x, i32([0, 0], {1, 2}), i32([1]), [0, -3]))
      end

      alive!()
    end
  end
end
