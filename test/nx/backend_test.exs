# Emily.Backend against Nx.BinaryBackend: every callback, on random shapes, types and
# values (ExUnit's seed makes a failure reproducible), within per-type tolerances.
if Code.ensure_loaded?(Nx) do
  defmodule Emily.Nx.BackendTest do
    use ExUnit.Case, async: true
    @moduletag :nx

    import Emily.NxOracle
    alias Emily.NxOracle, as: O

    @trials 12

    setup do
      Nx.default_backend(Emily.Backend)
      :ok
    end

    describe "creation" do
      test "tensor/from_binary, constant, iota and eye for every type" do
        for type <- O.all_types() do
          check(fn -> Nx.tensor([[1, 2, 3], [4, 5, 6]], type: type) end, [])
          check(fn -> Nx.broadcast(Nx.tensor(7, type: type), {2, 3}) end, [])
          check(fn -> Nx.iota({2, 3, 2}, type: type) end, [])
          check(fn -> Nx.iota({2, 3, 2}, axis: 1, type: type) end, [])
          check(fn -> Nx.iota({}, type: type) end, [])
          check(fn -> Nx.eye({3, 4}, type: type) end, [])
          check(fn -> Nx.eye({2, 3, 3}, type: type) end, [])
        end
      end

      @tag :non_finite
      test "constants: big integers, non-finite values and complex numbers" do
        for type <- O.int_types() do
          check(fn -> Nx.broadcast(Nx.Constants.max_finite(type), {3}) end, [])
          check(fn -> Nx.broadcast(Nx.Constants.min_finite(type), {3}) end, [])
        end

        for type <- O.float_types(), value <- [:nan, :infinity, :neg_infinity] do
          check(fn -> Nx.broadcast(Nx.tensor(value, type: type), {2}) end, [])
          check(fn -> Nx.tensor(value, type: type) end, [])
        end

        check(fn -> Nx.broadcast(Nx.tensor(Complex.new(1.5, -2.0)), {2, 2}) end, [])
        check(fn -> Nx.multiply(Nx.iota({3}), Complex.new(0, 1)) end, [])
        check(fn -> Nx.add(Nx.iota({3}, type: :f32), :nan) end, [])
      end

      test "the :device option and init/1" do
        assert Emily.Backend.init([]) == []
        assert Emily.Backend.init(device: :cpu) == [device: :cpu]

        assert_raise ArgumentError, ~r/accepts only the option :device/, fn ->
          Emily.Backend.init(foo: 1)
        end

        t = Nx.tensor([1.0, 2.0], backend: {Emily.Backend, device: :cpu})
        assert Emily.Stream.device(t.data.stream) == :cpu
        assert Nx.to_flat_list(t) == [1.0, 2.0]
      end
    end

    describe "types MLX does not have" do
      test "sub-byte integers round-trip packed and compute through the fallback" do
        for type <- [{:u, 2}, {:u, 4}, {:s, 2}, {:s, 4}] do
          {lo, hi} = if elem(type, 0) == :u, do: {0, 3}, else: {-2, 1}
          t = O.tensor({2, 3}, type, {:range, lo, hi})
          e = check(fn t -> t end, [t])
          assert Nx.to_binary(e) == Nx.to_binary(t)
          # (BinaryBackend's own elementwise ops fail on sub-byte outputs.)
          check(&Nx.equal/2, [t, t])
          check(&Nx.sum/1, [t])
          check(&Nx.transpose/1, [t])
          check(&Nx.as_type(&1, :f32), [t])
          check(&Nx.as_type(&1, type), [O.tensor({4}, {:f, 32}, {:range, lo, hi})])
          check(&Nx.reshape(&1, {3, 2}), [t])
        end
      end

      test "f8, f8_e4m3fn and c128 are held as bytes and compute through the fallback" do
        for type <- [{:f, 8}, {:f8_e4m3fn, 8}, {:c, 128}] do
          t = Nx.tensor([[1.0, -2.0], [0.5, 3.0]], type: type, backend: Nx.BinaryBackend)
          e = check(fn t -> t end, [t])
          assert Nx.to_binary(e) == Nx.to_binary(t)
          check(&Nx.multiply/2, [t, t])
          check(&Nx.transpose/1, [t])
          check(&Nx.as_type(&1, :f32), [t])
          check(fn -> Nx.iota({3}, type: type) end, [])
          check(fn -> Nx.broadcast(Nx.tensor(2.0, type: type), {2}) end, [])
        end
      end
    end

    describe "conversion" do
      test "as_type between every pair of types" do
        for from <- O.all_types(), to <- O.all_types() do
          domain = if from in O.int_types(), do: {:range, 0, 100}, else: {:range, -50, 50}
          check(&Nx.as_type(&1, to), [O.tensor({5}, from, domain)])
        end
      end

      test "as_type of non-finite floats to integers follows Nx" do
        for from <- O.float_types(), to <- O.int_types() do
          t =
            Nx.tensor([:nan, :infinity, :neg_infinity, 2.7, -1.2],
              type: from,
              backend: Nx.BinaryBackend
            )

          t = if to in [{:u, 8}, {:u, 16}, {:u, 32}, {:u, 64}], do: Nx.abs(t), else: t
          check(&Nx.as_type(&1, to), [t])
        end
      end

      @tag :non_finite
      test "bitcast between types of one width" do
        pairs = [
          {{:s, 32}, {:f, 32}},
          {{:f, 32}, {:u, 32}},
          {{:s, 64}, {:f, 64}},
          {{:u, 16}, {:f, 16}},
          {{:s, 16}, {:bf, 16}},
          {{:u, 8}, {:s, 8}},
          {{:f, 64}, {:u, 64}},
          {{:bf, 16}, {:f, 16}}
        ]

        for {from, to} <- pairs do
          check(&Nx.bitcast(&1, to), [O.tensor({2, 3}, from, :small)])
        end
      end

      test "to_binary with a limit, to_batched, backend copies and inspect" do
        t = O.tensor({5, 2}, {:f, 32})
        e = emily(t)
        assert Nx.to_binary(e) == Nx.to_binary(t)
        assert Emily.Backend.to_binary(e, 3) == binary_part(Nx.to_binary(t), 0, 12)

        for size <- [1, 2, 3, 5], leftover <- [:repeat, :discard] do
          a = e |> Nx.to_batched(size, leftover: leftover) |> Enum.to_list()
          b = t |> Nx.to_batched(size, leftover: leftover) |> Enum.to_list()
          assert length(a) == length(b)
          Enum.zip_with(a, b, &assert_same/2)
        end

        assert Nx.backend_copy(e, Nx.BinaryBackend) == t
        assert Nx.backend_copy(e, {Emily.Backend, device: :cpu}).data.ref == e.data.ref
        assert inspect(e) == inspect(t)
        assert inspect(e, limit: 3) == inspect(t, limit: 3)
        assert inspect(Nx.iota({3}, type: :bf16)) =~ "bf16[3]"
      end

      test "backend_transfer and backend_deallocate free the array at once" do
        t = O.tensor({3, 2}, {:f, 32})
        same = emily(t)
        assert Nx.backend_transfer(same, {Emily.Backend, device: :cpu}) == same
        assert Nx.to_binary(same) == Nx.to_binary(t)

        moved = emily(t)
        assert Nx.backend_transfer(moved, Nx.BinaryBackend) == t
        assert_raise Emily.Error, ~r/has been released/, fn -> Nx.to_binary(moved) end

        gone = emily(t)
        kept = Nx.multiply(gone, 2)
        assert Nx.backend_deallocate(gone) == :ok
        assert Nx.backend_deallocate(gone) == :already_deallocated

        assert_raise Emily.Error, ~r/has been released/, fn ->
          Nx.add(gone, 1) |> Nx.to_binary()
        end

        assert Nx.to_binary(kept) == Nx.to_binary(Nx.multiply(t, 2))
      end

      test "pointers are a clear error" do
        assert_raise ArgumentError, ~r/does not support Nx.to_pointer/, fn ->
          Nx.to_pointer(Nx.tensor([1]), mode: :local)
        end

        assert_raise ArgumentError, ~r/does not support Nx.from_pointer/, fn ->
          Nx.from_pointer(
            Emily.Backend,
            %Nx.Pointer{kind: :local, address: 1, data_size: 4},
            {:f, 32},
            {1}
          )
        end
      end
    end

    describe "elementwise" do
      @unary [
        exp: :any,
        expm1: :any,
        log: :positive,
        log1p: :positive,
        sigmoid: :any,
        cos: :any,
        sin: :any,
        tan: :unit,
        cosh: :any,
        sinh: :any,
        tanh: :any,
        acos: :unit,
        asin: :unit,
        atan: :any,
        acosh: :ge1,
        asinh: :any,
        atanh: :unit,
        sqrt: :positive,
        rsqrt: :positive,
        cbrt: :any,
        erf: :any,
        erfc: :any,
        erf_inv: :unit,
        abs: :any,
        ceil: :any,
        floor: :any,
        round: :halves,
        negate: :any,
        sign: :small
      ]

      test "unary float ops on every float type" do
        for {op, domain} <- @unary, type <- O.float_types(), _ <- 1..3 do
          check(&apply(Nx, op, [&1]), [O.tensor(O.shape(), type, domain)])
        end
      end

      test "unary ops on integer inputs" do
        for {op, _} <- @unary,
            op not in [:acos, :asin, :atanh, :erf_inv, :acosh, :log, :sqrt, :rsqrt, :log1p],
            type <- [{:s, 32}, {:u, 8}, {:s, 64}] do
          check(&apply(Nx, op, [&1]), [O.tensor({4}, type, {:range, 0, 3})])
        end
      end

      test "unary ops on complex inputs" do
        for op <- [:exp, :log, :sin, :cos, :sqrt, :negate, :abs, :conjugate, :real, :imag, :tanh] do
          check(&apply(Nx, op, [&1]), [O.tensor({3, 2}, {:c, 64}, :positive)],
            tol: {1.0e-4, 1.0e-5}
          )
        end

        check(&Nx.phase/1, [O.tensor({4}, {:c, 64})])
        check(&Nx.phase/1, [O.tensor({4}, {:f, 32})])
        check(&Nx.real/1, [O.tensor({4}, {:f, 32})])
        check(&Nx.imag/1, [O.tensor({4}, {:f, 32})])
        check(&Nx.conjugate/1, [O.tensor({4}, {:f, 32})])
      end

      test "NaN and infinity predicates" do
        for type <- O.float_types() do
          t = O.tensor({6}, type, :special)
          check(&Nx.is_nan/1, [t])
          check(&Nx.is_infinity/1, [t])
        end

        check(&Nx.is_nan/1, [O.tensor({3}, {:s, 32})])
        check(&Nx.is_infinity/1, [O.tensor({3}, {:u, 8})])
      end

      test "bit ops on every integer type" do
        for type <- O.int_types() do
          {lo, hi} = if elem(type, 0) == :u, do: {0, 2 ** elem(type, 1) - 1}, else: {-1000, 1000}
          t = O.tensor({7}, type, {:range, lo, hi})
          check(&Nx.bitwise_not/1, [t])
          check(&Nx.population_count/1, [t])
          check(&Nx.count_leading_zeros/1, [t])

          check(&Nx.count_leading_zeros/1, [
            Nx.tensor([0, 1], type: type, backend: Nx.BinaryBackend)
          ])
        end
      end

      @binary [
        add: {O.all_types(), :any, :any},
        subtract: {O.all_types(), :any, :any},
        multiply: {O.all_types(), :any, :any},
        divide: {O.all_types(), :any, :nonzero},
        pow: {O.real_types(), :positive, {:range, 0, 3}},
        atan2: {O.float_types(), :any, :any},
        min: {O.real_types(), :small, :small},
        max: {O.real_types(), :small, :small},
        remainder: {O.real_types(), :any, :nonzero},
        equal: {O.real_types(), :small, :small},
        not_equal: {O.real_types(), :small, :small},
        greater: {O.real_types(), :small, :small},
        less: {O.real_types(), :small, :small},
        greater_equal: {O.real_types(), :small, :small},
        less_equal: {O.real_types(), :small, :small},
        logical_and: {O.real_types(), :small, :small},
        logical_or: {O.real_types(), :small, :small},
        logical_xor: {O.real_types(), :small, :small}
      ]

      test "binary ops with broadcasting and mixed types" do
        for {op, {types, da, db}} <- @binary, _ <- 1..@trials do
          ta = Enum.random(types)
          tb = Enum.random(types)
          sa = O.shape()
          sb = O.broadcastable(sa)
          {sa, sb} = if :rand.uniform() < 0.5, do: {sa, sb}, else: {sb, sa}
          a = O.tensor(sa, ta, da)
          b = O.tensor(sb, tb, db)
          # Mixed-precision results are rounded once by BinaryBackend and after each cast
          # by MLX: compare at the lower precision.
          tol = O.tol(Enum.max_by([ta, tb, Nx.Type.merge(ta, tb)], &precision/1))
          check(&apply(Nx, op, [&1, &2]), [a, b], tol: loosest(tol, Nx.Type.merge(ta, tb)))
        end
      end

      test "integer division, remainder and quotient truncate toward zero" do
        for type <- O.int_types() do
          signed? = elem(type, 0) == :s
          a = O.tensor({8}, type, if(signed?, do: {:range, -40, 40}, else: {:range, 0, 80}))
          b = O.tensor({8}, type, if(signed?, do: :nonzero, else: {:range, 1, 9}))
          check(&Nx.quotient/2, [a, b])
          check(&Nx.remainder/2, [a, b])
        end

        a = Nx.tensor([-7.5, 7.5, -7.5, 7.5], backend: Nx.BinaryBackend)
        b = Nx.tensor([2.0, 2.0, -2.0, -2.0], backend: Nx.BinaryBackend)
        check(&Nx.remainder/2, [a, b])
      end

      test "bitwise and shift ops" do
        for type <- O.int_types(), op <- [:bitwise_and, :bitwise_or, :bitwise_xor] do
          {lo, hi} = if elem(type, 0) == :u, do: {0, 255}, else: {-300, 300}

          check(&apply(Nx, op, [&1, &2]), [
            O.tensor({5}, type, {:range, lo, hi}),
            O.tensor({5}, type, {:range, lo, hi})
          ])
        end

        for type <- O.int_types(), op <- [:left_shift, :right_shift] do
          {lo, hi} = if elem(type, 0) == :u, do: {0, 100}, else: {-100, 100}
          a = O.tensor({5}, type, {:range, lo, hi})
          b = O.tensor({5}, type, {:range, 0, 6})
          check(&apply(Nx, op, [&1, &2]), [a, b])
        end
      end

      test "select and clip" do
        for _ <- 1..@trials do
          shape = O.shape(1)
          type = Enum.random(O.real_types())

          pred =
            O.tensor(
              O.broadcastable(shape) |> then(&if(&1 == {}, do: {}, else: shape)),
              {:u, 8},
              {:range, 0, 1}
            )

          check(&Nx.select/3, [
            pred,
            O.tensor(shape, type, :small),
            O.tensor(O.broadcastable(shape), Enum.random(O.real_types()), :small)
          ])

          check(&Nx.clip(&1, -1, 2), [O.tensor(shape, type, :small)])

          check(&Nx.clip/3, [
            O.tensor(shape, type, :small),
            O.tensor({}, type, {:range, -2, 0}),
            O.tensor({}, type, {:range, 1, 2})
          ])
        end
      end
    end

    defp precision({:c, _}), do: 32
    defp precision({:f, 64}), do: 1
    defp precision({:f, 32}), do: 32
    defp precision({:bf, 16}), do: 100
    defp precision({:f, 16}), do: 90
    defp precision(_), do: 0

    defp loosest({r, a}, type) do
      {r2, a2} = O.tol(type)
      {max(r, r2), max(a, a2)}
    end

    describe "shape" do
      test "reshape, squeeze, transpose, reverse" do
        for _ <- 1..@trials do
          shape = O.shape(1, 4)
          t = O.tensor(shape, Enum.random(O.all_types()))
          axes = Nx.axes(t)
          perm = Enum.shuffle(axes)
          some = Enum.take_random(axes, Enum.random(0..length(axes)))
          check(&Nx.reshape(&1, {Nx.size(shape)}), [t])
          check(&Nx.transpose(&1, axes: perm), [t])
          check(&Nx.reverse(&1, axes: some), [t])
          with_ones = shape |> Tuple.to_list() |> Enum.intersperse(1) |> List.to_tuple()
          check(&Nx.squeeze/1, [Nx.reshape(t, with_ones)])
        end
      end

      test "broadcast with and without axes" do
        for _ <- 1..@trials do
          shape = O.shape(1)
          target = Tuple.insert_at(shape, 0, 3)
          t = O.tensor(shape, Enum.random(O.all_types()))
          check(&Nx.broadcast(&1, target), [t])
          axes = Enum.to_list(1..tuple_size(shape))
          check(&Nx.broadcast(&1, target, axes: axes), [t])
          check(&Nx.broadcast(&1, {2, 2}), [O.tensor({}, {:f, 32})])
          check(&Nx.broadcast(&1, {3, 2}, axes: [0]), [O.tensor({3}, {:s, 32})])
        end
      end

      test "pad with negative and interior padding" do
        for _ <- 1..@trials do
          shape = O.shape(1)
          t = O.tensor(shape, Enum.random(O.real_types()), :small)

          config =
            for d <- Tuple.to_list(shape) do
              interior = Enum.random(0..2)
              size = d + max(d - 1, 0) * interior
              lo = Enum.random(-min(size - 1, 1)..2)
              hi = Enum.random(-min(size - 1 + min(lo, 0), 1)..2)
              # (BinaryBackend's pad fails on results with an empty axis.)
              {lo, hi, interior}
            end

          check(&Nx.pad(&1, 7, config), [t])
        end
      end
    end

    describe "slicing and joining" do
      test "slice with strides and clamped, static and tensor starts" do
        for _ <- 1..@trials do
          shape = O.shape(1)
          t = O.tensor(shape, Enum.random(O.all_types()))
          dims = Tuple.to_list(shape)
          lengths = Enum.map(dims, &Enum.random(1..&1))
          starts = Enum.map(dims, &Enum.random(0..(&1 + 1)))
          strides = Enum.map(dims, fn _ -> Enum.random(1..3) end)
          check(&Nx.slice(&1, starts, lengths, strides: strides), [t])
          # Tensor starts (of any integer type), alone or mixed with integers.
          itype = Enum.random([{:s, 32}, {:u, 8}, {:s, 64}])

          tensor_starts =
            Enum.map(starts, &Nx.tensor(&1, type: itype, backend: Nx.BinaryBackend))

          check(&Nx.slice(&1, &2, lengths, strides: strides), [t, tensor_starts])
          mixed = Enum.map(tensor_starts, &Enum.random([&1, Nx.to_number(&1)]))
          check(&Nx.slice(&1, &2, lengths), [t, mixed])
        end
      end

      test "put_slice" do
        for _ <- 1..@trials do
          shape = O.shape(1)
          type = Enum.random(O.real_types())
          t = O.tensor(shape, type)

          update_shape =
            shape |> Tuple.to_list() |> Enum.map(&Enum.random(1..&1)) |> List.to_tuple()

          u = O.tensor(update_shape, Enum.random(O.real_types()))
          starts = for d <- Tuple.to_list(shape), do: Enum.random(0..d)
          check(&Nx.put_slice(&1, starts, &2), [t, u])
          tensor_starts = Enum.map(starts, &Nx.tensor(&1, backend: Nx.BinaryBackend))
          check(&Nx.put_slice(&1, &2, &3), [t, tensor_starts, u])
        end
      end

      test "concatenate and stack with mixed types" do
        for _ <- 1..@trials do
          shape = O.shape(1)
          axis = Enum.random(0..(tuple_size(shape) - 1))

          ts =
            for _ <- 1..Enum.random(1..3),
                do: O.tensor(shape, Enum.random(O.real_types()), :small)

          check(&Nx.concatenate(&1, axis: axis), [ts])
          check(&Nx.stack(&1, axis: axis), [ts])
        end
      end

      test "gather, take and take_along_axis with random indices" do
        for _ <- 1..@trials do
          shape = O.shape(1)
          dims = Tuple.to_list(shape)
          rank = length(dims)
          t = O.tensor(shape, Enum.random(O.all_types()))
          itype = Enum.random([{:s, 32}, {:s, 64}, {:u, 8}, {:u, 32}])
          axes = Enum.take_random(0..(rank - 1), Enum.random(1..rank)) |> Enum.sort()
          n = Enum.random(1..4)

          idx =
            for _ <- 1..n do
              for a <- axes, do: Enum.random(0..(Enum.at(dims, a) - 1))
            end

          idx = Nx.tensor(idx, type: itype, backend: Nx.BinaryBackend)
          check(&Nx.gather(&1, &2, axes: axes), [t, idx])

          axis = Enum.random(0..(rank - 1))
          d = Enum.at(dims, axis)
          take_idx = O.tensor(O.shape(0, 2), itype, {:range, 0, d - 1})
          check(&Nx.take(&1, &2, axis: axis), [t, take_idx])

          along_shape = List.replace_at(dims, axis, Enum.random(1..4)) |> List.to_tuple()
          along = O.tensor(along_shape, itype, {:range, 0, d - 1})
          check(&Nx.take_along_axis(&1, &2, axis: axis), [t, along])
        end
      end

      test "indexed_add and indexed_put with random indices and axes" do
        for op <- [:indexed_add, :indexed_put], _ <- 1..@trials do
          shape = O.shape(1)
          dims = Tuple.to_list(shape)
          rank = length(dims)
          type = Enum.random(O.real_types())
          t = O.tensor(shape, type, :small)
          axes = Enum.take_random(0..(rank - 1), Enum.random(1..rank)) |> Enum.sort()
          n = Enum.random(1..4)
          # Distinct indices: which of several updates to one place indexed_put keeps is
          # unspecified in Nx.
          picks =
            axes
            |> Enum.map(&Enum.to_list(0..(Enum.at(dims, &1) - 1)))
            |> Enum.reduce([[]], fn range, acc -> for p <- acc, i <- range, do: p ++ [i] end)
            |> Enum.take_random(n)

          idx = Nx.tensor(picks, backend: Nx.BinaryBackend)
          rest = for {d, a} <- Enum.with_index(dims), a not in axes, do: d

          updates =
            O.tensor(List.to_tuple([length(picks) | rest]), Enum.random(O.real_types()), :small)

          check(&apply(Nx, op, [&1, &2, &3, [axes: axes]]), [t, idx, updates])
        end

        # Repeated indices add up.
        t = O.tensor({3, 2}, {:f, 32})
        idx = Nx.tensor([[0, 1], [0, 1], [2, 0]], backend: Nx.BinaryBackend)
        check(&Nx.indexed_add/3, [t, idx, O.tensor({3}, {:f, 32})])
      end
    end

    describe "reductions" do
      test "sum, product, max, min, all, any over random axes" do
        for op <- [:sum, :product, :reduce_max, :reduce_min, :all, :any], _ <- 1..@trials do
          shape = O.shape(1)
          type = Enum.random(O.real_types())
          t = O.tensor(shape, type, :small)
          axes = Enum.take_random(Nx.axes(t), Enum.random(1..tuple_size(shape)))
          keep = Enum.random([true, false])
          check(&apply(Nx, op, [&1, [axes: axes, keep_axes: keep]]), [t])
          check(&apply(Nx, op, [&1]), [t])
        end
      end

      test "sum and product of complex tensors, mean" do
        t = O.tensor({3, 2}, {:c, 64})
        check(&Nx.sum(&1, axes: [0]), [t])
        check(&Nx.product/1, [t], tol: {1.0e-4, 1.0e-4})
        check(&Nx.mean(&1, axes: [1]), [O.tensor({3, 4}, {:f, 32})])
      end

      test "argmax and argmin with ties, NaN, tie_break and keep_axis" do
        for op <- [:argmax, :argmin], _ <- 1..@trials do
          shape = O.shape(1)
          t = O.tensor(shape, Enum.random(O.real_types()), :small)
          axis = Enum.random(Nx.axes(t))
          tie = Enum.random([:low, :high])
          keep = Enum.random([true, false])
          check(&apply(Nx, op, [&1, [axis: axis, tie_break: tie, keep_axis: keep]]), [t])
          check(&apply(Nx, op, [&1, [tie_break: tie]]), [t])
        end
      end

      @tag :non_finite
      test "window sum, product, max and min with strides, padding and dilations" do
        for op <- [:window_sum, :window_product, :window_max, :window_min], _ <- 1..@trials do
          shape = O.shape(1)
          dims = Tuple.to_list(shape)
          type = Enum.random(O.real_types())
          domain = if op == :window_product, do: {:range, -1, 1}, else: :small
          t = O.tensor(shape, type, domain)
          window = Enum.map(dims, &Enum.random(1..&1))
          strides = Enum.map(dims, fn _ -> Enum.random(1..2) end)

          dilations =
            Enum.zip_with(dims, window, fn d, w ->
              if (w - 1) * 2 + 1 <= d, do: Enum.random(1..2), else: 1
            end)

          padding =
            Enum.random([
              :valid,
              :same,
              Enum.map(dims, fn _ -> {Enum.random(0..1), Enum.random(0..1)} end)
            ])

          opts = [strides: strides, padding: padding, window_dilations: dilations]
          check(&apply(Nx, op, [&1, List.to_tuple(window), opts]), [t])
        end
      end

      @tag :non_finite
      test "sort and argsort, both directions, with ties and NaN" do
        for _ <- 1..@trials do
          shape = O.shape(1)
          t = O.tensor(shape, Enum.random(O.real_types()), :small)
          axis = Enum.random(Nx.axes(t))
          dir = Enum.random([:asc, :desc])
          check(&Nx.sort(&1, axis: axis, direction: dir), [t])
          check(&Nx.argsort(&1, axis: axis, direction: dir, stable: true), [t])
        end

        t = Nx.tensor([3.0, :nan, 1.0, :infinity, -2.0, :neg_infinity], backend: Nx.BinaryBackend)
        check(&Nx.sort/1, [t])
        check(&Nx.sort(&1, direction: :desc), [t])
      end

      test "window_scatter_max and window_scatter_min" do
        for op <- [:window_scatter_max, :window_scatter_min], _ <- 1..@trials do
          shape = O.shape(1)
          dims = Tuple.to_list(shape)
          type = Enum.random([{:f, 32}, {:s, 32}, {:f, 64}])
          # Small values: ties within a window (the last one wins) and padding (the init
          # value, which can win a window and then drops its update) both occur.
          t = O.tensor(shape, type, :small)
          window = Enum.map(dims, &Enum.random(1..&1))
          strides = Enum.map(dims, fn _ -> Enum.random(1..2) end)

          padding =
            Enum.random([
              :valid,
              :same,
              Enum.map(dims, fn _ -> {Enum.random(0..2), Enum.random(0..2)} end)
            ])

          opts = [strides: strides, padding: padding]

          source_shape =
            Nx.with_default_backend(Nx.BinaryBackend, fn ->
              Nx.window_sum(t, List.to_tuple(window), opts).shape
            end)

          source = O.tensor(source_shape, type, :small)
          init = Nx.tensor(Enum.random(-3..3), type: type, backend: Nx.BinaryBackend)
          check(&apply(Nx, op, [&1, &2, &3, List.to_tuple(window), opts]), [t, source, init])
        end
      end

      test "reduce and window_reduce: one op of the two arguments natively, else fallback" do
        funs = [
          &Nx.add/2,
          fn x, acc -> Nx.multiply(acc, x) end,
          &Nx.max/2,
          fn x, acc -> Nx.min(acc, x) end,
          # Not one op of the two arguments: Nx.BinaryBackend calls it per element.
          fn x, acc -> Nx.add(Nx.multiply(x, 2), acc) end,
          fn x, acc -> if Nx.to_number(x) > 0, do: Nx.add(x, acc), else: acc end
        ]

        # (Nx.BinaryBackend's window_reduce passes plain numbers to the function, which
        # then returns s32 or f32 tensors it cannot write as u8: u8 for reduce only, with
        # the functions that keep the type.)
        for {fun, i} <- Enum.with_index(funs),
            type <- if(i < 4, do: [{:s, 32}, {:f, 32}, {:u, 8}], else: [{:s, 32}, {:f, 32}]) do
          domain = if fun == (&Nx.add/2), do: :small, else: {:range, 0, 2}
          t = O.tensor({3, 4}, type, domain)
          acc = Nx.tensor(Enum.random(0..2), type: type, backend: Nx.BinaryBackend)
          check(&Nx.reduce(&1, &2, fun), [t, acc])
          check(&Nx.reduce(&1, &2, [axes: [1], keep_axes: true], fun), [t, acc])

          if type != {:u, 8} do
            opts = [strides: [1, 2], padding: [{1, 0}, {0, 2}], window_dilations: [2, 1]]
            check(&Nx.window_reduce(&1, &2, {2, 2}, opts, fun), [t, acc])
            check(&Nx.window_reduce(&1, &2, {3, 1}, fun), [t, acc])
          end
        end
      end

      @tag :non_finite
      test "cumulative ops, top_k, logical_not, all_close" do
        for op <- [:cumulative_sum, :cumulative_product, :cumulative_min, :cumulative_max],
            _ <- 1..@trials do
          shape = O.shape(1)
          type = Enum.random(O.real_types())
          domain = if op == :cumulative_product, do: {:range, -1, 2}, else: :small
          t = O.tensor(shape, type, domain)
          axis = Enum.random(Nx.axes(t))
          reverse = Enum.random([true, false])
          check(&apply(Nx, op, [&1, [axis: axis, reverse: reverse]]), [t])
        end

        for _ <- 1..@trials do
          shape = O.shape(1)
          # Distinct values: the order of tied elements is up to the implementation.
          t = Nx.iota(shape, type: :f32, backend: Nx.BinaryBackend) |> Nx.multiply(0.5)
          t = Nx.reverse(t)
          k = Enum.random(1..elem(shape, tuple_size(shape) - 1))
          check(&Nx.top_k(&1, k: k), [t])
        end

        # Ties go to the lower index, NaN is the largest, as in Nx's own top_k.
        for type <- [{:f, 32}, {:s, 32}, {:f, 16}] do
          check(&Nx.top_k(&1, k: 3), [O.tensor({3, 5}, type, :small)])
        end

        check(&Nx.top_k(&1, k: 4), [
          Nx.tensor([1.0, :nan, 3.0, :infinity, 3.0, :neg_infinity], backend: Nx.BinaryBackend)
        ])

        t = O.tensor({3, 4}, {:f, 32}, :small)
        check(&Nx.logical_not/1, [t])

        for type <- [{:f, 32}, {:f, 64}, {:f, 16}, {:s, 32}] do
          a = O.tensor({3, 4}, type, :small)
          check(&Nx.all_close(&1, &2), [a, a])
          check(&Nx.all_close(&1, &2), [a, Nx.add(a, 1.0e-3)])
          check(&Nx.all_close(&1, &2, atol: 1.0e-2), [a, Nx.add(a, 1.0e-3)])
        end

        special = O.tensor({8}, {:f, 32}, :special)

        # (nil, as Nx's own test helpers pass it, is false.)
        for equal_nan <- [true, false, nil] do
          check(&Nx.all_close(&1, &2, equal_nan: equal_nan), [special, special])
        end

        inf = Nx.tensor([1.0, :infinity], backend: Nx.BinaryBackend)

        check(&Nx.all_close(&1, &2), [
          inf,
          Nx.tensor([1.0, :neg_infinity], backend: Nx.BinaryBackend)
        ])

        check(&Nx.all_close(&1, &2), [inf, inf])
      end
    end

    describe "linear algebra" do
      test "dot with random contraction and batch axes, every type" do
        for _ <- 1..(@trials * 2) do
          type = Enum.random(O.all_types())
          batch = for _ <- 1..Enum.random(0..2)//1, do: Enum.random(1..3)
          contract = for _ <- 1..Enum.random(1..2), do: Enum.random(1..4)
          lfree = for _ <- 1..Enum.random(0..2)//1, do: Enum.random(1..3)
          rfree = for _ <- 1..Enum.random(0..2)//1, do: Enum.random(1..3)
          {l, cl, bl} = layout(batch, contract, lfree)
          {r, cr, br} = layout(batch, contract, rfree)
          a = O.tensor(l, type, :small)
          b = O.tensor(r, Enum.random([type, {:f, 32}, {:s, 32}]), :small)
          check(&Nx.dot(&1, cl, bl, &2, cr, br), [a, b])
        end
      end

      test "fft and ifft with lengths and axes; fft2, rfft, irfft" do
        for op <- [:fft, :ifft], _ <- 1..@trials do
          # (Nx.BinaryBackend's transforms along axis 0 of a rank-3 tensor come out with
          # the other two axes swapped, so the oracle is trusted up to rank 2 here.)
          shape = O.shape(1, 2)
          t = O.tensor(shape, Enum.random([{:c, 64}, {:f, 32}, {:s, 32}]))
          axis = Enum.random(Nx.axes(t))
          # (Nx.BinaryBackend's transforms fail on length 1.)
          length = Enum.random([2, 3, 4, 8] ++ if(elem(shape, axis) > 1, do: [nil], else: []))
          opts = if length, do: [axis: axis, length: length], else: [axis: axis]
          check(&apply(Nx, op, [&1, opts]), [t], tol: {1.0e-4, 1.0e-4})
        end

        t = O.tensor({3, 4}, {:c, 64})
        check(&Nx.fft2/1, [t], tol: {1.0e-4, 1.0e-4})
        check(&Nx.ifft2(&1, lengths: [2, 6]), [t], tol: {1.0e-4, 1.0e-4})
        check(&Nx.rfft/1, [O.tensor({2, 6}, {:f, 32})], tol: {1.0e-4, 1.0e-4})
        check(&Nx.irfft(&1, length: 6), [O.tensor({2, 4}, {:c, 64})], tol: {1.0e-4, 1.0e-4})
      end

      test "conv with strides, padding, dilations, groups and permutations" do
        for _ <- 1..@trials do
          spatial = Enum.random(1..2)
          groups = Enum.random(1..2)
          batch = Enum.random(1..2)
          in_ch = groups * Enum.random(1..2)
          out_ch = groups * Enum.random(1..2)
          dims = for _ <- 1..spatial, do: Enum.random(3..6)
          kdims = Enum.map(dims, &Enum.random(1..min(3, &1)))
          input = O.tensor(List.to_tuple([batch, in_ch | dims]), {:f, 32})
          kernel = O.tensor(List.to_tuple([out_ch, div(in_ch, groups) | kdims]), {:f, 32})

          opts = [
            strides: for(_ <- 1..spatial, do: Enum.random(1..2)),
            padding:
              Enum.random([
                :valid,
                :same,
                for(_ <- 1..spatial, do: {Enum.random(0..1), Enum.random(0..1)})
              ]),
            input_dilation: for(_ <- 1..spatial, do: Enum.random(1..2)),
            kernel_dilation:
              Enum.zip_with(dims, kdims, fn d, k ->
                if (k - 1) * 2 + 1 <= d, do: Enum.random(1..2), else: 1
              end),
            feature_group_size: groups
          ]

          check(&Nx.conv(&1, &2, opts), [input, kernel], tol: {1.0e-4, 1.0e-4})
        end

        # Integer inputs give a float result; permuted layouts.
        check(&Nx.conv/2, [
          O.tensor({1, 2, 4}, {:s, 32}, :small),
          O.tensor({3, 2, 2}, {:s, 32}, :small)
        ])

        # Complex inputs (four real convolutions), with groups and padding.
        check(
          &Nx.conv(&1, &2, padding: [{2, 1}], feature_group_size: 2),
          [
            O.tensor({2, 4, 5}, {:c, 64}),
            O.tensor({4, 2, 3}, {:c, 64})
          ],
          tol: {1.0e-4, 1.0e-4}
        )

        check(&Nx.conv/2, [O.tensor({1, 2, 4}, {:f, 32}), O.tensor({3, 2, 2}, {:c, 64})],
          tol: {1.0e-4, 1.0e-4}
        )

        input = O.tensor({1, 5, 5, 2}, {:f, 32})
        kernel = O.tensor({3, 2, 2, 2}, {:f, 32})

        check(
          &Nx.conv(&1, &2, input_permutation: [0, 3, 1, 2], output_permutation: [0, 3, 1, 2]),
          [input, kernel],
          tol: {1.0e-4, 1.0e-4}
        )
      end

      test "triangular_solve with every option" do
        for _ <- 1..(@trials * 2) do
          n = Enum.random(1..4)
          lower = Enum.random([true, false])
          left = Enum.random([true, false])
          transform = Enum.random([:none, :transpose, :conjugate])
          type = Enum.random([{:f, 32}, {:f, 64}, {:c, 64}, {:s, 32}])
          batch = Enum.random([[], [2]])
          # A well-conditioned matrix (a dominant diagonal); the other triangle is
          # ignored, so it is left full.
          domain = if type == {:s, 32}, do: {:range, -2, 2}, else: :unit
          a = O.tensor(List.to_tuple(batch ++ [n, n]), type, domain)

          a =
            Nx.add(
              a,
              Nx.multiply(Nx.eye(List.to_tuple(batch ++ [n, n]), backend: Nx.BinaryBackend), 4)
            )

          a =
            if Enum.random([true, false]),
              do: a,
              else: if(lower, do: Nx.tril(a), else: Nx.triu(a))

          k = Enum.random(1..3)

          b_shape =
            cond do
              batch == [] and Enum.random([true, false]) -> {n}
              left -> List.to_tuple(batch ++ [n, k])
              true -> List.to_tuple(batch ++ [k, n])
            end

          b = O.tensor(b_shape, if(type == {:s, 32}, do: {:f, 32}, else: type))
          opts = [lower: lower, left_side: left, transform_a: transform]
          # Both solve in f64 and round once.
          check(&Nx.LinAlg.triangular_solve(&1, &2, opts), [a, b], tol: {1.0e-5, 1.0e-6})
        end

        # A zero on the diagonal raises, as in Nx.
        assert_raise ArgumentError, "can't solve for singular matrix", fn ->
          Nx.LinAlg.triangular_solve(Nx.tensor([[1.0, 0.0], [2.0, 0.0]]), Nx.tensor([1.0, 2.0]))
        end
      end

      test "qr, eigh and determinant follow Nx's conventions" do
        for type <- [{:f, 32}, {:f, 64}],
            shape <- [{3, 3}, {4, 2}, {2, 4}, {2, 3, 3}, {1, 1}, {1, 3}] do
          tol = if type == {:f, 32}, do: {1.0e-4, 1.0e-4}, else: {1.0e-9, 1.0e-9}
          t = O.tensor(shape, type)
          # Signs: R's diagonal non-negative where Nx reflects, the input's where it
          # does not (already upper triangular columns, the last one of a square or
          # wide matrix).
          check(&Nx.LinAlg.qr/1, [t], tol: tol)
          check(&Nx.LinAlg.qr/1, [Nx.multiply(Nx.triu(t), -1)], tol: tol)
          check(&Nx.LinAlg.qr(&1, mode: :complete), [t], tol: tol)
        end

        for type <- [{:f, 32}, {:f, 64}], n <- [2, 3, 5] do
          m = O.tensor({n, n}, type)

          spd =
            Nx.add(Nx.dot(m, Nx.transpose(m)), Nx.eye(n, type: type, backend: Nx.BinaryBackend))

          # Eigenvalues by decreasing magnitude (eigenvector signs are not unique).
          {vals, _} = Nx.LinAlg.eigh(O.emily(spd))
          {expected, _} = Nx.LinAlg.eigh(spd, eps: 1.0e-10)
          assert_same(vals, expected, tol: {1.0e-3, 1.0e-3})
          # LU-based past 3x3 (MLX's det goes through f32-accurate exp on f64).
          check(&Nx.LinAlg.determinant/1, [m],
            tol: if(type == {:f, 64}, do: {1.0e-12, 1.0e-12}, else: {1.0e-4, 1.0e-4})
          )
        end
      end

      test "linear algebra blocks satisfy their defining equations" do
        for type <- [{:f, 32}, {:f, 64}], n <- [1, 3, 4] do
          # (Without MLX's linalg these run Nx's iterative algorithms, which stop at
          # about 1e-4.)
          tol = 1.0e-3
          m = O.tensor({n, n}, type)

          spd =
            Nx.add(
              Nx.dot(m, Nx.transpose(m)),
              Nx.multiply(Nx.eye(n, type: type, backend: Nx.BinaryBackend), n)
            )

          a = O.emily(Nx.add(m, Nx.multiply(Nx.eye(n, type: type, backend: Nx.BinaryBackend), 3)))
          spd = O.emily(spd)
          b = O.emily(O.tensor({n, 2}, type))

          # Absolute tolerance relative to the largest entry of the expected side.
          close = fn x, y ->
            scale = max(1.0, Nx.to_number(Nx.reduce_max(Nx.abs(y))))
            assert Nx.to_number(Nx.all_close(x, y, atol: tol * scale, rtol: tol)) == 1
          end

          l = Nx.LinAlg.cholesky(spd)
          close.(Nx.dot(l, Nx.transpose(l)), spd)

          x = Nx.LinAlg.solve(a, b)
          close.(Nx.dot(a, x), b)

          {q, r} = Nx.LinAlg.qr(a)
          close.(Nx.dot(q, r), a)
          close.(Nx.dot(Nx.transpose(q), q), Nx.eye(n, type: type))

          {vals, vecs} = Nx.LinAlg.eigh(spd)
          close.(Nx.dot(spd, vecs), Nx.multiply(vecs, vals))

          {u, sv, vt} = Nx.LinAlg.svd(a)
          close.(Nx.dot(Nx.multiply(u, sv), vt), a)

          {p, l, u} = Nx.LinAlg.lu(a)
          close.(p |> Nx.dot(l) |> Nx.dot(u), a)

          expected = Nx.LinAlg.determinant(Nx.backend_copy(a, Nx.BinaryBackend))
          close.(Nx.LinAlg.determinant(a), O.emily(expected))
        end
      end
    end

    # A shape with the batch axes first and the contraction axes and free axes shuffled
    # after them; returns the shape and where the contraction and batch axes are.
    defp layout(batch, contract, free) do
      nb = length(batch)
      contracted = contract |> Enum.with_index() |> Enum.map(fn {d, i} -> {:c, i, d} end)
      rest = Enum.shuffle(contracted ++ Enum.map(free, &{:f, 0, &1}))
      dims = batch ++ Enum.map(rest, &elem(&1, 2))

      contract_axes =
        rest
        |> Enum.with_index(nb)
        |> Enum.filter(&match?({{:c, _, _}, _}, &1))
        |> Enum.sort_by(fn {{:c, i, _}, _} -> i end)
        |> Enum.map(&elem(&1, 1))

      {List.to_tuple(dims), contract_axes, Enum.to_list(0..(nb - 1)//1)}
    end

    describe "inputs" do
      test "BinaryBackend tensors in any slot" do
        a = O.tensor({2, 3}, {:f, 32})
        b = O.tensor({2, 3}, {:f, 32})
        assert %Emily.Backend{} = Nx.add(emily(a), b).data
        assert %Emily.Backend{} = Nx.add(a |> Nx.backend_copy(Nx.BinaryBackend), emily(b)).data
        assert %Emily.Backend{} = Nx.select(Nx.greater(emily(a), 0), b, a).data
        assert %Emily.Backend{} = Nx.concatenate([a, emily(b)]).data
        assert_same(Nx.add(emily(a), b), Nx.add(a, b))
      end

      test "tensors of another stream are evaluated there and used here" do
        s1 = Emily.Stream.new(:cpu)
        s2 = Emily.Stream.new(:cpu)
        x = Emily.Stream.with_stream(s1, fn -> Nx.multiply(Nx.iota({3}, type: :f32), 2) end)
        assert x.data.stream == s1
        y = Emily.Stream.with_stream(s2, fn -> Nx.add(x, 1) end)
        assert y.data.stream == s2
        assert Nx.to_flat_list(y) == [1.0, 3.0, 5.0]
        # Without a stream set, an op runs on its first input's stream.
        assert Nx.add(x, 1).data.stream == s1
      end
    end

    def forward(event, measurements, meta, {pid, ref}),
      do: send(pid, {ref, event, measurements, meta})

    describe "fallback" do
      test "emits telemetry with the op and input shapes" do
        ref = make_ref()
        pid = self()

        :telemetry.attach_many(
          inspect(ref),
          [[:emily, :fallback, :start], [:emily, :fallback, :stop]],
          &__MODULE__.forward/4,
          {pid, ref}
        )

        # (A reduce function that is not one op of its two arguments falls back.)
        sum = &Nx.reduce(&1, 0, fn a, b -> Nx.add(Nx.multiply(a, 1), b) end)

        try do
          assert Nx.to_number(sum.(Nx.tensor([3, 1, 2]))) == 6

          assert_receive {^ref, [:emily, :fallback, :start], _,
                          %{op: :reduce, shapes: [{3}, {}], types: [{:s, 32}, {:s, 32}]}}

          assert_receive {^ref, [:emily, :fallback, :stop], %{duration: d}, %{op: :reduce}}
                         when d >= 0

          Nx.add(Nx.tensor([1]), 1)
          refute_receive {^ref, _, _, %{op: :add}}
        after
          :telemetry.detach(inspect(ref))
        end
      end

      @tag :capture_log
      test "config :emily, :fallback chooses :warn or :raise" do
        previous = Application.get_env(:emily, :fallback)

        try do
          sum = &Nx.reduce(&1, 0, fn a, b -> Nx.add(Nx.multiply(a, 1), b) end)
          Application.put_env(:emily, :fallback, :raise)

          assert_raise ArgumentError, ~r/no native path for reduce on s32\{3\}, s32\{\}/, fn ->
            sum.(Nx.tensor([3, 1, 2]))
          end

          assert Nx.to_flat_list(Nx.add(Nx.tensor([1]), 1)) == [2]

          Application.put_env(:emily, :fallback, :warn)

          assert ExUnit.CaptureLog.capture_log(fn -> sum.(Nx.tensor([3, 1, 2])) end) =~
                   "reduce on s32{3}, s32{} falls back to Nx.BinaryBackend"
        after
          # (Unset where no config set it, as in a project that depends on Emily.)
          if previous,
            do: Application.put_env(:emily, :fallback, previous),
            else: Application.delete_env(:emily, :fallback)
        end
      end

      test "pins the default backend to BinaryBackend while delegating" do
        # BinaryBackend's window_reduce builds tensors on the default backend internally.
        Nx.default_backend({Emily.Backend, device: :cpu})
        fun = fn a, b -> Nx.add(Nx.multiply(a, 2), b) end
        out = Nx.window_reduce(Nx.iota({1, 1, 4}, type: :f32), 0, {1, 1, 2}, fun)
        assert %Emily.Backend{} = out.data
        assert Nx.default_backend() == {Emily.Backend, [device: :cpu]}
      end
    end

    describe "svd gradients follow the forward's singular vectors" do
      # Nx differentiates Nx.LinAlg.svd through its default algorithm (singular vectors
      # from an eigh), while the forward result comes from LAPACK's SVD: the two must
      # agree on the sign of every pair of singular vectors.

      # A loss that weighs every entry of u, s and vt differently, so that a flipped
      # pair of singular vectors changes its value.
      defp svd_loss(a, opts) do
        {u, sv, vt} = Nx.LinAlg.svd(a, opts)
        {m, n} = Nx.shape(a)
        k = min(m, n)
        # A full U's columns past k are not determined by `a`: left out of the loss.
        u = Nx.slice(u, [0, 0], [m, k])
        wu = Nx.iota({m, k}, type: Nx.type(a)) |> Nx.add(1) |> Nx.sin()
        wv = Nx.iota({n, n}, type: Nx.type(a)) |> Nx.add(2) |> Nx.cos()
        ws = Nx.iota({k}, type: Nx.type(a)) |> Nx.add(1)

        Nx.sum(Nx.multiply(u, wu))
        |> Nx.add(Nx.sum(Nx.multiply(vt, wv)))
        |> Nx.add(Nx.dot(sv, ws))
      end

      # Central differences of the forward loss, entry by entry, on Emily.
      defp finite_difference(a, opts) do
        h = 1.0e-6
        {m, n} = Nx.shape(a)
        flat = Nx.to_flat_list(a)

        for i <- 0..(m * n - 1) do
          at = fn d ->
            List.update_at(flat, i, &(&1 + d))
            |> Nx.tensor(type: {:f, 64}, backend: Emily.Backend)
            |> Nx.reshape({m, n})
            |> svd_loss(opts)
            |> Nx.to_number()
          end

          (at.(h) - at.(-h)) / (2 * h)
        end
      end

      test "the gradients of Nx's example agree with Nx.BinaryBackend's" do
        t = Nx.tensor([[3.0, 0.0], [1.0, 2.0]], backend: Nx.BinaryBackend)

        for pick <- [&elem(&1, 0), &elem(&1, 1), &elem(&1, 2)] do
          f = fn a -> Nx.sum(pick.(Nx.LinAlg.svd(a))) end
          expected = Nx.with_default_backend(Nx.BinaryBackend, fn -> Nx.Defn.grad(t, f) end)
          actual = Nx.Defn.grad(O.emily(t), f)
          assert_same(actual, expected, tol: {1.0e-4, 1.0e-4})
        end

        # Nx.BinaryBackend's values: d sum(u) / dt.
        expected = [[0.2541, -0.1452], [-0.3267, -0.2178]]
        actual = Nx.Defn.grad(O.emily(t), &Nx.sum(elem(Nx.LinAlg.svd(&1), 0)))
        assert Nx.to_number(Nx.all_close(actual, Nx.tensor(expected), atol: 1.0e-4)) == 1
      end

      test "equal central differences of the forward pass, eager and compiled" do
        cases = [{{3, 3}, []}, {{4, 3}, []}, {{4, 3}, [full_matrices?: false]}, {{2, 2}, []}]

        for {shape, opts} <- cases, sign <- [1, -1] do
          # Well separated singular values: a diagonal plus a small random part.
          {m, n} = shape
          diag = Nx.multiply(Nx.eye(shape, type: {:f, 64}, backend: Nx.BinaryBackend), 3)

          diag =
            Nx.multiply(diag, Nx.add(Nx.iota({n}, type: {:f, 64}, backend: Nx.BinaryBackend), 1))

          a = Nx.add(Nx.multiply(diag, sign), O.tensor(shape, {:f, 64}))
          a = O.emily(a)
          expected = Nx.tensor(finite_difference(a, opts)) |> Nx.reshape({m, n})

          for compiler <- [Nx.Defn.Evaluator, Emily.Compiler] do
            grad =
              Nx.Defn.jit(&Nx.Defn.grad(&1, fn x -> svd_loss(x, opts) end), compiler: compiler)

            actual = Nx.backend_copy(grad.(a), Nx.BinaryBackend)

            assert Nx.to_number(Nx.all_close(actual, expected, atol: 1.0e-5, rtol: 1.0e-5)) == 1,
                   "#{inspect(shape)} #{inspect(opts)} #{inspect(compiler)}: " <>
                     "#{inspect(actual)} vs #{inspect(expected)}"
          end
        end
      end

      test "a reduced SVD zeroes the vectors of (near) zero singular values, as Nx's" do
        # Rank 2 by construction: LAPACK's third singular value is f32 rounding (about
        # 1e-7), above pinv's 1e-10 cutoff; Nx's reduced U (Vt when wide) is zero there.
        for {m, n} <- [{4, 3}, {3, 3}, {3, 4}] do
          q1 = elem(Nx.LinAlg.qr(O.tensor({m, m}, {:f, 32})), 0)
          q2 = elem(Nx.LinAlg.qr(O.tensor({n, n}, {:f, 32})), 0)
          d = Nx.put_diagonal(Nx.broadcast(0.0, {m, n}), Nx.tensor([4.0, 1.0, 0.0]))
          t = q1 |> Nx.dot(d) |> Nx.dot(q2)
          {u, sv, vt} = Nx.LinAlg.svd(O.emily(t), full_matrices?: false)
          zeroed = if m >= n, do: u[[.., 2]], else: vt[2]
          assert Nx.to_flat_list(zeroed) == List.duplicate(0.0, max(m, n))
          close = Nx.all_close(Nx.dot(Nx.multiply(u, sv), vt), O.emily(t), atol: 1.0e-5)
          assert Nx.to_number(close) == 1

          expected =
            q2
            |> Nx.transpose()
            |> Nx.dot(
              Nx.transpose(
                Nx.put_diagonal(Nx.broadcast(0.0, {m, n}), Nx.tensor([0.25, 1.0, 0.0]))
              )
            )
            |> Nx.dot(Nx.transpose(q1))

          pinv = Nx.LinAlg.pinv(O.emily(t))
          assert Nx.to_number(Nx.all_close(pinv, O.emily(expected), atol: 1.0e-4)) == 1
        end
      end

      test "Vt's rows (U's columns when wide) are eigh's eigenvectors, signs included" do
        for type <- [{:f, 32}, {:f, 64}], shape <- [{3, 3}, {5, 3}, {2, 4}, {2, 3, 3}] do
          a = O.emily(O.tensor(shape, type))
          {u, _, vt} = Nx.LinAlg.svd(a)
          rank = tuple_size(shape)
          {m, n} = {elem(shape, rank - 2), elem(shape, rank - 1)}

          # The vectors of the smaller side are the eigenvectors of its Gram matrix
          # (a^T a for m >= n, a a^T for m < n).
          batch = Enum.to_list(0..(rank - 3)//1)

          {side, gram} =
            if m >= n,
              do: {Nx.LinAlg.adjoint(vt), Nx.dot(a, [rank - 2], batch, a, [rank - 2], batch)},
              else: {u, Nx.dot(a, [rank - 1], batch, a, [rank - 1], batch)}

          {_, vecs} = Nx.LinAlg.eigh(gram)
          tol = if type == {:f, 32}, do: 1.0e-3, else: 1.0e-9
          assert Nx.to_number(Nx.all_close(side, vecs, atol: tol)) == 1
        end
      end
    end

    describe "inputs MLX takes without complaint" do
      @tag :non_finite
      test "argmax and argmin with NaN report the last NaN, for either tie-break" do
        t = Nx.tensor([[:nan, :nan, 1.0], [1.0, :nan, :nan], [2.0, 2.0, 1.0], [1.0, 1.0, 2.0]])

        for fun <- [&Nx.argmax/2, &Nx.argmin/2], tie <- [:low, :high], axis <- [0, 1] do
          check(&fun.(&1, axis: axis, tie_break: tie), [t])
          check(&fun.(&1, axis: axis, tie_break: tie, keep_axis: true), [t])
        end

        check(&Nx.argmax/1, [t])
        check(&Nx.argmin(&1, tie_break: :high), [t])
        # The documented example.
        e = Nx.argmax(Nx.tensor([2.0, :nan, 4.0]))
        assert Nx.to_number(e) == 1
      end

      @tag :non_finite
      test "cholesky of a matrix that is not positive definite is NaN, as in Nx" do
        a = Nx.tensor([[-1.0, 0.0], [0.0, -1.0]])
        l = Nx.LinAlg.cholesky(a)
        assert %Emily.Backend{} = l.data
        assert Nx.to_flat_list(l) == [:nan, 0.0, :nan, :nan]
        expected = Nx.LinAlg.cholesky(Nx.backend_copy(a, Nx.BinaryBackend))
        assert Nx.to_flat_list(expected) == [:nan, 0.0, :nan, :nan]

        # A batch keeps its positive definite matrices.
        b = Nx.tensor([[[4.0, 2.0], [2.0, 5.0]], [[1.0, 2.0], [2.0, 1.0]]])
        [ok | failed] = b |> Nx.LinAlg.cholesky() |> Nx.to_flat_list() |> Enum.chunk_every(4)
        assert ok == [2.0, 0.0, 1.0, 2.0]
        assert Enum.any?(List.flatten(failed), &(&1 == :nan))
      end

      test "c64 expm1, sigmoid, cbrt and atan2 compute, as on Nx.BinaryBackend" do
        z =
          Nx.tensor([
            Complex.new(0.5, 2.0),
            Complex.new(-1.0, 0.25),
            Complex.new(1.0e-4, -1.0e-4)
          ])

        for fun <- [&Nx.expm1/1, &Nx.sigmoid/1, &Nx.cbrt/1] do
          check(fun, [z], tol: {1.0e-4, 1.0e-5})
        end

        # Complex.atan2 is defined on real-valued complex numbers.
        a = Nx.tensor([Complex.new(1.0, 0.0), Complex.new(-2.0, 0.0)])
        b = Nx.tensor([Complex.new(-1.0, 0.0), Complex.new(3.0, 0.0)])
        check(&Nx.atan2/2, [a, b])
        check(&Nx.atan2/2, [a, Nx.tensor([2.0, -1.0])])
      end
    end
  end
else
  defmodule Emily.Nx.BackendTest do
    use ExUnit.Case, async: true
    @moduletag :nx
    require Emily.NxAbsent
    Emily.NxAbsent.placeholders()
  end
end
