# Emily.Compiler's fusion rewrites (Emily.Compiler.Native.Fusion): RMS norm, layer norm,
# attention, gelu, silu, dense and the cache's repeated update written as Bumblebee's and
# Axon's layers write them, compiled with the rewrites and without (`fuse: false`) on
# random inputs, within the fused kernels' tolerance, with the listing (`Emily.Compiler.fusions/3`) and the telemetry naming what
# fired; and the near misses that must not be rewritten (epsilon elsewhere, another axis
# or divisor, a lossy cast, a mask that replaces scores, a softmax over another axis).
if Code.ensure_loaded?(Nx) do
  defmodule Emily.Nx.FusionTest do
    use ExUnit.Case, async: false
    @moduletag :nx

    import Nx.Defn

    ## The graphs, as the libraries build them

    # Bumblebee's RMS norm, `upcast: :normalization`: the statistics in f32, the
    # normalized value cast back to the input's type, times `shift + weight`.
    defn bb_rms(x, w, opts \\ []) do
      opts = keyword!(opts, eps: 1.0e-6, shift: 0.0)
      xf = Nx.as_type(x, :f32)
      ms = xf |> Nx.pow(2) |> Nx.mean(axes: [-1], keep_axes: true)
      normalized = Nx.as_type(xf * Nx.rsqrt(ms + opts[:eps]), Nx.type(x))
      normalized * (opts[:shift] + w)
    end

    # Bumblebee's RMS norm, `upcast: :all`: input and weight in f32, an f32 result.
    defn bb_rms_all(x, w) do
      xf = Nx.as_type(x, :f32)
      wf = Nx.as_type(w, :f32)
      ms = xf |> Nx.pow(2) |> Nx.mean(axes: [-1], keep_axes: true)
      xf * Nx.rsqrt(ms + 1.0e-5) * wf
    end

    defn rms_plain(x) do
      x * Nx.rsqrt(Nx.mean(x * x, axes: [-1], keep_axes: true) + 1.0e-6)
    end

    # Not RMS norms as MLX computes them.
    defn rms_eps_outside(x, w) do
      ms = Nx.mean(Nx.pow(x, 2), axes: [-1], keep_axes: true)
      x / (Nx.sqrt(ms) + 1.0e-6) * w
    end

    defn rms_other_axis(x, w) do
      ms = Nx.mean(Nx.pow(x, 2), axes: [1], keep_axes: true)
      x * Nx.rsqrt(ms + 1.0e-6) * w
    end

    defn rms_other_divisor(x, w) do
      ms = Nx.sum(Nx.pow(x, 2), axes: [-1], keep_axes: true) / (Nx.axis_size(x, -1) - 1)
      x * Nx.rsqrt(ms + 1.0e-6) * w
    end

    # f32 statistics whose result is cast down to bf16 before a bf16 weight: a weighted
    # kernel in bf16 would see the input rounded to bf16.
    defn rms_lossy(x, w) do
      ms = Nx.mean(Nx.pow(x, 2), axes: [-1], keep_axes: true)
      Nx.as_type(x * Nx.rsqrt(ms + 1.0e-6), :bf16) * w
    end

    # Axon's layer norm: gamma and beta reshaped to `{1, ..., 1, H}`,
    # `gamma * rsqrt(var + eps) * (x - mean) + beta`.
    defn axon_ln(x, gamma, beta, opts \\ []) do
      opts = keyword!(opts, eps: 1.0e-5, ddof: 0)
      gamma = Nx.reshape(gamma, param_shape(x))
      beta = Nx.reshape(beta, param_shape(x))
      mean = Nx.mean(x, axes: [-1], keep_axes: true)
      var = Nx.variance(x, axes: [-1], keep_axes: true, ddof: opts[:ddof])
      scale = gamma * Nx.rsqrt(var + opts[:eps])
      scale * (x - mean) + beta
    end

    deftransformp param_shape(x) do
      rank = Nx.rank(x)
      List.to_tuple(List.duplicate(1, rank - 1) ++ [Nx.axis_size(x, -1)])
    end

    # The order MLX and Emily.Fast write it in, with or without weight and bias.
    defn ln_mlx_order(x, w, b) do
      c = x - Nx.mean(x, axes: [-1], keep_axes: true)
      var = Nx.mean(c * c, axes: [-1], keep_axes: true)
      c * Nx.rsqrt(var + 1.0e-6) * w + b
    end

    defn ln_no_affine(x) do
      c = x - Nx.mean(x, axes: [-1], keep_axes: true)
      c * Nx.rsqrt(Nx.mean(c * c, axes: [-1], keep_axes: true) + 1.0e-6)
    end

    defn ln_eps_outside(x, w, b) do
      c = x - Nx.mean(x, axes: [-1], keep_axes: true)
      var = Nx.mean(c * c, axes: [-1], keep_axes: true)
      c / (Nx.sqrt(var) + 1.0e-5) * w + b
    end

    # Bumblebee's attention (attention_weights_impl and attention_output_impl) on
    # `{B, L, heads, D}` projections: the key mask and the causal mask (from `offset`,
    # the cache position) as an additive bias of 0 and the type's lowest value, Axon's
    # softmax, and keys and values repeated over grouped heads as Bumblebee repeats them.
    defn bb_attention(q, k, v, key_mask, offset, opts \\ []) do
      opts = keyword!(opts, causal: true, groups: 1, scale: nil)
      k = repeat_heads(k, opts[:groups])
      v = repeat_heads(v, opts[:groups])
      q = Nx.transpose(q, axes: [0, 2, 1, 3])
      k = Nx.transpose(k, axes: [0, 2, 1, 3])
      weights = Nx.dot(q, [3], [0, 1], k, [3], [0, 1])
      weights = weights * attention_scale(q, opts[:scale])
      key_mask = key_mask |> Nx.new_axis(1) |> Nx.new_axis(1)
      causal = causal_mask(Nx.axis_size(q, 2), Nx.axis_size(k, 2), offset, opts[:causal])
      mask = key_mask and causal |> Nx.new_axis(0) |> Nx.new_axis(0)
      zero = Nx.tensor(0.0, type: Nx.type(q))
      bias = Nx.select(mask, zero, Nx.Constants.min_finite(Nx.type(q)))
      weights = axon_softmax(weights + bias)
      v = Nx.transpose(v, axes: [0, 2, 1, 3])
      out = Nx.dot(weights, [3], [0, 1], v, [2], [0, 1])
      Nx.transpose(out, axes: [0, 2, 1, 3])
    end

    deftransformp(attention_scale(q, nil),
      do: Nx.divide(1, Nx.as_type(Nx.sqrt(Nx.axis_size(q, -1)), Nx.type(q)))
    )

    deftransformp(attention_scale(_q, scale), do: scale)

    deftransformp causal_mask(lq, lk, offset, causal?) do
      if causal?,
        do: Nx.greater_equal(Nx.add(Nx.iota({lq, 1}), offset), Nx.iota({1, lk})),
        else: Nx.broadcast(1, {1, 1})
    end

    deftransformp(repeat_heads(x, 1), do: x)

    deftransformp repeat_heads(x, times) do
      x
      |> Nx.new_axis(3)
      |> Nx.tile([1, 1, 1, times, 1])
      |> Nx.flatten(axes: [2, 3])
    end

    # Bumblebee's append_attention_cache: the repeated keys written into the cache at
    # the offset.
    defn cache_repeated(cache, k, offset, opts \\ []) do
      opts = keyword!(opts, groups: 2)
      Nx.put_slice(cache, [0, offset, 0, 0], repeat_heads(k, opts[:groups]))
    end

    # Near misses: a cache of more heads than the update covers, and a repeat over
    # another axis.
    defn cache_partial(cache, k, offset) do
      Nx.put_slice(cache, [0, offset, 1, 0], repeat_heads(k, 2))
    end

    defn cache_repeated_rows(cache, k, offset) do
      r = k |> Nx.new_axis(2) |> Nx.tile([1, 1, 2, 1, 1]) |> Nx.flatten(axes: [1, 2])
      Nx.put_slice(cache, [0, offset, 0, 0], r)
    end

    defnp axon_softmax(x) do
      max = stop_grad(Nx.reduce_max(x, axes: [-1], keep_axes: true))
      e = Nx.exp(x - max)
      1 / Nx.sum(e, axes: [-1], keep_axes: true) * e
    end

    # Masks that replace the scores (select to -inf) rather than add to them; a softmax
    # over the query axis; a scale that is a tensor input.
    defn attention_select_mask(q, k, v, key_mask) do
      scores = heads_dot(q, k) * 0.5
      keep = Nx.broadcast(key_mask |> Nx.new_axis(1) |> Nx.new_axis(1), Nx.shape(scores))
      scores = Nx.select(keep, scores, Nx.Constants.neg_infinity(Nx.type(q)))
      attend(axon_softmax(scores), v)
    end

    defn attention_other_axis(q, k, v) do
      scores = heads_dot(q, k) * 0.5
      max = Nx.reduce_max(scores, axes: [2], keep_axes: true)
      e = Nx.exp(scores - max)
      attend(e / Nx.sum(e, axes: [2], keep_axes: true), v)
    end

    defn attention_tensor_scale(q, k, v, scale) do
      attend(axon_softmax(heads_dot(q, k) * scale), v)
    end

    defnp heads_dot(q, k) do
      Nx.dot(
        Nx.transpose(q, axes: [0, 2, 1, 3]),
        [3],
        [0, 1],
        Nx.transpose(k, axes: [0, 2, 1, 3]),
        [3],
        [0, 1]
      )
    end

    defnp attend(weights, v) do
      Nx.dot(weights, [3], [0, 1], Nx.transpose(v, axes: [0, 2, 1, 3]), [2], [0, 1])
    end

    # Bumblebee's apply_rotary_embedding (Layers.rotary_embedding): tables of
    # `max_positions` rows from the base (or given frequencies), their rows at
    # `position_ids`, a new axis, cast to the query's type; `x * cos + rotate_half(x) *
    # sin`. `gain` scales the tables (as longrope's do), which the kernel cannot compute.
    defn bb_rope(x, position_ids, opts \\ []) do
      opts = keyword!(opts, positions: 16, base: 10_000, factor: 1.0, gain: 1.0)
      size = Nx.axis_size(x, -1)
      range = Nx.iota({div(size, 2)}) |> Nx.multiply(2) |> Nx.divide(size)
      inv_frequency = 1.0 / Nx.pow(opts[:base], range) / opts[:factor]
      angle = Nx.outer(Nx.iota({opts[:positions]}), inv_frequency)
      angle = Nx.concatenate([angle, angle], axis: -1)
      {cos, sin} = {Nx.cos(angle) * opts[:gain], Nx.sin(angle) * opts[:gain]}
      position_ids = Nx.as_type(position_ids, :s64)
      cos = cos |> Nx.take(position_ids) |> Nx.new_axis(2) |> Nx.as_type(Nx.type(x))
      sin = sin |> Nx.take(position_ids) |> Nx.new_axis(2) |> Nx.as_type(Nx.type(x))
      x * cos + rotate_half(x) * sin
    end

    defnp rotate_half(x) do
      size = div(Nx.axis_size(x, -1), 2)
      x1 = x[[.., .., .., 0..(size - 1)//1]]
      x2 = x[[.., .., .., size..-1//1]]
      Nx.concatenate([-x2, x1], axis: -1)
    end

    # The other half negated: not a rotation MLX's kernel computes.
    defn rope_other_half(x, position_ids) do
      angle = Nx.outer(Nx.iota({16}), Nx.iota({div(Nx.axis_size(x, -1), 2)}) + 1.0)
      angle = Nx.concatenate([angle, angle], axis: -1)
      cos = Nx.cos(angle) |> Nx.take(position_ids) |> Nx.new_axis(2)
      sin = Nx.sin(angle) |> Nx.take(position_ids) |> Nx.new_axis(2)
      size = div(Nx.axis_size(x, -1), 2)

      rot =
        Nx.concatenate([x[[.., .., .., size..-1//1]], -x[[.., .., .., 0..(size - 1)//1]]],
          axis: -1
        )

      x * cos + rot * sin
    end

    # Axon's gelu (Axon.Activations.gelu/1).
    defn axon_gelu(x) do
      sqrt2 = Nx.sqrt(Nx.tensor(2, type: Nx.type(x)))
      x |> Nx.divide(sqrt2) |> Nx.erf() |> Nx.add(1) |> Nx.multiply(x) |> Nx.divide(2)
    end

    # Not Axon's gelu: another outer divisor, another addend, erf of another tensor.
    defn(gelu_over_three(x), do: (Nx.erf(x / 1.5) + 1) * x / 3)
    defn(gelu_plus_two(x), do: (Nx.erf(x / 1.5) + 2) * x / 2)
    defn(gelu_other(x, y), do: (Nx.erf(y / 1.5) + 1) * x / 2)

    # Axon's silu (Axon.Activations.silu/1), and Bumblebee's gated feed-forward around it
    # (`Axon.multiply(intermediate, Axon.activation(gate, :silu))`).
    defn(axon_silu(x), do: x |> Nx.sigmoid() |> Nx.multiply(x))
    defn(gated_silu(up, gate), do: Nx.multiply(up, axon_silu(gate)))
    # Not silu: the sigmoid of another tensor; a factor broadcast over the gate.
    defn(sigmoid_other(x, y), do: Nx.sigmoid(y) * x)

    # Axon's dense layer (Axon.Layers.dense/4), and near misses: a bias of the rows, a
    # product over another axis.
    defn(axon_dense(x, w, b), do: Nx.dot(x, [Nx.rank(x) - 1], [], w, [0], []) |> Nx.add(b))
    defn(dense_row_bias(x, w, b), do: Nx.add(Nx.dot(x, [1], [], w, [0], []), Nx.new_axis(b, 1)))
    defn(dense_first_axis(x, w, b), do: Nx.dot(x, [0], [], w, [0], []) |> Nx.add(b))

    # A layer's projections: products of one input by parameters (Bumblebee's query, key
    # and value; a gated unit's gate and up), and near misses: a computed weight, a
    # weight contracted on its second axis, another input.
    defnp(project(x, w), do: Nx.dot(x, [Nx.rank(x) - 1], [], w, [0], []))
    defn(projections(x, wq, wk, wv), do: {project(x, wq), project(x, wk), project(x, wv)})

    defn(four_five(x, a, b, c, d, e),
      do:
        {{project(x, a), project(x, b), project(x, c), project(x, d)},
         {project(x + 1, a), project(x + 1, b), project(x + 1, c), project(x + 1, d),
          project(x + 1, e)}}
    )

    defn(projection_misses(x, y, a, b),
      do: {project(x, a * 2), project(x, b), Nx.dot(x, [1], [], b, [1], []), project(y, a)}
    )

    # Bumblebee's generation step: the LM head over every position, then the last row.
    defn(last_logits(h, w), do: Nx.dot(h, [2], w, [1])[[.., -1]])
    defn(first_vocab(h, w), do: Nx.dot(h, [2], w, [1])[[.., .., 0..3]])
    defn(batched_last(h, w), do: Nx.dot(h, [2], [0], w, [2], [0])[[.., -1]])

    ## Helpers

    defp rand(shape, type, seed) do
      key = Nx.Random.key(seed) |> Nx.backend_transfer(Nx.BinaryBackend)

      {t, _} = Nx.Random.normal(key, shape: shape, type: :f32)
      t |> Nx.as_type(type) |> Nx.backend_transfer(Emily.Backend)
    end

    defp run(fun, args, opts \\ []),
      do: apply(Nx.Defn.jit(fun, [compiler: Emily.Compiler] ++ opts), args)

    # The rewritten and the unrewritten runs, their largest difference (relative to the
    # result's magnitude where over one), and what the listing says fired.
    defp compare(fun, args) do
      fused = run(fun, args)
      plain = run(fun, args, fuse: false)
      assert fused.shape == plain.shape and fused.type == plain.type
      a = Nx.as_type(Nx.backend_transfer(fused, Nx.BinaryBackend), :f64)
      b = Nx.as_type(Nx.backend_transfer(plain, Nx.BinaryBackend), :f64)
      scale = max(1.0, b |> Nx.abs() |> Nx.reduce_max() |> Nx.to_number())
      diff = Nx.subtract(a, b) |> Nx.abs() |> Nx.reduce_max() |> Nx.to_number()
      {diff / scale, Emily.Compiler.fusions(fun, args)}
    end

    defp tol({:f, 32}), do: 1.0e-5
    defp tol({:f, 16}), do: 4.0e-3
    defp tol({:bf, 16}), do: 3.0e-2

    defp rewrites(fused), do: Enum.map(fused, & &1.rewrite)

    ## RMS norm

    for type <- [:f32, :bf16, :f16] do
      test "Bumblebee's RMS norm (upcast: :normalization) in #{type}" do
        type = Nx.Type.normalize!(unquote(type))
        x = rand({2, 5, 16}, type, 1)
        w = rand({16}, type, 2)
        {diff, fused} = compare(&bb_rms(&1, &2, eps: 1.0e-5), [x, w])
        assert [%{rewrite: :rms_norm, eps: eps, weight: true, type: ^type}] = fused
        assert_in_delta eps, 1.0e-5, 1.0e-12
        assert diff <= tol(type), "#{diff}"
      end
    end

    test "Bumblebee's RMS norm with a shift (Gemma's 1 + weight) and upcast: :all" do
      x = rand({3, 4, 8}, :bf16, 3)
      w = rand({8}, :bf16, 4)
      {diff, fused} = compare(&bb_rms(&1, &2, shift: 1.0), [x, w])
      assert rewrites(fused) == [:rms_norm]
      assert diff <= tol({:bf, 16})

      {diff, fused} = compare(&bb_rms_all/2, [x, w])
      assert [%{rewrite: :rms_norm, type: {:f, 32}}] = fused
      assert diff <= tol({:f, 32})
    end

    test "an RMS norm without weight" do
      {diff, fused} = compare(&rms_plain/1, [rand({4, 32}, :f32, 5)])
      assert [%{rewrite: :rms_norm, weight: false}] = fused
      assert diff <= tol({:f, 32})
    end

    test "near misses of the RMS norm are not rewritten" do
      x = rand({2, 3, 8}, :f32, 6)
      w = rand({8}, :f32, 7)

      for fun <- [&rms_eps_outside/2, &rms_other_axis/2, &rms_other_divisor/2] do
        assert Emily.Compiler.fusions(fun, [x, w]) == []
      end

      # The f32 normalization alone is an RMS norm; the cast and the weight stay outside.
      assert [%{rewrite: :rms_norm, weight: false, type: {:f, 32}}] =
               Emily.Compiler.fusions(&rms_lossy/2, [x, Nx.as_type(w, :bf16)])

      {diff, _} = compare(&rms_lossy/2, [x, Nx.as_type(w, :bf16)])
      assert diff <= tol({:bf, 16})
    end

    ## Layer norm

    for type <- [:f32, :bf16] do
      test "Axon's layer norm in #{type}" do
        type = Nx.Type.normalize!(unquote(type))
        x = Nx.add(rand({2, 6, 24}, type, 8), 3.0) |> Nx.as_type(type)
        g = rand({24}, type, 9)
        b = rand({24}, type, 10)
        {diff, fused} = compare(&axon_ln(&1, &2, &3, eps: 1.0e-12), [x, g, b])
        assert [%{rewrite: :layer_norm, weight: true, bias: true, eps: 1.0e-12}] = fused
        assert diff <= tol(type), "#{diff}"
      end
    end

    test "layer norms in MLX's order, and without weight and bias" do
      x = rand({3, 16}, :f32, 11)
      {diff, fused} = compare(&ln_mlx_order/3, [x, rand({16}, :f32, 12), rand({16}, :f32, 13)])
      assert rewrites(fused) == [:layer_norm]
      assert diff <= tol({:f, 32})

      {diff, fused} = compare(&ln_no_affine/1, [x])
      assert [%{rewrite: :layer_norm, weight: false, bias: false}] = fused
      assert diff <= tol({:f, 32})
    end

    test "near misses of the layer norm are not rewritten" do
      x = rand({2, 3, 8}, :f32, 14)
      g = rand({8}, :f32, 15)
      b = rand({8}, :f32, 16)
      # The unbiased variance (divided by H - 1), and epsilon outside the square root.
      assert Emily.Compiler.fusions(&axon_ln(&1, &2, &3, ddof: 1), [x, g, b]) == []
      assert Emily.Compiler.fusions(&ln_eps_outside/3, [x, g, b]) == []
    end

    ## GELU

    for type <- [:f32, :bf16, :f16] do
      test "Axon's gelu in #{type}: the same values as unfused, to the bit" do
        type = Nx.Type.normalize!(unquote(type))
        # 67 elements: eight-lane blocks and a tail on the CPU kernel.
        x = rand({67}, type, 40) |> Nx.multiply(3) |> Nx.as_type(type)
        fused = run(&axon_gelu/1, [x])
        plain = run(&axon_gelu/1, [x], fuse: false)
        assert Nx.to_binary(fused) == Nx.to_binary(plain)
        assert [%{rewrite: :gelu, type: ^type}] = Emily.Compiler.fusions(&axon_gelu/1, [x])
      end
    end

    test "near misses of the gelu are not rewritten" do
      x = rand({2, 8}, :f32, 41)
      assert Emily.Compiler.fusions(&gelu_over_three/1, [x]) == []
      assert Emily.Compiler.fusions(&gelu_plus_two/1, [x]) == []
      assert Emily.Compiler.fusions(&gelu_other/2, [x, rand({2, 8}, :f32, 42)]) == []
    end

    ## SiLU

    for type <- [:f32, :bf16, :f16] do
      test "Axon's silu and a gated unit in #{type}: the same values as unfused, to the bit" do
        type = Nx.Type.normalize!(unquote(type))
        # 67 elements: eight-lane blocks and a tail on the CPU kernel.
        x = rand({67}, type, 44) |> Nx.multiply(8) |> Nx.as_type(type)
        up = rand({67}, type, 45) |> Nx.multiply(4) |> Nx.as_type(type)

        assert Nx.to_binary(run(&axon_silu/1, [x])) ==
                 Nx.to_binary(run(&axon_silu/1, [x], fuse: false))

        assert Nx.to_binary(run(&gated_silu/2, [up, x])) ==
                 Nx.to_binary(run(&gated_silu/2, [up, x], fuse: false))

        assert [%{rewrite: :silu, gated: false, type: ^type}] =
                 Emily.Compiler.fusions(&axon_silu/1, [x])

        assert [%{rewrite: :silu, gated: true, type: ^type, shape: {67}}] =
                 Emily.Compiler.fusions(&gated_silu/2, [up, x])
      end
    end

    test "near misses of the silu are not rewritten, or not gated" do
      x = rand({2, 8}, :f32, 46)
      assert Emily.Compiler.fusions(&sigmoid_other/2, [x, rand({2, 8}, :f32, 47)]) == []

      # A factor that broadcasts: the silu alone is rewritten, the product runs as it is.
      row = rand({8}, :f32, 48)
      assert [%{rewrite: :silu, gated: false}] = Emily.Compiler.fusions(&gated_silu/2, [row, x])

      assert Nx.to_binary(run(&gated_silu/2, [row, x])) ==
               Nx.to_binary(run(&gated_silu/2, [row, x], fuse: false))

      # A gate that broadcasts against the factor: likewise.
      assert [%{rewrite: :silu, gated: false, shape: {8}}] =
               Emily.Compiler.fusions(&gated_silu/2, [x, row])

      assert Nx.to_binary(run(&gated_silu/2, [x, row])) ==
               Nx.to_binary(run(&gated_silu/2, [x, row], fuse: false))
    end

    ## Dense

    for type <- [:f32, :bf16, :f16] do
      test "Axon's dense in #{type}: a matrix product and a decoding row, as unfused" do
        type = Nx.Type.normalize!(unquote(type))
        w = rand({48, 40}, type, 50)
        b = rand({40}, type, 51)

        # Batch 2 x 9 rows (a matrix product: the bias inside it), one row (a decoding
        # step's: Emily's row kernel, then the sum).
        for x <- [rand({2, 9, 48}, type, 52), rand({1, 48}, type, 53)] do
          {diff, fused} = compare(&axon_dense/3, [x, w, b])
          assert [%{rewrite: :dense, type: ^type}] = fused
          assert diff <= tol(type), "#{inspect(x.shape)}: #{diff}"
        end
      end
    end

    test "near misses of the dense layer are not rewritten" do
      x = rand({6, 8}, :f32, 54)
      w = rand({8, 5}, :f32, 55)
      assert Emily.Compiler.fusions(&dense_row_bias/3, [x, w, rand({6}, :f32, 56)]) == []

      assert Emily.Compiler.fusions(&dense_first_axis/3, [
               rand({8, 6}, :f32, 57),
               w,
               rand({5}, :f32, 58)
             ]) == []

      # A bias of another type (the sum promotes).
      assert Emily.Compiler.fusions(&axon_dense/3, [x, w, rand({5}, :bf16, 59)]) == []
    end

    ## Products of one input

    for type <- [:f32, :bf16, :f16] do
      test "a layer's projections in #{type}: one instruction, each product to the bit" do
        type = Nx.Type.normalize!(unquote(type))

        [wq, wk, wv] =
          for {n, i} <- Enum.with_index([40, 24, 24]), do: rand({48, n}, type, 60 + i)

        # A decoding step's row (one node through Emily's kernel), and a prompt's rows
        # (the products as they were).
        for x <- [rand({1, 1, 48}, type, 63), rand({2, 9, 48}, type, 64)] do
          args = [x, wq, wk, wv]
          lead = Tuple.delete_at(x.shape, 2)

          assert [%{rewrite: :dots, products: 3, type: ^type, shapes: shapes}] =
                   Emily.Compiler.fusions(&projections/4, args)

          assert shapes == for(n <- [40, 24, 24], do: Tuple.insert_at(lead, tuple_size(lead), n))

          fused = run(&projections/4, args) |> Tuple.to_list() |> Enum.map(&Nx.to_binary/1)

          plain =
            run(&projections/4, args, fuse: false) |> Tuple.to_list() |> Enum.map(&Nx.to_binary/1)

          assert fused == plain
        end
      end
    end

    test "four products of one input as two and two, five as three and two" do
      x = rand({1, 16}, :f32, 65)
      ws = for i <- 1..5, do: rand({16, 8 + i}, :f32, 65 + i)
      groups = Emily.Compiler.fusions(&four_five/6, [x | ws]) |> Enum.map(& &1.products)
      assert Enum.sort(groups) == [2, 2, 2, 3]

      flat = fn r ->
        r |> Tuple.to_list() |> Enum.flat_map(&Tuple.to_list/1) |> Enum.map(&Nx.to_binary/1)
      end

      assert flat.(run(&four_five/6, [x | ws])) == flat.(run(&four_five/6, [x | ws], fuse: false))
    end

    test "products of a computed weight, of another axis or another input stay apart" do
      args = [
        rand({1, 16}, :f32, 71),
        rand({1, 16}, :f32, 72),
        rand({16, 16}, :f32, 73),
        rand({16, 16}, :f32, 74)
      ]

      assert Emily.Compiler.fusions(&projection_misses/4, args) == []
    end

    ## An update of repeated heads

    for type <- [:f32, :bf16, :s32] do
      test "keys repeated over grouped heads, written into a cache, in #{type}: as unfused" do
        type = Nx.Type.normalize!(unquote(type))
        cache = rand({2, 9, 8, 4}, :f32, 60) |> Nx.multiply(4) |> Nx.as_type(type)
        k = rand({2, 3, 2, 4}, :f32, 61) |> Nx.multiply(4) |> Nx.as_type(type)

        # A tensor offset (a decoding step's), a number (the prompt's), one past the end
        # (clamped, as Nx clamps it).
        for offset <- [Nx.tensor(4), 0, Nx.tensor(8)] do
          args = [cache, k, offset]
          fun = &cache_repeated(&1, &2, &3, groups: 4)

          assert Nx.to_binary(run(fun, args)) == Nx.to_binary(run(fun, args, fuse: false)),
                 inspect(offset)

          assert [%{rewrite: :repeated_update, groups: 4, shape: {2, 9, 8, 4}}] =
                   Emily.Compiler.fusions(fun, args)
        end
      end
    end

    test "near misses of the repeated update are not rewritten" do
      cache = rand({2, 9, 8, 4}, :f32, 62)
      offset = Nx.tensor(2)
      # Three heads repeated twice: six of the cache's eight.
      k3 = rand({2, 1, 3, 4}, :f32, 63)
      assert Emily.Compiler.fusions(&cache_partial/3, [cache, k3, offset]) == []

      assert Nx.to_binary(run(&cache_partial/3, [cache, k3, offset])) ==
               Nx.to_binary(run(&cache_partial/3, [cache, k3, offset], fuse: false))

      rows = rand({2, 1, 8, 4}, :f32, 64)
      assert Emily.Compiler.fusions(&cache_repeated_rows/3, [cache, rows, offset]) == []
    end

    ## A slice of a product

    test "the last position of an LM head is the head of the last position" do
      h = rand({2, 7, 16}, :f32, 43)
      w = rand({40, 16}, :f32, 44)
      {diff, fused} = compare(&last_logits/2, [h, w])
      assert [%{rewrite: :sliced_dot, shape: {2, 1, 40}}] = fused
      assert diff <= tol({:f, 32})
      # A slice of the other operand's axis, and a batched product, are not rewritten.
      assert Emily.Compiler.fusions(&first_vocab/2, [h, w]) == []
      assert Emily.Compiler.fusions(&batched_last/2, [h, rand({2, 40, 16}, :f32, 45)]) == []
    end

    ## Rotary embedding

    for type <- [:f32, :bf16] do
      test "Bumblebee's rotary embedding on a decoding step (one position per row) in #{type}" do
        type = Nx.Type.normalize!(unquote(type))
        x = rand({3, 1, 4, 16}, type, 50)
        # Each row at its own position, the last one the table's last.
        ids = Nx.tensor([[0], [5], [63]])

        for opts <- [[positions: 64], [positions: 64, base: 1_000_000, factor: 8.0]] do
          {diff, fused} = compare(&bb_rope(&1, &2, opts), [x, ids])
          assert [%{rewrite: :rope, dims: 16, type: ^type}] = fused
          assert diff <= tol(type), "#{inspect(opts)}: #{diff}"
        end
      end
    end

    test "rotary embeddings the kernel does not compute are not rewritten" do
      x = rand({2, 1, 2, 8}, :f32, 51)
      ids = Nx.tensor([[1], [3]])
      # Rescaled tables (longrope's), the other rotation, and a prefill (many
      # positions per row, any positions: MLX's kernel takes consecutive ones).
      assert Emily.Compiler.fusions(&bb_rope(&1, &2, gain: 1.5), [x, ids]) == []
      assert Emily.Compiler.fusions(&rope_other_half/2, [x, ids]) == []
      prefill = rand({2, 5, 2, 8}, :f32, 52)
      assert Emily.Compiler.fusions(&bb_rope/2, [prefill, Nx.iota({2, 5})]) == []
      {diff, _} = compare(&bb_rope(&1, &2, gain: 1.5), [x, ids])
      assert diff == 0.0
    end

    ## Attention

    defp attention_inputs(type, {b, lq, lk, heads, kv_heads, d}, seed) do
      q = rand({b, lq, heads, d}, type, seed)
      k = rand({b, lk, kv_heads, d}, type, seed + 1)
      v = rand({b, lk, kv_heads, d}, type, seed + 2)
      # Padding: the first batch entry's last key is masked out.
      mask = Nx.iota({b, lk}) |> Nx.less(b * lk - 1) |> Nx.as_type(:u8)
      {q, k, v, mask}
    end

    for type <- [:f32, :bf16, :f16] do
      test "Bumblebee's causal attention with a padding mask in #{type}" do
        type = Nx.Type.normalize!(unquote(type))
        {q, k, v, mask} = attention_inputs(type, {2, 5, 5, 4, 4, 8}, 20)
        {diff, fused} = compare(&bb_attention/5, [q, k, v, mask, 0])

        assert [%{rewrite: :scaled_dot_product_attention, mask: :additive, heads: {4, 4}} = f] =
                 fused

        assert_in_delta f.scale, 1 / :math.sqrt(8), 1.0e-3
        assert diff <= tol(type), "#{diff}"
      end
    end

    test "grouped-query attention gets the kernel's grouped heads, not the repeated ones" do
      {q, k, v, mask} = attention_inputs(:f32, {2, 6, 6, 8, 2, 4}, 30)
      {diff, fused} = compare(&bb_attention(&1, &2, &3, &4, &5, groups: 4), [q, k, v, mask, 0])
      assert [%{rewrite: :scaled_dot_product_attention, heads: {8, 2}}] = fused
      assert diff <= tol({:f, 32})
    end

    test "a decode step: one query over a cache, the causal mask from a tensor offset" do
      # Keys past offset + 1 are the cache's unwritten rows: the causal mask hides them.
      {q, k, v, mask} = attention_inputs(:f32, {2, 1, 9, 4, 4, 8}, 40)
      offset = Nx.tensor(3)
      {diff, fused} = compare(&bb_attention/5, [q, k, v, mask, offset])
      assert rewrites(fused) == [:scaled_dot_product_attention]
      assert diff <= tol({:f, 32})
    end

    test "no mask, and a query that sees no key (uniform weights, as unfused)" do
      {q, k, v, _mask} = attention_inputs(:f32, {2, 4, 4, 2, 2, 8}, 50)

      {diff, fused} =
        compare(&bb_attention(&1, &2, &3, &4, &5, causal: false, scale: 0.25), [
          q,
          k,
          v,
          Nx.broadcast(Nx.tensor(1, type: :u8), {2, 4}),
          0
        ])

      assert [%{rewrite: :scaled_dot_product_attention, scale: 0.25}] = fused
      assert diff <= tol({:f, 32})

      # The second batch entry sees no key at all.
      none =
        Nx.concatenate([
          Nx.broadcast(Nx.tensor(1, type: :u8), {1, 4}),
          Nx.broadcast(Nx.tensor(0, type: :u8), {1, 4})
        ])

      {diff, _} = compare(&bb_attention/5, [q, k, v, none, 0])
      assert diff <= tol({:f, 32})
    end

    test "near misses of the attention are not rewritten" do
      {q, k, v, mask} = attention_inputs(:f32, {2, 4, 4, 2, 2, 8}, 60)
      assert Emily.Compiler.fusions(&attention_select_mask/4, [q, k, v, mask]) == []
      assert Emily.Compiler.fusions(&attention_other_axis/3, [q, k, v]) == []
      assert Emily.Compiler.fusions(&attention_tensor_scale/4, [q, k, v, Nx.tensor(0.5)]) == []
    end

    ## The option, the listing and the telemetry

    test "fuse: false turns the rewrites off; each lowering that rewrites reports them" do
      x = rand({2, 16}, :f32, 70)
      w = rand({16}, :f32, 71)
      assert Emily.Compiler.fusions(&bb_rms/2, [x, w], fuse: false) == []

      parent = self()
      id = {__MODULE__, make_ref()}

      :telemetry.attach(id, [:emily, :compiler, :fusion], &__MODULE__.forward/4, parent)

      try do
        run(&bb_rms/2, [x, w], cache: false)
        assert_received {:fusion, %{count: 1}, %{rewrites: [%{rewrite: :rms_norm}]}}

        run(&bb_rms/2, [x, w], cache: false, fuse: false)
        refute_received {:fusion, _, _}
      after
        :telemetry.detach(id)
      end
    end

    defn(rms_then_gelu(x, w), do: axon_gelu(bb_rms(x, w)))

    test "fuse: a list of rewrites allows those alone, except: all but those" do
      x = rand({2, 16}, :f32, 72)
      w = rand({16}, :f32, 73)

      names = fn opts ->
        Enum.map(Emily.Compiler.fusions(&rms_then_gelu/2, [x, w], opts), & &1.rewrite)
      end

      assert names.([]) == [:rms_norm, :gelu]
      assert names.(fuse: true) == [:rms_norm, :gelu]
      assert names.(fuse: [:gelu]) == [:gelu]
      assert names.(fuse: [except: [:gelu]]) == [:rms_norm]
      assert names.(fuse: [:rms_norm, :gelu, :rope]) == [:rms_norm, :gelu]
      assert names.(fuse: []) == []

      # The CPU's gelu kernel gives the five ops' bits: with the norm unfused on both
      # sides, the run that fuses gelu alone equals the one that fuses nothing.
      assert Nx.to_binary(run(&rms_then_gelu/2, [x, w], cache: false, fuse: [:gelu])) ==
               Nx.to_binary(run(&rms_then_gelu/2, [x, w], cache: false, fuse: false))
    end

    test "fuse: an unknown rewrite or another value raises, naming the rewrites" do
      x = rand({2, 16}, :f32, 74)
      w = rand({16}, :f32, 75)

      for bad <- [[:rms_norms], [except: [:flash]], :yes, [except: :rms_norm, only: [:rope]]] do
        assert_raise ArgumentError, ~r/:fuse .*:scaled_dot_product_attention.*got: /, fn ->
          run(&bb_rms/2, [x, w], cache: false, fuse: bad)
        end

        assert_raise ArgumentError, ~r/:fuse/, fn ->
          Emily.Compiler.fusions(&bb_rms/2, [x, w], fuse: bad)
        end
      end
    end

    test "the rewrites fusions/3 documents are the ones :fuse takes" do
      {:docs_v1, _, _, _, _, _, docs} = Code.fetch_docs(Emily.Compiler)
      [doc] = for {{:function, :fusions, 3}, _, _, %{"en" => doc}, _} <- docs, do: doc
      [listed] = Regex.run(~r/`:rewrite` \(([^)]*)\)/s, doc, capture: :all_but_first)
      documented = Regex.scan(~r/`:(\w+)`/, listed, capture: :all_but_first) |> List.flatten()

      assert Enum.sort(documented) ==
               Enum.sort(Enum.map(Emily.Compiler.Native.Fusion.rewrites(), &to_string/1))
    end

    def forward(_event, measurements, meta, pid), do: send(pid, {:fusion, measurements, meta})
  end
else
  defmodule Emily.Nx.FusionTest do
    use ExUnit.Case, async: true
    @moduletag :nx
    require Emily.NxAbsent
    Emily.NxAbsent.placeholders()
  end
end
