# Emily.Quantization and Emily.QuantizedWeight: MLX's kernels on Emily (eagerly and
# through Emily.Compiler's evaluator and native paths) against the blocks' default
# implementations on Nx.BinaryBackend, the accuracy the module documentation states,
# the weight as an Nx.Container, and the argument errors.
if Code.ensure_loaded?(Nx) do
  defmodule Emily.Nx.QuantizationTest do
    use ExUnit.Case, async: false
    @moduletag :nx

    import Emily.NxCompiler
    alias Emily.Quantization, as: Q
    alias Emily.QuantizedWeight, as: QW

    doctest Emily.Quantization
    doctest Emily.QuantizedWeight

    setup do
      Nx.default_backend(Emily.Backend)
      :ok
    end

    @combos for(b <- [2, 3, 4, 5, 6, 8], g <- [32, 64, 128], do: {:affine, b, g}) ++
              [{:mxfp4, 4, 32}, {:nvfp4, 4, 16}, {:mxfp8, 8, 32}]

    defp normal(shape, seed, type \\ :f32) do
      {t, _} = Nx.Random.normal(Nx.Random.key(seed), 0.0, 1.0, shape: shape, type: :f32)
      Nx.as_type(t, type)
    end

    defp binary(x), do: Nx.backend_copy(x, Nx.BinaryBackend)

    # The blocks' defaults create their constants on the default backend.
    defp on_binary(fun), do: Nx.with_default_backend(Nx.BinaryBackend, fun)
    defp flat(x), do: x |> binary() |> Nx.to_flat_list()
    defp max_abs(t), do: t |> Nx.abs() |> Nx.reduce_max() |> Nx.to_number()

    defp quantize(w, {mode, bits, gs}, opts \\ []),
      do: Q.quantize(w, [mode: mode, bits: bits, group_size: gs] ++ opts)

    # The largest |y - ref| over Σ|x||w|, elementwise: rounding relative to the sizes of
    # the products summed.
    defp rounding_ratio(y, x, dw, transpose \\ true) do
      x = Nx.as_type(x, :f32)
      dw = if transpose, do: Nx.transpose(dw), else: dw
      ref = Nx.dot(x, dw)
      bound = Nx.dot(Nx.abs(x), Nx.abs(dw))
      diff = Nx.abs(Nx.subtract(Nx.as_type(y, :f32), ref))
      diff |> Nx.divide(Nx.max(bound, 1.0e-30)) |> Nx.reduce_max() |> Nx.to_number()
    end

    # The bounds the module documentation states for quantized_matmul against the f32
    # matmul of the dequantized weight. On a GPU, f32 matmuls are TF32.
    defp stated_ratio({:f, 32}),
      do: if(Emily.default_device() == :gpu, do: 2.0 ** -10, else: 2.0 ** -20)

    defp stated_ratio({:bf, 16}), do: 2.0 ** -5
    defp stated_ratio({:f, 16}), do: 2.0 ** -8

    describe "quantize and dequantize" do
      test "the packed layout: codes, scales and biases of each mode, bits and group size" do
        w = normal({4, 256}, 1)

        for {mode, bits, gs} = combo <- @combos do
          qw = quantize(w, combo)
          assert %QW{mode: ^mode, bits: ^bits, group_size: ^gs, shape: {4, 256}} = qw
          assert qw.type == {:f, 32}
          assert qw.value.type == {:u, 32}
          assert qw.value.shape == {4, div(256 * bits, 32)}
          assert qw.scales.shape == {4, div(256, gs)}

          if mode == :affine do
            assert {qw.scales.type, qw.biases.shape} == {{:f, 32}, {4, div(256, gs)}}
          else
            assert {qw.scales.type, qw.biases} == {{:u, 8}, nil}
          end
        end
      end

      # Affine: one step (range / (2^bits - 1)) per group, MLX snapping zero onto the
      # grid; fp4: amax / 4; fp8: amax / 16 (amax: the group's largest magnitude).
      test "round trips within the stated bound of each mode" do
        w = normal({8, 256}, 2)
        groups = fn t, gs -> t |> flat() |> Enum.chunk_every(gs) end

        for {mode, bits, gs} = combo <- @combos do
          back = w |> quantize(combo) |> Q.dequantize()

          for {wg, dg} <- Enum.zip(groups.(w, gs), groups.(back, gs)) do
            err = Enum.zip_with(wg, dg, &abs(&1 - &2)) |> Enum.max()
            amax = wg |> Enum.map(&abs/1) |> Enum.max()

            bound =
              case mode do
                :affine -> (Enum.max(wg) - Enum.min(wg)) / (2 ** bits - 1) * 1.0001
                :mxfp8 -> amax / 16
                _ -> amax / 4
              end

            assert err <= bound + 1.0e-6, "#{inspect(combo)}: #{err} > #{bound}"
          end
        end
      end

      test "the Nx implementation on Nx.BinaryBackend unpacks exactly what MLX does" do
        for type <- [:f32, :bf16, :f16], {_, _, _} = combo <- @combos do
          w = normal({3, 2, 128}, 3, type)
          qw = quantize(w, combo)
          native = Q.dequantize(qw)
          default = on_binary(fn -> qw |> binary() |> Q.dequantize() end)
          assert %Nx.BinaryBackend{} = default.data
          assert native.type == Nx.Type.normalize!(type)

          # Nx.BinaryBackend rounds to bf16 by truncation, MLX to nearest: code * scale
          # and + bias each a bf16 step apart at most (the fp modes' values are exact).
          if type == :bf16 and elem(combo, 0) == :affine do
            diff = Nx.subtract(Nx.as_type(binary(native), :f32), Nx.as_type(default, :f32))
            assert max_abs(diff) <= 2.0 ** -6 * max_abs(Nx.as_type(w, :f32)), inspect(combo)
          else
            assert flat(native) == flat(default), "#{type} #{inspect(combo)}"
          end

          # and to another type
          assert flat(Q.dequantize(qw, type: :f32)) ==
                   flat(on_binary(fn -> Q.dequantize(binary(qw), type: :f32) end))
        end
      end

      test "nvfp4's global scale keeps small weights, on Emily and in Nx" do
        w = Nx.multiply(normal({2, 64}, 4), 1.0e-5)
        plain = quantize(w, {:nvfp4, 4, 16})
        assert max_abs(Q.dequantize(plain)) == 0.0

        qw = quantize(w, {:nvfp4, 4, 16}, global_scale: true)
        assert Nx.to_number(qw.global_scale) == max_abs(w)
        back = Q.dequantize(qw)
        assert max_abs(Nx.subtract(back, w)) <= max_abs(w) / 4
        assert flat(back) == flat(Q.dequantize(binary(qw)))
        # a given scale is used as given
        assert Nx.to_number(quantize(w, {:nvfp4, 4, 16}, global_scale: 0.5).global_scale) == 0.5
      end

      test "a weight on another backend is quantized by MLX and stays on its backend" do
        w = normal({2, 64}, 5)
        qw = w |> binary() |> Q.quantize(bits: 4, group_size: 32)
        assert %Nx.BinaryBackend{} = qw.value.data
        assert %Nx.BinaryBackend{} = qw.biases.data
        assert flat(qw.value) == flat(Q.quantize(w, bits: 4, group_size: 32).value)
      end

      test "take gathers packed rows, then dequantizes them" do
        table = normal({10, 64}, 6)
        qw = Q.quantize(table, bits: 6, group_size: 32)
        idx = Nx.tensor([[3, 0], [9, 3]])
        rows = Q.take(qw, idx)
        assert rows.shape == {2, 2, 64}
        assert flat(rows) == flat(Nx.take(Q.dequantize(qw), idx, axis: 0))
        assert flat(Q.take(binary(qw), binary(idx))) == flat(rows)

        jitted = ejit(&Q.take/2, native: true).(qw, idx)
        assert flat(jitted) == flat(rows)
      end
    end

    describe "quantized_matmul" do
      test "within the stated bound of the f32 matmul of the dequantized weight" do
        for type <- [{:f, 32}, {:bf, 16}, {:f, 16}], combo <- @combos do
          qw = quantize(normal({64, 256}, 7, type), combo)
          x = normal({5, 256}, 8, type)
          y = Q.quantized_matmul(x, qw)
          assert {y.shape, y.type} == {{5, 64}, type}
          ratio = rounding_ratio(y, x, Q.dequantize(qw, type: :f32))

          assert ratio <= stated_ratio(type),
                 "#{inspect(type)} #{inspect(combo)}: #{ratio} > #{stated_ratio(type)}"

          # the default (dequantize, then Nx.dot) on another backend, the same bound
          y_default = on_binary(fn -> Q.quantized_matmul(binary(x), binary(qw)) end)
          assert %Nx.BinaryBackend{} = y_default.data
          assert rounding_ratio(y_default, x, Q.dequantize(qw, type: :f32)) <= stated_ratio(type)
        end
      end

      test "transpose: false multiplies by the {k, n} weight quantized along n" do
        w = normal({128, 64}, 9)
        x = normal({2, 3, 128}, 10)

        for combo <- [{:affine, 4, 64}, {:affine, 3, 32}, {:mxfp4, 4, 32}] do
          qw = quantize(w, combo)
          y = Q.quantized_matmul(x, qw, transpose: false)
          assert y.shape == {2, 3, 64}
          dw = Q.dequantize(qw)

          assert rounding_ratio(Nx.reshape(y, {6, 64}), Nx.reshape(x, {6, 128}), dw, false) <=
                   stated_ratio({:f, 32})

          y_default = Q.quantized_matmul(binary(x), binary(qw), transpose: false)

          assert_in_delta max_abs(Nx.subtract(y, Nx.backend_copy(y_default, Emily.Backend))),
                          0,
                          1.0e-4
        end
      end

      test "mixed types: the result is x's and the weight's floating type merged" do
        qw = Q.quantize(normal({32, 64}, 11, :bf16), bits: 8, group_size: 32)
        assert Q.quantized_matmul(normal({1, 64}, 12), qw).type == {:f, 32}
        assert Q.quantized_matmul(Nx.iota({1, 64}), qw).type == {:bf, 16}
        assert Q.quantized_matmul(normal({1, 64}, 12, :f64), qw).type == {:f, 64}
      end

      test "Emily.Compiler runs MLX's kernels on the native and evaluator paths" do
        qw = Q.quantize(normal({64, 128}, 13), bits: 4, group_size: 64)
        x = normal({4, 128}, 14)
        fun = fn x, qw -> Nx.add(Q.quantized_matmul(x, qw), Nx.sum(Q.dequantize_defn(qw))) end
        eager = fun.(x, qw)

        # MLX's kernel and dequantize-then-dot round differently; the same kernel gives
        # the same bits.
        for out <- native_results(fun, [x, qw]), do: assert(flat(out) == flat(eager))
        assert flat(ejit(fun, native: false).(x, qw)) == flat(eager)

        # nvfp4 with a global scale has no MLX kernel: its default lowers natively.
        qg = quantize(normal({64, 128}, 15), {:nvfp4, 4, 16}, global_scale: true)
        [native | _] = native_results(&Q.quantized_matmul/2, [x, qg])
        expected = Nx.dot(x, Nx.transpose(Q.dequantize(qg)))
        assert max_abs(Nx.subtract(native, expected)) <= 1.0e-4
      end

      test "the gradient with respect to x is the dequantized weight's" do
        qw = Q.quantize(normal({16, 64}, 16), bits: 8, group_size: 32)
        x = normal({2, 64}, 17)
        grad = ejit(fn x, qw -> Nx.Defn.grad(x, &Nx.sum(Q.quantized_matmul(&1, qw))) end)
        expected = Q.dequantize(qw) |> Nx.sum(axes: [0]) |> Nx.broadcast({2, 64})
        assert max_abs(Nx.subtract(grad.(x, qw), expected)) <= 1.0e-5
      end
    end

    describe "Emily.QuantizedWeight as a container" do
      test "passes through defn, jit, backend_transfer and serialization" do
        qw = Q.quantize(normal({8, 64}, 18), mode: :mxfp8)
        same = ejit(fn qw -> qw end).(qw)
        assert %QW{mode: :mxfp8, bits: 8, group_size: 32, shape: {8, 64}} = same
        assert flat(same.value) == flat(qw.value)

        moved = Nx.backend_transfer(Nx.backend_copy(qw), Nx.BinaryBackend)
        assert %Nx.BinaryBackend{} = moved.value.data
        assert %Nx.BinaryBackend{} = moved.scales.data
        back = Nx.backend_transfer(moved, Emily.Backend)
        assert flat(Q.dequantize(back)) == flat(Q.dequantize(qw))

        restored = qw |> Nx.serialize() |> Nx.deserialize()
        assert %QW{mode: :mxfp8, biases: nil} = restored
        assert flat(restored.value) == flat(qw.value)

        assert QW.byte_size(qw) == 8 * 16 * 4 + 8 * 2
        assert Nx.Defn.Composite.count(Q.quantize(normal({8, 64}, 18))) == 3
      end

      test "serves through Nx.Serving with batches" do
        qw = Q.quantize(normal({16, 64}, 19), bits: 4, group_size: 32)
        x = normal({3, 64}, 20)

        serving =
          Nx.Serving.new(
            fn opts ->
              fun = Nx.Defn.jit(&Q.quantized_matmul/2, opts)
              fn batch -> fun.(batch, qw) end
            end,
            compiler: Emily.Compiler
          )

        out = Nx.Serving.run(serving, Nx.Batch.concatenate([x]))
        assert flat(out) == flat(Q.quantized_matmul(x, qw))
      end

      test "inspect says what it is, inside defn too" do
        qw = Q.quantize(normal({4, 64}, 21), mode: :nvfp4, global_scale: true)

        assert inspect(qw) ==
                 "#Emily.QuantizedWeight<nvfp4 4-bit group 16 f32[4][64] packed u32[4][8] global_scale>"

        traced =
          Nx.Defn.debug_expr(fn qw -> send(self(), {:traced, inspect(qw)}) && qw.value end).(qw)

        assert %Nx.Tensor{} = traced
        assert_received {:traced, "#Emily.QuantizedWeight<nvfp4 4-bit group 16 f32[4][64]" <> _}
      end
    end

    describe "argument errors" do
      test "bad modes, bits, group sizes, types and shapes raise ArgumentError at the call" do
        w = normal({2, 64}, 22)

        cases = [
          {~r/mode :affine takes bits 2, 3, 4, 5, 6, 8, got 7/, fn -> Q.quantize(w, bits: 7) end},
          {~r/takes group sizes 32, 64, 128, got 48/, fn -> Q.quantize(w, group_size: 48) end},
          {~r/mode :mxfp4 takes group sizes 32, got 16/,
           fn -> Q.quantize(w, mode: :mxfp4, group_size: 16) end},
          {~r/mode :mxfp8 takes bits 8, got 4/, fn -> Q.quantize(w, mode: :mxfp8, bits: 4) end},
          {~r/unknown mode :int4/, fn -> Q.quantize(w, mode: :int4) end},
          {~r/group size 128 does not divide the last axis of \{2, 64\}/,
           fn -> Q.quantize(w, group_size: 128) end},
          {~r/expected an f16, bf16 or f32 tensor, got \{:s, 32\}/,
           fn -> Q.quantize(Nx.iota({2, 64})) end},
          {~r/expected an f16, bf16 or f32 tensor, got \{:f, 64\}/,
           fn -> Q.quantize(Nx.as_type(w, :f64)) end},
          {~r/rank 2 or more, got shape \{64\}/, fn -> Q.quantize(Nx.iota({64}, type: :f32)) end},
          {~r/:global_scale applies to mode :nvfp4 only/,
           fn -> Q.quantize(w, global_scale: true) end},
          {~r/unknown keys \[:bit\]/, fn -> Q.quantize(w, bit: 4) end},
          {~r/expected a tensor/, fn -> Q.quantize([1.0]) end},
          {~r/cannot run inside defn/, fn -> ejit(&Q.quantize/1).(w) end},
          {~r/dequantize: expected an Emily.QuantizedWeight/, fn -> Q.dequantize(w) end},
          {~r/expected a floating-point type, got \{:s, 32\}/,
           fn -> Q.dequantize(Q.quantize(w), type: :s32) end},
          {~r/x's last axis \(32 in \{1, 32\}\) does not match the weight's contracted axis \(64/,
           fn -> Q.quantized_matmul(Nx.iota({1, 32}, type: :f32), Q.quantize(w)) end},
          {~r/contracted axis \(2 in \{2, 64\}, transpose: false\)/,
           fn -> Q.quantized_matmul(normal({1, 64}, 1), Q.quantize(w), transpose: false) end},
          {~r/quantized matrix \(rank 2\)/,
           fn -> Q.quantized_matmul(normal({1, 64}, 1), Q.quantize(normal({2, 2, 64}, 1))) end},
          {~r/take: expected integer indices/, fn -> Q.take(Q.quantize(w), Nx.tensor([0.5])) end}
        ]

        for {pattern, fun} <- cases do
          e = assert_raise ArgumentError, fun
          assert e.message =~ pattern, e.message
        end
      end
    end

    describe "accuracy against the float weight" do
      # The table in the module documentation: ||x·ŵᵀ - x·wᵀ|| / ||x·wᵀ|| for N(0, 1)
      # weights {256, 512} and inputs {8, 512}, seed 42.
      @relative %{
        {:affine, 2} => 0.45,
        {:affine, 3} => 0.22,
        {:affine, 4} => 0.11,
        {:affine, 5} => 0.055,
        {:affine, 6} => 0.027,
        {:affine, 8} => 0.007,
        {:mxfp4, 4} => 0.13,
        {:nvfp4, 4} => 0.11,
        {:mxfp8, 8} => 0.03
      }

      test "the relative error of each mode and bits is within the stated table" do
        key = Nx.Random.key(42)
        {w, key} = Nx.Random.normal(key, 0.0, 1.0, shape: {256, 512}, type: :f32)
        {x, _} = Nx.Random.normal(key, 0.0, 1.0, shape: {8, 512}, type: :f32)
        exact = Nx.dot(x, Nx.transpose(w))

        for {mode, bits, _} = combo <- @combos do
          y = Q.quantized_matmul(x, quantize(w, combo))
          rel = Nx.LinAlg.norm(Nx.subtract(y, exact)) |> Nx.divide(Nx.LinAlg.norm(exact))
          rel = Nx.to_number(rel)
          stated = Map.fetch!(@relative, {mode, bits})
          assert rel <= stated, "#{inspect(combo)}: #{rel} > #{stated}"
          # and the table is not slack
          assert rel > stated / 3, "#{inspect(combo)}: #{rel} is far below #{stated}"
        end
      end
    end
  end
else
  defmodule Emily.Nx.QuantizationTest do
    use ExUnit.Case, async: true
    @moduletag :nx
    require Emily.NxAbsent
    Emily.NxAbsent.placeholders()
  end
end
