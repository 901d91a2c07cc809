# Emily.Compiler's native path (the graph lowered once into one Emily.Program): the same
# defn functions through the native path (with and without mx::compile), the evaluator
# path and Nx.Defn.Evaluator on Nx.BinaryBackend agree; graphs outside the lowered subset
# fall back to the evaluator with telemetry.
if Code.ensure_loaded?(Nx) do
  defmodule Emily.Nx.CompilerNativeTest do
    use ExUnit.Case, async: false
    @moduletag :nx

    import Nx.Defn
    import Emily.NxOracle
    import Emily.NxCompiler
    alias Emily.NxOracle, as: O

    import Emily.NxModels

    defn chain(x, y, i) do
      a = Nx.sigmoid(x) * Nx.cos(y) - Nx.abs(x) / (1 + Nx.exp(-y))
      b = Nx.select(x > y, a, Nx.clip(a, -0.5, 0.5))
      c = Nx.as_type(i, :f32) * 0.25 + Nx.max(x, y) - Nx.min(x, 0.1)
      {b + c, Nx.logical_and(x >= 0, i != 2), Nx.remainder(i, 3) + Nx.quotient(i, 2) * i}
    end

    defn reductions(x) do
      {Nx.sum(x), Nx.mean(x, axes: [1]), Nx.reduce_max(x, axes: [0], keep_axes: true),
       Nx.reduce_min(x, axes: [1, 2]), Nx.product(x / 4 + 1, axes: [2]),
       Nx.all(x > -3, axes: [0]), Nx.any(x > 1.5)}
    end

    defn shapes(x, y) do
      t = x |> Nx.transpose(axes: [1, 0, 2]) |> Nx.reshape({3, 8}) |> Nx.reverse(axes: [1])
      s = Nx.slice(t, [1, 2], [2, 4], strides: [1, 2])
      c = Nx.concatenate([t, Nx.as_type(y, :f32)], axis: 0)
      b = Nx.new_axis(Nx.sum(x, axes: [2]), 0) |> Nx.squeeze(axes: [0])
      {s, c, b + Nx.broadcast(Nx.tensor([1.0, 2.0, 3.0]), {2, 3})}
    end

    defn masked(x) do
      {n, m} = Nx.shape(x)
      mask = Nx.iota({n, m}, axis: 0) >= Nx.iota({n, m}, axis: 1)
      {Nx.select(mask, x, -1.0e9) |> softmax(), Nx.iota({2, 3}, type: :f16), Nx.iota({2, 3})}
    end

    defn truncations(x) do
      y = x * 3
      a = Nx.abs(y)

      {Nx.as_type(y, :s32), Nx.as_type(y, :s64), Nx.as_type(y, :s8), Nx.as_type(a, :u8),
       Nx.as_type(a, :u64), Nx.as_type(Nx.as_type(y, :bf16), :s16)}
    end

    # Selects on comparisons and logical ops of them; a logical result and a negated one
    # as outputs.
    defn masks(x, y) do
      both = Nx.logical_and(x > 0, y < 0.5)

      {Nx.select(x > y, x, y), Nx.select(both, x, 0.0), Nx.logical_or(x > 0, y > 0),
       Nx.logical_not(x >= y)}
    end

    # Counting in each kind of type: 16-bit floats count in s32, complex in f32.
    defn iotas(x) do
      {Nx.iota({2, 3}, type: :bf16) + x, Nx.iota({3, 2}, axis: 0, type: :c64),
       Nx.iota({4}, type: :u8), Nx.iota({}, type: :f16)}
    end

    # No integer is NaN or infinite; a complex number is where either part is.
    defn classified(x, i, z) do
      {Nx.is_nan(x), Nx.is_infinity(x), Nx.is_nan(i), Nx.is_infinity(i), Nx.is_nan(z),
       Nx.is_infinity(z), Nx.logical_not(Nx.is_nan(x))}
    end

    # From complex: the real part (to an integer, as a float converts).
    defn(from_complex(z), do: {Nx.as_type(z, :f32), Nx.as_type(z, :s32), Nx.as_type(z, :u8)})

    # `x - 1` twice as two Nx nodes, and `i` cast to f32 for three ops.
    defn(duplicates(x, i), do: {(x - 1) * (x - 1) + i, (x + i) * i})

    # Transposes that cancel, and a chain of reshapes.
    defn views(x) do
      back = x |> Nx.transpose(axes: [0, 2, 1]) |> Nx.transpose(axes: [0, 2, 1]) |> Nx.exp()
      twice = x |> Nx.transpose(axes: [1, 0, 2]) |> Nx.transpose(axes: [0, 2, 1])
      chain = x |> Nx.reshape({6, 4}) |> Nx.reshape({2, 12}) |> Nx.reshape({24})
      {back, twice, chain}
    end

    # A stopping test as Bumblebee's generation loop writes it: comparisons, a
    # reduction and logical ops over Nx's u8 predicates.
    defn stop_test(x, y) do
      done = Nx.any(Nx.equal(x, y), axes: [1])
      stop = Nx.logical_or(done, Nx.greater(x[[.., 0]], 2))
      {Nx.select(stop, x[[.., 0]], 0), Nx.all(done)}
    end

    defn indexing(x, idx, pos) do
      {Nx.take(x, idx, axis: 0), Nx.take_along_axis(x, Nx.argsort(x, axis: 1), axis: 1),
       Nx.gather(x, Nx.stack([idx, Nx.remainder(idx + 1, 4)], axis: 1)),
       Nx.slice(x, [pos, 0], [2, 3]), Nx.slice(x, [pos, 2], [1, 2]),
       Nx.put_slice(x, [pos, 1], Nx.broadcast(-1.0, {1, 2})),
       Nx.put_slice(x, [2, 3], Nx.broadcast(-2.0, {2, 2})),
       Nx.indexed_add(x, Nx.stack([idx, idx], axis: 1), Nx.as_type(idx, :f32) + 0.5),
       Nx.indexed_put(x, Nx.stack([idx, idx + 1], axis: 1), Nx.as_type(idx, :f32) - 7)}
    end

    defn orderings(x, i) do
      {Nx.argmax(x), Nx.argmin(x, axis: 1), Nx.argmax(i, axis: 0, tie_break: :high),
       Nx.argmin(i, axis: 1, keep_axis: true), Nx.argmax(i, tie_break: :high),
       Nx.sort(x, axis: 1, direction: :desc), Nx.sort(i, axis: 0),
       Nx.argsort(i, axis: 1, direction: :desc), Nx.cumulative_sum(x, axis: 1),
       Nx.cumulative_max(x, axis: 0, reverse: true), Nx.cumulative_product(i, axis: 1),
       Nx.cumulative_min(i, axis: 0), Nx.logical_not(x > 0)}
    end

    defn windows(x, k, g) do
      {Nx.window_sum(x, {1, 1, 2, 2}, padding: :same),
       Nx.window_max(x, {1, 1, 2, 2}, strides: [1, 1, 2, 2]),
       Nx.window_min(x, {1, 2, 2, 1}, padding: [{0, 0}, {0, 0}, {1, 1}, {0, 0}]),
       Nx.window_product(x, {1, 1, 1, 2}, window_dilations: [1, 1, 2, 1]),
       Nx.conv(x, k, padding: :same), Nx.conv(x, g, strides: 2, feature_group_size: 2),
       Nx.pad(x, 0.5, [{0, 0, 0}, {0, 0, 0}, {1, -1, 1}, {2, 0, 0}]), Nx.eye(3) + x[0][0][0][0],
       Nx.eye({2, 3, 3}, type: :s32)}
    end

    defn(inverses(x, i), do: {Nx.erf_inv(x), Nx.bitcast(i, :f32), Nx.bitcast(x, :u32)})

    defn spectra(x, z) do
      f = Nx.fft(x)

      {f, Nx.ifft(f), Nx.fft(z, length: 6), Nx.real(f), Nx.imag(f), Nx.conjugate(z), Nx.imag(x),
       Nx.real(x), Nx.abs(Nx.ifft(z, eps: 1.0e-3))}
    end

    # Complex constants: literals, a real literal of a complex type; infinite and NaN
    # parts.
    defn complex_constants(x, z) do
      {x * Complex.new(0.0, 1.0) + Complex.new(-2.5, 0.25), z - 3.0,
       Nx.exp(Complex.new(0.0, 0.5) * z)}
    end

    defn non_finite_complex_constants(x) do
      {Nx.select(x > 0, Complex.new(:infinity, -1.0), Complex.new(1.0, :nan)),
       Nx.broadcast(Complex.new(:neg_infinity, :infinity), {2})}
    end

    defn(branchy(x), do: if(Nx.sum(x) > 0, do: Nx.exp(x), else: x * 2))

    # Vectorized inputs (Nx's front end writes the graph over their devectorized shapes):
    # with plain ones, reductions, dot, a conditional (a select, per entry), indexing
    # with vectorized indices, a scan, a counted loop, and an input-dependent loop
    # (per entry, inside a loop over the entries: not lowered).
    defn vectorized(x, y, idx) do
      {Nx.sum(Nx.exp(x) * y, axes: [0]) + Nx.dot(x, y), if(Nx.sum(x) > 0, do: x * 2, else: x - 1),
       Nx.take(y, idx), Nx.cumulative_sum(x),
       elem(while({x, i = 0}, i < 3, do: {x * 2 + i, i + 1}), 0), Nx.argmax(x), x[1],
       Nx.reshape(x, {3, 1}), Nx.broadcast(y, {2, 3}) + x, Nx.iota({2}) + x[0]}
    end

    defn(vectorized_grow(x), do: while(acc = x, Nx.all(acc < 100), do: acc * 2 + 1))

    # Loops of a number of passes known when the graph is lowered: over a range, over a
    # tensor's rows, nested, with a body that reads the input.
    defn loops(x, w) do
      {_i, acc, _w} =
        while {i = 0, acc = x, w}, i < 3 do
          {i + 1, Nx.tanh(Nx.dot(acc, w)) + i, w}
        end

      rows =
        while total = Nx.broadcast(0.0, {Nx.axis_size(w, 1)}), row <- w do
          {inner, _row} =
            while {t = total, row}, j <- 0..1 do
              {t + row * j, row}
            end

          inner - row / 2
        end

      # The counter as a start index: static slices once unrolled.
      {_i, written, _x} =
        while {i = 0, out = Nx.broadcast(0.0, {3, 3}), x}, i < 2 do
          {i + 1, Nx.put_slice(out, [i + 1, 0], x[[0..0, 0..2]] * i), x}
        end

      {acc, rows, written}
    end

    # `if` and `cond` on a value (every branch computed, the results selected), on a
    # constant (decided as the graph is lowered), returning tuples, with a captured
    # tensor in a branch.
    defn branches(x, i) do
      a =
        if Nx.sum(x) > 0 do
          x * 2
        else
          x - Nx.tensor([1.0, 2.0, 3.0])
        end

      {b, c} =
        cond do
          i == 0 -> {x + 1, i}
          i < 0 -> {Nx.exp(x), -i}
          true -> {Nx.sin(x), i * 2}
        end

      {_n, d} =
        while {n = 0, d = x}, n < 3 do
          {n + 1, if(n == 1, do: d * 10, else: d + 1)}
        end

      {a, b, c, d}
    end

    # A generation loop's shape: a buffer written a slot per pass (a key/value cache) that
    # the loop's result does not read.
    defn filled_cache(x) do
      {_cache, acc, _i} =
        while {cache = Nx.broadcast(0.0, {8}), acc = x, i = 0}, Nx.sum(acc) < 100 do
          cache = Nx.put_slice(cache, [Nx.remainder(i, 8)], Nx.reshape(Nx.sum(acc), {1}))
          {cache, acc * 2 + Nx.mean(cache), i + 1}
        end

      acc
    end

    defn host_loops(x, n) do
      {a, _n} =
        while {a = x * 2, n}, Nx.sum(a) < n * 10 do
          {a + Nx.abs(a) + 1, n}
        end

      {b, steps, _a} =
        while {b = Nx.sum(a), steps = 0, a}, b > 1 do
          # An inner loop reading the outer loop's state.
          {halved, _, _} =
            while {h = b, k = 0, m = Nx.as_type(Nx.reduce_max(Nx.abs(a)), :s32)},
                  k < m and h > 1 do
              {h / 2, k + 1, m}
            end

          {halved - 0.5, steps + 1, a}
        end

      {a * x, b + Nx.sum(x), steps}
    end

    defn count_to(x) do
      x + while(i = 0, i < 2000, do: i + 1)
    end

    # 600 passes of a body of nine instructions: more than the lowering unrolls.
    defn long_body(x) do
      {y, _i} =
        while {y = x, i = 0}, i < 600 do
          {Nx.sin(y) * 0.9 + Nx.cos(y) * 0.1 - i / 1000, i + 1}
        end

      y
    end

    # Such a loop inside an unrolled one.
    defn long_in_short(x) do
      {y, _j} = while({y = x, j = 0}, j < 2, do: {long_body(y), j + 1})
      y
    end

    defn random(key) do
      {u, key} = Nx.Random.uniform_split(key, -1.0, 1.0, shape: {3, 4}) |> then(&{&1, key})
      normal = Nx.Random.normal_split(key, 0.0, 2.0, shape: {5})
      {ints, key} = Nx.Random.randint(key, 0, 10, shape: {6}, type: :s32)
      {shuffled, _key} = Nx.Random.shuffle(key, Nx.iota({7}))
      {u, normal, ints, shuffled, Nx.Random.split(key)}
    end

    # A small convolutional classifier's loss: its gradient takes the window scatters
    # (max pooling), indexed_add (the embedding) and transposed convolutions.
    defn cnn_loss({kernel, emb, w}, x, tokens) do
      h = x |> Nx.conv(kernel, padding: :same) |> Nx.tanh()
      h = Nx.window_max(h, {1, 1, 2, 2}, strides: [1, 1, 2, 2], padding: :same)
      h = Nx.window_min(h, {1, 1, 1, 2}, padding: :valid)
      logits = Nx.dot(Nx.mean(h, axes: [2, 3]) + Nx.take(emb, tokens, axis: 0), w)
      Nx.sum(softmax(logits) ** 2)
    end

    defn(cnn_grad(params, x, tokens), do: grad(params, &cnn_loss(&1, x, tokens)))

    # Nx.reduce and Nx.window_reduce with one Nx op for a function (either order), the
    # accumulators ones that change the results.
    defn folds(x) do
      {Nx.reduce(x, 10, [axes: [1]], &Nx.add/2), Nx.reduce(x, 2, fn a, b -> b * a end),
       Nx.reduce(x, -10, [axes: [0], keep_axes: true], &Nx.max/2),
       Nx.window_reduce(x, 5, {2, 2}, [padding: :same], &Nx.min/2),
       Nx.window_reduce(x, 3, {1, 2}, [strides: [1, 2]], fn a, b -> a + b end)}
    end

    defn(other_fold(x), do: Nx.reduce(x, 0, fn a, b -> a + b * 2 end))

    # Metadata around a tuple (stop_grad of a container), and captured tensors inside.
    defn(wrapped(x),
      do: stop_grad({x * Nx.tensor([2.0, 3.0]), x + 1}) |> then(fn {a, b} -> a - b end)
    )

    defmodule Doubled do
      @moduledoc false
      # A block Emily has no kernel for: it runs its default.
      defstruct [:limit]
    end

    defn blocks(x, y) do
      {values, indices} = Nx.top_k(x, k: 2)

      doubled =
        Nx.block(%Doubled{limit: 0.5}, [x, y], x, fn %Doubled{limit: l}, x, y ->
          Nx.clip(x, -l, l) * 2 + y
        end)

      {values, indices, Nx.all_close(x, y), Nx.all_close(x, x + 1.0e-9), doubled}
    end

    # The ops lowered since the first subset, over every real type.
    defn typed(x, idx) do
      {values, _} = Nx.top_k(x, k: 2)

      {Nx.take(x, idx, axis: 1), Nx.take_along_axis(x, Nx.argsort(x, axis: 1), axis: 1),
       Nx.argmax(x, axis: 1, tie_break: :high), Nx.argmin(x),
       Nx.sort(x, axis: 0, direction: :desc), Nx.cumulative_sum(x, axis: 1),
       Nx.cumulative_max(x, axis: 0), values, Nx.pad(x, 1, [{1, 0, 1}, {0, -1, 0}]),
       Nx.window_max(x, {2, 2}, padding: :same), Nx.window_sum(x, {1, 2}),
       Nx.indexed_add(x, Nx.stack([Nx.remainder(idx, 3), idx], axis: 1), x[[.., 0]]),
       Nx.put_slice(x, [1, 2], x[[0..1, 0..1]]), Nx.stack([x, Nx.reverse(x)], axis: 2),
       Nx.gather(x, Nx.stack([Nx.remainder(idx, 3), Nx.remainder(idx + 1, 4)], axis: 1))}
    end

    # Runs `fun` on every path and asserts they agree with Nx.BinaryBackend, and that
    # the native runs did not fall back.
    defp check_paths(fun, args, opts \\ []) do
      expected = oracle_jit(fun, args)

      assert_same(apply(ejit(fun, native: false), args), expected, opts)

      for out <- native_results(fun, args), do: assert_same(out, expected, opts)
    end

    defp oracle_jit(fun, args) do
      Nx.with_default_backend(Nx.BinaryBackend, fn ->
        apply(Nx.Defn.jit(fun, compiler: Nx.Defn.Evaluator), args)
      end)
    end

    test "MLP forward" do
      x = O.tensor({4, 5}, {:f, 32})

      params =
        {O.tensor({5, 8}, {:f, 32}), O.tensor({8}, {:f, 32}), O.tensor({8, 3}, {:f, 32}),
         O.tensor({3}, {:f, 32})}

      check_paths(&mlp/2, [x, params])
    end

    test "softmax" do
      check_paths(&softmax/1, [O.tensor({3, 7}, {:f, 32})])
    end

    test "attention block (batched dots)" do
      q = O.tensor({2, 4, 8}, {:f, 32})
      k = O.tensor({2, 5, 8}, {:f, 32})
      v = O.tensor({2, 5, 6}, {:f, 32})
      check_paths(&attention/3, [q, k, v])
    end

    test "elementwise chain with comparisons, select, clip, integer ops" do
      x = O.tensor({3, 4}, {:f, 32})
      y = O.tensor({3, 4}, {:f, 32})
      i = Nx.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [-1, -2, -3, -4]], type: :s32)
      check_paths(&chain/3, [x, y, i])
    end

    test "reductions with axes and keep_axes" do
      check_paths(&reductions/1, [O.tensor({2, 3, 4}, {:f, 32})])
    end

    test "shape ops, slices, concatenation and captured tensors" do
      x = O.tensor({2, 3, 4}, {:f, 32})
      y = Nx.iota({2, 8}, type: :s32)
      check_paths(&shapes/2, [x, y])
    end

    test "iota (a causal mask)" do
      check_paths(&masked/1, [O.tensor({4, 4}, {:f, 32})])
    end

    test "iota of 16-bit float, complex and integer types" do
      check_paths(&iotas/1, [O.tensor({2, 3}, {:bf, 16})])
    end

    test "is_nan and is_infinity of float, integer and complex tensors" do
      x = Nx.tensor([1.0, :nan, :infinity, :neg_infinity, -0.0])
      i = Nx.tensor([[0, -1], [2_147_483_647, 3]], type: :s32)

      z =
        Nx.complex(Nx.tensor([1.0, :nan, 2.0, :infinity]), Nx.tensor([:infinity, 0.0, 1.0, 3.0]))

      check_paths(&classified/3, [x, i, z])

      [nan, inf | _] = Tuple.to_list(hd(native_results(&classified/3, [x, i, z])))
      assert Nx.to_flat_list(nan) == [0, 1, 0, 0, 0]
      assert Nx.to_flat_list(inf) == [0, 0, 1, 1, 0]
    end

    test "f16 and integer inputs" do
      check_paths(&softmax/1, [O.tensor({2, 5}, {:f, 16})])

      # The f32 result is built from f16 intermediates: f16's tolerance.
      check_paths(
        &chain/3,
        [
          O.tensor({2, 2}, {:f, 16}),
          O.tensor({2, 2}, {:f, 16}),
          Nx.tensor([[1, 2], [3, 4]], type: :s32)
        ],
        tol: O.tol({:f, 16})
      )
    end

    test "indexing: take, take_along_axis, gather, dynamic and static slices, put_slice, indexed ops" do
      x = O.tensor({4, 5}, {:f, 32})
      check_paths(&indexing/3, [x, Nx.tensor([2, 0, 3], type: :s32), Nx.tensor(1)])
      # Start indices past the end are clamped, as Nx clamps them.
      check_paths(&indexing/3, [x, Nx.tensor([1, 1, 0], type: :s64), Nx.tensor(9)])
    end

    test "indexing, orderings, pad, windows and top_k over every real type" do
      idx = Nx.tensor([2, 0, 3], type: :s32)

      for type <- O.real_types(), type != {:f, 64} or Emily.default_device() == :cpu do
        check_paths(&typed/2, [O.tensor({3, 4}, type, :small), idx], tol: O.tol(type))
      end
    end

    test "argmax, argmin, sort, argsort, cumulative ops and logical_not" do
      i = Nx.tensor([[1, 3, 3, 0], [2, 2, 0, 1], [3, 0, 3, 1]], type: :s32)
      check_paths(&orderings/2, [O.tensor({3, 4}, {:f, 32}), i])
      check_paths(&orderings/2, [O.tensor({3, 4}, {:f, 16}), Nx.as_type(i, :u8)])
    end

    test "window reductions, conv, pad and eye" do
      x = O.tensor({2, 2, 4, 5}, {:f, 32})

      check_paths(&windows/3, [
        x,
        O.tensor({2, 2, 3, 3}, {:f, 32}),
        O.tensor({2, 1, 2, 2}, {:f, 32})
      ])
    end

    test "while loops of a number of passes known when lowered are unrolled" do
      check_paths(&powers/1, [O.tensor({3}, {:f, 32})])
      check_paths(&loops/2, [O.tensor({2, 3}, {:f, 32}), O.tensor({3, 3}, {:f, 32})])
    end

    test "if and cond: decided on constants, else both sides computed and selected" do
      for x <- [Nx.tensor([1.0, -0.5, 2.0]), Nx.tensor([-3.0, 0.5, -2.0])],
          i <- [-2, 0, 3] do
        check_paths(&branches/2, [x, Nx.tensor(i)])
      end
    end

    test "Nx.Random in defn (threefry's loops, erf_inv) gives Nx.BinaryBackend's numbers" do
      check_paths(&random/1, [Nx.Random.key(42)])
    end

    test "fft, ifft and complex parts" do
      x = O.tensor({2, 4}, {:f, 32})
      z = Nx.complex(O.tensor({3, 4}, {:f, 32}), O.tensor({3, 4}, {:f, 32}))
      check_paths(&spectra/2, [x, z])
    end

    test "vectorized tensors" do
      x = Nx.vectorize(O.tensor({2, 3}, {:f, 32}), :b)
      y = O.tensor({3}, {:f, 32})
      idx = Nx.vectorize(Nx.tensor([[2, 0], [1, 1]], type: :s32), :b)
      expected = oracle_jit(&vectorized/3, [x, y, idx])

      for out <- native_results(&vectorized/3, [x, y, idx]) do
        Enum.zip_with(Tuple.to_list(out), Tuple.to_list(expected), fn a, e ->
          assert a.vectorized_axes == [b: 2]
          assert_same(Nx.devectorize(a), Nx.devectorize(e))
        end)
      end

      x = Nx.vectorize(Nx.tensor([[1.0, 2.0], [30.0, 0.5]]), :b)
      {out, fallbacks} = with_fallbacks(fn -> ejit(&vectorized_grow/1).(x) end)
      assert [%{reason: reason}] = fallbacks
      assert reason == {:while, :condition_reads_input} or debug_fallbacks?(fallbacks)
      assert_same(Nx.devectorize(out), Nx.devectorize(oracle_jit(&vectorized_grow/1, [x])))
    end

    test "complex constants" do
      x = O.tensor({3, 4}, {:f, 32})
      z = Nx.complex(O.tensor({3, 4}, {:f, 32}), O.tensor({3, 4}, {:f, 32}))
      check_paths(&complex_constants/2, [x, z])

      # (:debug_detect_nan_inf raises on reading them back.)
      unless Emily.Debug.detect_nan_inf?(), do: check_paths(&non_finite_complex_constants/1, [x])
    end

    test "erf_inv (Nx's formula on the CPU) and bitcast" do
      # (erf_inv(±1) is infinite, which :debug_detect_nan_inf would report.)
      edges = if Emily.Debug.detect_nan_inf?(), do: [], else: [-1.0, 1.0]
      x = Nx.tensor(edges ++ [-0.999, -0.5, 0.0, 0.1, 0.7, 0.9999])
      check_paths(&inverses/2, [x, Nx.tensor([0, 1_065_353_216, -1_082_130_432], type: :s32)])
    end

    test "the gradient of a convolutional classifier (window scatters, indexed_add)" do
      params =
        {O.tensor({3, 2, 3, 3}, {:f, 32}), O.tensor({4, 3}, {:f, 32}), O.tensor({3, 2}, {:f, 32})}

      args = [params, O.tensor({2, 2, 5, 5}, {:f, 32}), Nx.tensor([3, 1], type: :s32)]
      check_paths(&cnn_grad/3, args, tol: {1.0e-4, 1.0e-5})
    end

    test "reduce and window_reduce with one op for a function; another function falls back" do
      check_paths(&folds/1, [O.tensor({3, 4}, {:f, 32})])

      check_paths(&folds/1, [Nx.tensor([[1, -2, 3, 4], [0, 5, -6, 2], [7, 1, 1, -1]], type: :s32)])

      {out, fallbacks} =
        with_fallbacks(fn -> ejit(&other_fold/1, native: true).(Nx.tensor([1, 2])) end)

      assert [%{reason: {:reduce, :function}}] = fallbacks
      # The function gets (element, accumulator): 0 -> 1 + 0 * 2 -> 2 + 1 * 2.
      assert Nx.to_number(out) == 4
    end

    test "on f64, the ops MLX computes with f32 accuracy fall back, and match Nx.BinaryBackend" do
      x = Nx.tensor([8.11717155751262, -0.5, 3.0], type: :f64)

      for fun <- [&Nx.exp/1, &Nx.sin/1, &Nx.sigmoid/1, &Nx.divide(2, Nx.exp(&1))] do
        {out, fallbacks} = with_fallbacks(fn -> ejit(fun, native: true).(x) end)

        if Emily.default_device() == :cpu,
          do: assert([%{reason: {:f64_imprecise, _}}] = fallbacks),
          else: assert([%{reason: {:type, {:f, 64}}}] = fallbacks)

        assert_same(out, Nx.with_default_backend(Nx.BinaryBackend, fn -> fun.(x) end))
      end
    end

    # Literals (typed s32 by Nx, so cut to 32 bits) and 64-bit constants.
    defn big_constants(u, s) do
      {u + 4_607_182_418_800_017_408, Nx.bitwise_and(s, -4_611_686_018_427_387_905),
       s - 9_007_199_254_740_993, u + Nx.tensor(4_607_182_418_800_017_408, type: :u64),
       s + Nx.tensor(-4_611_686_018_427_387_905, type: :s64)}
    end

    test "64-bit integer constants a double does not hold" do
      u = Nx.tensor([0, 1, 2], type: :u64)
      s = Nx.tensor([-1, 5, 9_223_372_036_854_775_807], type: :s64)
      check_paths(&big_constants/2, [u, s])
    end

    test "metadata around a tuple" do
      check_paths(&wrapped/1, [O.tensor({2}, {:f, 32})])
    end

    test "an error while lowering a traced graph is a fallback reason, not the caller's error" do
      expr = Nx.Defn.debug_expr(&Nx.exp/1).(Nx.tensor([1.0]))
      broken = put_in(expr.data.args, [:not_a_tensor])

      assert {:unsupported, {:lowering_failed, FunctionClauseError, _message}} =
               catch_throw(Emily.Compiler.Native.lower([], fn [] -> broken end, device: :cpu))

      # The tracing itself is the caller's code, and raises as such.
      assert_raise RuntimeError, "traced", fn ->
        Emily.Compiler.Native.lower([], fn [] -> raise "traced" end, device: :cpu)
      end
    end

    defn(linalg(a, b),
      do: {Nx.LinAlg.cholesky(a), Nx.LinAlg.solve(a, b), Nx.LinAlg.determinant(a)}
    )

    # The linear algebra a program does not hold, between ops that it does.
    defn more_linalg(a, b) do
      {q, r} = Nx.LinAlg.qr(a * 2)
      {values, vectors} = Nx.LinAlg.eigh(a + Nx.transpose(a))
      {u, s, vt} = Nx.LinAlg.svd(a)
      {p, l, upper} = Nx.LinAlg.lu(a - 0.05)
      x = Nx.LinAlg.triangular_solve(r, b + 1, lower: false)

      {q + 1, Nx.sum(r), values * 2, vectors, u, s, vt, p, l, upper,
       Nx.LinAlg.determinant(a) + Nx.LinAlg.determinant(a * 3), x, Nx.exp(x)}
    end

    test "Cholesky, solve and small determinants as LAPACK on a CPU program; the rest on the host" do
      a = Nx.tensor([[4.0, 1.0, 0.5], [1.0, 3.0, 0.2], [0.5, 0.2, 2.0]])
      b = Nx.tensor([1.0, -2.0, 0.5])

      for type <- [{:f, 32}, {:f, 64}] do
        args = [Nx.as_type(a, type), Nx.as_type(b, type)]
        expected = Nx.with_default_backend(Nx.BinaryBackend, fn -> apply(&linalg/2, args) end)
        jit = ejit(&linalg/2, native: true, device: :cpu)
        {out, fallbacks} = with_fallbacks(fn -> apply(jit, args) end)
        assert debug_fallbacks?(fallbacks)
        assert_same(out, expected, tol: {1.0e-5, 1.0e-5})
      end

      # LAPACK's other blocks, larger determinants and triangular_solve: Emily.Backend
      # computes them on the host, between the programs, as on the evaluator path.
      a4 = Nx.add(Nx.eye(4), Nx.iota({4, 4}, type: :f32) |> Nx.divide(40))
      args = [a4, Nx.tensor([1.0, -2.0, 0.5, 3.0])]
      expected = apply(ejit(&more_linalg/2, native: false, device: :cpu), args)
      jit = ejit(&more_linalg/2, device: :cpu)
      {out, fallbacks} = with_fallbacks(fn -> apply(jit, args) end)
      assert debug_fallbacks?(fallbacks)
      assert_same(out, expected, tol: {1.0e-6, 1.0e-6})

      # Seven steps: QR, eigh, SVD, LU, the triangular solve and the two determinants.
      if fallbacks == [], do: assert(host_steps(plan_of(jit, args)) == 7)
    end

    defp host_conds({:cond, predicates, branches, rest}),
      do:
        1 + host_conds(predicates) + Enum.sum(Enum.map(branches, &host_conds/1)) +
          host_conds(rest)

    defp host_conds({:call, data, _call, rest}), do: host_conds(data) + host_conds(rest)
    defp host_conds({:program, _, _}), do: 0

    defp host_steps({:program, _, _}), do: 0
    defp host_steps({:call, data, _call, rest}), do: host_steps(data) + 1 + host_steps(rest)

    test "blocks without a kernel lower their default: top_k, all_close, a library's block" do
      check_paths(&blocks/2, [O.tensor({3, 5}, {:f, 32}), O.tensor({3, 5}, {:f, 32})])
    end

    test "a predicate made by comparisons and logical ops stays MLX's bool" do
      x = O.tensor({2, 3}, {:f, 32})
      y = O.tensor({2, 3}, {:f, 32})

      {instrs, _, _, _, _} = Emily.Compiler.Native.instructions_of(&masks/2, [x, y])

      # Only the two results Nx types as u8 are cast; before, each comparison was cast to
      # u8 and back to bool, and each logical op's result to u8 (fourteen casts here).
      casts = Enum.filter(instrs, &match?({:astype, _}, &1))
      assert [{:astype, [_, {:u, 8}]}, {:astype, [_, {:u, 8}]}] = casts

      check_paths(&masks/2, [x, y])
    end

    test "each distinct instruction is emitted once" do
      x = O.tensor({2, 3}, {:f, 32})
      i = Nx.tensor([[0, 1, 2], [-3, 4, 5]], type: :s32)

      {instrs, 3, outputs, [one], _template} =
        Emily.Compiler.Native.instructions_of(&duplicates/2, [x, i])

      # Slots 0 and 1 are x and i, slot 2 the constant 1 cast to f32 (folded). Without
      # the reuse: 10 instructions (a second subtract for `x - 1`, three casts of i).
      assert Emily.to_list(one) == [1.0]
      assert Emily.dtype(one) == {:f, 32}

      assert instrs == [
               {:subtract, [0, 2]},
               {:multiply, [3, 3]},
               {:astype, [1, {:f, 32}]},
               {:add, [4, 5]},
               {:add, [0, 5]},
               {:multiply, [7, 5]}
             ]

      assert outputs == [6, 8]
      check_paths(&duplicates/2, [x, i])
    end

    test "a view of a view is one view, none where transposes cancel" do
      x = O.tensor({2, 3, 4}, {:f, 32})
      {instrs, 1, outputs, [], _} = Emily.Compiler.Native.instructions_of(&views/1, [x])

      # The exp's input is x (its transposes cancel); the other two transposes are their
      # composition; the reshapes one reshape of x. Nothing else is left.
      assert instrs == [
               {:exp, [0]},
               {:transpose, [0, [1, 2, 0]]},
               {:reshape, [0, {24}]}
             ]

      assert outputs == [1, 2, 3]
      check_paths(&views/1, [x])
    end

    test "a predicate is cast to u8 only where a result is" do
      x = O.tensor({3, 4}, {:s, 32})
      y = O.tensor({3, 4}, {:s, 32})

      {instrs, 4, outputs, [_two, _zero], _} =
        Emily.Compiler.Native.instructions_of(&stop_test/2, [x, y])

      # `any`, `logical_or` and `all` read MLX's bools; the one cast is the u8 output's.
      # Without it: a cast to u8 after each comparison and reduction, and back to bool
      # before each logical op (3 casts more).
      assert instrs == [
               {:equal, [0, 1]},
               {:any, [4, [1], false]},
               {:slice, [0, [0, 0], [3, 1], [1, 1]]},
               {:squeeze, [6, [1]]},
               {:greater, [7, 2]},
               {:logical_or, [5, 8]},
               {:where, [9, 7, 3]},
               {:all, [5, [0], false]},
               {:astype, [11, {:u, 8}]}
             ]

      assert outputs == [10, 12]
      check_paths(&stop_test/2, [x, y])
    end

    test "what reads no input is computed once, at lowering" do
      x = O.tensor({4, 4}, {:f, 32})
      {instrs, inputs, outputs, consts, _} = Emily.Compiler.Native.instructions_of(&masked/1, [x])

      # The mask (two iotas, a comparison, their casts) and the scalars are inputs now.
      ops = Enum.map(instrs, &elem(&1, 0))
      refute Enum.any?(ops, &(&1 in [:arange, :full, :greater_equal]))
      assert inputs == 1 + length(consts)

      # The iota outputs read the folded values directly.
      assert Enum.count(outputs, &(&1 in 1..length(consts))) == 2
      check_paths(&masked/1, [x])
    end

    defn(big_constant(x), do: x + Nx.iota({512, 1024}, axis: 1))

    test "a folded value over 1 MiB is computed on each run instead" do
      x = O.tensor({512, 1024}, {:f, 32})
      {instrs, inputs, _, consts, _} = Emily.Compiler.Native.instructions_of(&big_constant/1, [x])

      # The 2 MiB broadcast (and the cast after it) stays in the program; the 4 KiB row
      # it broadcasts is folded.
      assert Enum.map(instrs, &elem(&1, 0)) == [:broadcast_to, :astype, :add]
      assert inputs == 2
      assert [row] = consts
      assert Emily.shape(row) == {1, 1024}

      # Exact: each sum is one f32 rounding on every path (the whole tensor is too large
      # for check_paths' element-wise report).
      expected =
        Nx.add(Nx.backend_copy(x, Nx.BinaryBackend), Nx.iota({512, 1024}, axis: 1))
        |> Nx.to_binary()

      for out <- native_results(&big_constant/1, [x]), do: assert(Nx.to_binary(out) == expected)
    end

    test "lowers once and replays per run with new inputs" do
      compiled =
        Nx.Defn.compile(&softmax/1, [Nx.template({2, 3}, {:f, 32})],
          compiler: Emily.Compiler,
          native: true
        )

      for _ <- 1..3 do
        x = O.tensor({2, 3}, {:f, 32})
        assert_same(compiled.(x), Nx.with_default_backend(Nx.BinaryBackend, fn -> softmax(x) end))
      end
    end

    test "jit traces (and lowers) once per input shape and type, unless cache: false" do
      pid = self()

      # Runs at trace time only: one :traced message per trace.
      fun = fn x ->
        send(pid, :traced)
        Nx.multiply(Nx.add(x, 1), 2)
      end

      # The native path, and the evaluator path.
      for path <- [[], [native: false]] do
        cached = ejit(fun, path)
        assert Nx.to_flat_list(cached.(Nx.tensor([1.0, 2.0]))) == [4.0, 6.0]
        assert Nx.to_flat_list(cached.(Nx.tensor([3.0, 4.0]))) == [8.0, 10.0]
        assert traces() == 1

        assert Nx.to_flat_list(cached.(Nx.tensor([1.0, 2.0, 3.0]))) == [4.0, 6.0, 8.0]
        assert Nx.to_flat_list(cached.(Nx.tensor([1, 2], type: :s32))) == [4, 6]
        assert traces() == 2

        uncached = ejit(fun, path ++ [cache: false])
        assert Nx.to_flat_list(uncached.(Nx.tensor([1.0, 2.0]))) == [4.0, 6.0]
        assert Nx.to_flat_list(uncached.(Nx.tensor([0.0, 0.5]))) == [2.0, 3.0]
        assert traces() == 2
      end
    end

    test "the program cache stays bounded when fresh closures are jitted in a loop" do
      # Each closure captures another value, so each is a new cache key.
      for c <- 1..600 do
        f = ejit(fn x -> Nx.add(x, c) end, native: true)
        assert Nx.to_flat_list(f.(Nx.tensor([1.0]))) == [1.0 + c]
        assert :ets.info(Emily.Compiler.Cache, :size) <= 512
      end
    end

    test "a kept graph or program does not keep the stream that ran it alive" do
      busy = fn ->
        %{started: started, idle: idle} = Emily.Stream.thread_stats(:cpu)
        started - idle
      end

      before = busy.()

      # Both paths, on a fresh stream each, in a process whose results die with it.
      Task.async(fn ->
        for path <- [[], [native: false]] do
          s = Emily.Stream.new(:cpu)

          assert Nx.to_flat_list(ejit(&softmax/1, [stream: s] ++ path).(Nx.tensor([0.0, 0.0]))) ==
                   [0.5, 0.5]
        end
      end)
      |> Task.await()

      # Once the streams are garbage, their worker threads go back to the idle pool
      # (before, the cache's keys held the stream handles).
      assert Enum.any?(1..100, fn _ ->
               :erlang.garbage_collect()
               Process.sleep(20)
               busy.() <= before
             end)
    end

    defp traces do
      receive do
        :traced -> 1 + traces()
      after
        0 -> 0
      end
    end

    test "a while whose condition reads an input runs on the host, each part one program" do
      x = Nx.tensor([1.0, 2.0])
      # acc -> 2 acc + 1 until no element is below 100: six passes.
      for out <- native_results(&grow/1, [x]), do: assert(Nx.to_flat_list(out) == [127.0, 191.0])
      # No pass at all; loops in turn, the second's state from the first's result; a loop
      # in a loop's body; the inputs and the loops' results used after them.
      check_paths(&grow/1, [Nx.tensor([200.0, 300.0])])

      for x <- [Nx.tensor([0.5, -1.0, 2.0]), Nx.tensor([3.0, 4.0, 5.0])] do
        check_paths(&host_loops/2, [x, Nx.tensor(3)])
      end
    end

    test "a host loop queues its next pass before it reads the condition, unless overlap: false" do
      # (Under :debug_detect_nan_inf the loop falls back: no plan.)
      unless Emily.Debug.detect_nan_inf?() do
        for {opts, step} <- [{[], :queued}, {[overlap: false], :fused}],
            x <- [Nx.tensor([1.0, 2.0]), Nx.tensor([200.0, 300.0])] do
          jit = ejit(&grow/1, opts)
          assert {:loop, _, _, queued, _} = plan_of(jit, [x])
          assert elem(queued, 0) == step and match?({:pass, _, _, _}, elem(queued, 1))
          # The pass queued after the last (and, for no pass at all, the only one) is
          # dropped: the result is the state the condition stopped at.
          expected = if x == Nx.tensor([1.0, 2.0]), do: [127.0, 191.0], else: [200.0, 300.0]
          assert Nx.to_flat_list(jit.(x)) == expected
        end

        for x <- [Nx.tensor([0.5, -1.0, 2.0]), Nx.tensor([3.0, 4.0, 5.0])] do
          assert_same(
            ejit(&host_loops/2, overlap: false).(x, Nx.tensor(3)),
            ejit(&host_loops/2).(x, Nx.tensor(3))
          )
        end
      end
    end

    test "a queued pass releases the state nothing after the loop reads, and the loop ends right" do
      # (Under :debug_detect_nan_inf the loop falls back: no plan.)
      unless Emily.Debug.detect_nan_inf?() do
        # Six passes, one, none: the buffer and the counter are released state (the
        # result reads the accumulator only); the state the loop ends with is whole.
        for x <- [Nx.tensor([1.0, 2.0]), Nx.tensor([40.0, 50.0]), Nx.tensor([200.0, 300.0])] do
          jit = ejit(&filled_cache/1)
          assert {:loop, _, _, {:queued, {:pass, _, _, _}, [0, 2]}, _} = plan_of(jit, [x])
          check_paths(&filled_cache/1, [x])
          assert_same(jit.(x), ejit(&filled_cache/1, overlap: false).(x))
        end

        # A loop whose whole state is read after it releases nothing.
        assert {:loop, _, _, {:queued, _, []}, _} =
                 plan_of(ejit(&grow/1), [Nx.tensor([1.0, 2.0])])
      end
    end

    test "a conditional whose branch a program cannot hold runs on the host, one branch" do
      # A loop that reads the input; linear algebra guarded by the determinant (a
      # singular matrix makes LAPACK's solve raise: the branch must not run).
      for x <- [Nx.tensor([1.0, 2.0]), Nx.tensor([-1.0, -2.0])],
          do: check_paths(&grow_if_positive/1, [x])

      singular3 = Nx.tensor([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [0.0, 1.0, 1.0]])
      singular4 = Nx.tensor([[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
      regular = Nx.add(Nx.eye(4), Nx.iota({4, 4}, type: :f32) |> Nx.divide(40))

      # (:debug_detect_nan_inf raises on reading back a singular matrix's NaN inverse.)
      matrices =
        if Emily.Debug.detect_nan_inf?(),
          do: [regular],
          else: [singular3, singular4, regular]

      for a <- matrices do
        expected = ejit(&Nx.LinAlg.invert/1, native: false, device: :cpu).(a)
        jit = ejit(&Nx.LinAlg.invert/1, device: :cpu)
        {out, fallbacks} = with_fallbacks(fn -> jit.(a) end)
        assert debug_fallbacks?(fallbacks)
        assert_same(out, expected, tol: {1.0e-6, 1.0e-6})
        if fallbacks == [], do: assert(host_conds(plan_of(jit, [a])) == 1)
      end
    end

    test "such a branch inside an unrolled loop falls back with telemetry and still computes" do
      x = Nx.tensor([1.0, 2.0])
      {out, fallbacks} = with_fallbacks(fn -> ejit(&grow_twice_if_positive/1).(x) end)
      assert [%{reason: reason}] = fallbacks
      assert reason == {:while, :condition_reads_input} or debug_fallbacks?(fallbacks)
      assert Nx.to_flat_list(out) == [127.0, 191.0]
    end

    test "a conditional whose branches a program holds stays in it, both computed" do
      for x <- [Nx.tensor([1.0, 2.0]), Nx.tensor([-1.0, -2.0])] do
        check_paths(&branchy/1, [x])

        unless Emily.Debug.detect_nan_inf?(),
          do: assert({:program, _, _} = plan_of(ejit(&branchy/1), [x]))
      end
    end

    test "a while longer than the lowering unrolls runs on the host" do
      for compile <- [false, true] do
        jit = ejit(&count_to/1, native: true, compile: compile)
        {out, fallbacks} = with_fallbacks(fn -> jit.(1) end)
        assert debug_fallbacks?(fallbacks)
        assert Nx.to_number(out) == 2001
        # (Under :debug_detect_nan_inf, whose checks run per op, host steps fall back.)
        if fallbacks == [], do: assert({:loop, _, _, _, _} = plan_of(jit, [1]))
      end

      x = Nx.tensor([0.5, -1.0, 2.0])
      check_paths(&long_body/1, [x], tol: {1.0e-5, 1.0e-5})

      unless Emily.Debug.detect_nan_inf?(),
        do: assert({:loop, _, _, _, _} = plan_of(ejit(&long_body/1, native: true), [x]))
    end

    test "a loop too long to unroll inside an unrolled one falls back" do
      x = Nx.tensor([0.5, -1.0])
      {out, fallbacks} = with_fallbacks(fn -> ejit(&long_in_short/1, native: true).(x) end)
      assert [%{reason: {:while, {:unrolls_beyond, 1024, 4096}}}] = fallbacks

      assert_same(out, oracle_jit(&long_in_short/1, [x]), tol: {1.0e-5, 1.0e-5})
    end

    # The plan a native jit function runs for `args` (a second call finds it in the
    # cache, and leaves it in the process's dictionary).
    defp plan_of(jit, args) do
      apply(jit, args)
      apply(jit, args)
      {_key, {:ok, {plan, _template, _checks, _read}}} = Process.get({Emily.Compiler, :last_used})
      plan
    end

    test "float to integer as_type: truncation, NaN to 0, infinities to the type's limits" do
      x = Nx.tensor([0.4, -1.5, 2.0, 30.7, :nan, :infinity, :neg_infinity])
      check_paths(&truncations/1, [x])
      z = Nx.complex(Nx.tensor([0.4, -1.5, 2.0, 300.7]), Nx.tensor([1.0, -2.0, 0.5, 3.0]))
      check_paths(&from_complex/1, [z])
      [s32 | _] = Tuple.to_list(hd(native_results(&truncations/1, [x])))
      assert Nx.to_flat_list(s32) == [1, -4, 6, 92, 0, 2_147_483_647, -2_147_483_648]
    end

    test "results count toward their process's collection: jit runs, and eager ops alike" do
      mib = 1024 * 1024
      x = Nx.iota({mib}, type: :f32, backend: Emily.Backend)
      # One result, and a tuple of two (4 MiB and 4 bytes), taken in turns.
      f = ejit(&Nx.add(&1, 1.0))
      g = ejit(&{Nx.add(&1, 2.0), Nx.sum(&1)})
      previous = Emily.Memory.set_collect_after(8 * mib)
      parent = self()
      id = "emily-collect-#{System.unique_integer()}"
      handler = fn _, %{bytes: bytes}, _, _ -> send(parent, {:collected, self(), bytes}) end
      :telemetry.attach(id, [:emily, :memory, :collect], handler, nil)

      try do
        before = Emily.Memory.stats().active

        # Sixteen runs, each dropped at once, in a process whose heap the BEAM would not
        # collect meanwhile: each run after 8 MiB of results collects first.
        child =
          Process.spawn(
            fn ->
              for _ <- 1..8, do: {f.(x), g.(x)}
              send(parent, {:grown, Emily.Memory.stats().active - before})
            end,
            [:link, min_heap_size: 2_000_000]
          )

        assert_receive {:grown, grown}, 10_000
        # The last two results, and frees still queued to the stream.
        assert grown <= 20 * mib
        for _ <- 1..7, do: assert_receive({:collected, ^child, bytes} when bytes == 8 * mib + 4)
        refute_received {:collected, ^child, _}

        # Emily.Backend's results, 4 MiB each: from the third op on, every other op
        # collects first.
        child =
          Process.spawn(
            fn ->
              for _ <- 1..16, do: Nx.add(x, 1.0)
              send(parent, :done)
            end,
            [:link, min_heap_size: 2_000_000]
          )

        assert_receive :done, 10_000
        for _ <- 1..7, do: assert_receive({:collected, ^child, bytes} when bytes == 8 * mib)
        refute_received {:collected, ^child, _}
      after
        :telemetry.detach(id)
        Emily.Memory.set_collect_after(previous)
      end
    end

    test "the native path is the default; native: false takes the evaluator path" do
      x = Nx.tensor([1.0, 2.0])
      assert {:program, _, _} = plan_of(ejit(&powers/1), [x])

      # A graph the native path does not lower: tried (and declined) by default, not
      # with native: false.
      assert {_, [%{reason: {:reduce, :function}}]} =
               with_fallbacks(fn -> ejit(&other_fold/1).(Nx.tensor([1, 2])) end)

      {out, fallbacks} =
        with_fallbacks(fn -> ejit(&other_fold/1, native: false).(Nx.tensor([1, 2])) end)

      assert fallbacks == []
      assert Nx.to_number(out) == 4
    end
  end
else
  defmodule Emily.Nx.CompilerNativeTest do
    use ExUnit.Case, async: true
    @moduletag :nx
    require Emily.NxAbsent
    Emily.NxAbsent.placeholders()
  end
end
