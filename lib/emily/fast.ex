if Code.ensure_loaded?(Nx) do
  defmodule Emily.Fast do
    @moduledoc """
    Fused transformer kernels for Nx: RMS norm, layer norm, rotary position embeddings
    and scaled dot-product attention, as MLX's `mlx::core::fast` computes them.

    Each function is an `Nx.block/4`: on `Emily.Backend` (eagerly, inside `defn` with
    `Emily.Compiler` on either path) it runs MLX's fused kernel; on any other backend or
    compiler it runs its default implementation, a plain composition of Nx ops that
    follows MLX's reference computation step by step (the same casts, the same
    precision). So a model written with these functions runs everywhere and gets MLX's
    kernels on Emily. They work inside and outside `defn`, and `Nx.Defn.grad/2`
    differentiates through the composition.

        x = Nx.tensor([[1.0, 2.0, 3.0, 4.0]])
        Emily.Fast.rms_norm(x, Nx.tensor([1.0, 1.0, 2.0, 2.0]), eps: 1.0e-6)

        defn attention_block(x, w_q, w_k, w_v, offset) do
          q = x |> Nx.dot(w_q) |> split_heads(8) |> Emily.Fast.rope(offset: offset)
          k = x |> Nx.dot(w_k) |> split_heads(2) |> Emily.Fast.rope(offset: offset)
          v = x |> Nx.dot(w_v) |> split_heads(2)
          Emily.Fast.scaled_dot_product_attention(q, k, v, mask: :causal)
        end

    ## Layouts and types

      * `rms_norm/3` and `layer_norm/4` normalize over the last axis; their weight and
        bias are vectors of its size. The result type is the floating type of the inputs
        merged; the statistics are computed in f32 (f64 for f64 inputs).
      * `rope/2` takes `[B, ..., L, D]` (at least rank 3; positions run along the
        second-to-last axis) and keeps the input's floating type.
      * `scaled_dot_product_attention/4` takes `[B, heads, L, D]` queries, keys and
        values; keys and values may have fewer heads than queries (grouped-query
        attention: the query heads a multiple of theirs), and optional attention sinks
        (one logit per query head). The softmax runs in f32.

    On Emily, f16, bf16 and f32 run the MLX kernel; f64 runs the composition (MLX's
    kernels compute in f32 at most).
    """

    import Nx.Defn, only: [deftransform: 2]
    alias Nx.Tensor, as: T

    defmodule RMSNorm do
      @moduledoc "The `Nx.block/4` struct of `Emily.Fast.rms_norm/3`."
      defstruct eps: 1.0e-6, weight?: true
    end

    defmodule LayerNorm do
      @moduledoc "The `Nx.block/4` struct of `Emily.Fast.layer_norm/4`."
      defstruct eps: 1.0e-5, weight?: true, bias?: true
    end

    defmodule RoPE do
      @moduledoc """
      The `Nx.block/4` struct of `Emily.Fast.rope/2`. `offset` is an integer, or
      `:tensor` when the offset is the block's second argument; `freqs?` says whether
      the frequencies are its last argument.
      """
      defstruct dims: nil,
                traditional: false,
                base: 10_000.0,
                scale: 1.0,
                offset: 0,
                freqs?: false
    end

    defmodule ScaledDotProductAttention do
      @moduledoc """
      The `Nx.block/4` struct of `Emily.Fast.scaled_dot_product_attention/4`. `mask` is
      `nil`, `:causal`, `:boolean` or `:additive` (a mask tensor as the block's fourth
      argument); with `sinks?`, the sink logits are the block's last argument.
      """
      defstruct scale: nil, mask: nil, sinks?: false
    end

    @type tensor :: Nx.Tensor.t() | number

    @doc false
    # The block structs, for the backend's and the native compiler's dispatch.
    def blocks, do: [RMSNorm, LayerNorm, RoPE, ScaledDotProductAttention]

    ## RMS norm

    @doc """
    RMS normalization over the last axis: `x / sqrt(mean(x², -1) + eps) * weight`.

    `weight` is a vector of the last axis's size, or `nil` (no scaling). Options:

      * `:eps` - added to the mean square (default `1.0e-6`).

    The normalized value is computed in f32 (f64 for f64 inputs) and cast to the result
    type before the weight multiplies it, as MLX does.

        iex> x = Nx.tensor([[3.0, 4.0]])
        iex> Emily.Fast.rms_norm(x, Nx.tensor([1.0, 2.0]), eps: 0.0) |> Nx.to_flat_list()
        [0.8485281467437744, 2.262741804122925]
    """
    @spec rms_norm(tensor, tensor | nil, keyword) :: Nx.Tensor.t()
    deftransform rms_norm(x, weight, opts \\ []) do
      opts = Keyword.validate!(opts, eps: 1.0e-6)
      x = tensor!(x, "rms_norm")
      check_rank!(x, 1, "rms_norm")
      args = [x | vector_args([weight], x, "rms_norm", ["weight"])]
      type = result_type!(args, "rms_norm")
      struct = %RMSNorm{eps: float!(opts[:eps], :eps), weight?: weight != nil}

      block(struct, args, Nx.template(x.shape, type, names: x.names), &rms_norm_impl/2)
      |> rename(x.names)
    end

    defp rms_norm_impl(%RMSNorm{eps: eps}, [x | rest]) do
      w = List.first(rest)
      type = Nx.Type.to_floating(if w, do: Nx.Type.merge(x.type, w.type), else: x.type)
      xc = Nx.as_type(x, compute_type(type))
      mean_square = Nx.mean(Nx.multiply(xc, xc), axes: [-1], keep_axes: true)
      y = Nx.as_type(Nx.multiply(xc, Nx.rsqrt(Nx.add(mean_square, eps))), type)
      if w, do: Nx.multiply(y, Nx.as_type(w, type)), else: y
    end

    ## Layer norm

    @doc """
    Layer normalization over the last axis:
    `(x - mean(x)) / sqrt(var(x) + eps) * weight + bias`.

    `weight` and `bias` are vectors of the last axis's size, each optional (`nil`: no
    scaling, no shift). Options:

      * `:eps` - added to the variance (default `1.0e-5`).

    The normalized value is computed in f32 (f64 for f64 inputs) and cast to the result
    type before the weight and bias apply, as MLX does.

        iex> x = Nx.tensor([[1.0, 3.0]])
        iex> Emily.Fast.layer_norm(x, nil, Nx.tensor([10.0, 10.0]), eps: 0.0) |> Nx.to_flat_list()
        [9.0, 11.0]
    """
    @spec layer_norm(tensor, tensor | nil, tensor | nil, keyword) :: Nx.Tensor.t()
    deftransform layer_norm(x, weight, bias, opts \\ []) do
      opts = Keyword.validate!(opts, eps: 1.0e-5)
      x = tensor!(x, "layer_norm")
      check_rank!(x, 1, "layer_norm")
      args = [x | vector_args([weight, bias], x, "layer_norm", ["weight", "bias"])]
      type = result_type!(args, "layer_norm")

      struct = %LayerNorm{
        eps: float!(opts[:eps], :eps),
        weight?: weight != nil,
        bias?: bias != nil
      }

      block(struct, args, Nx.template(x.shape, type, names: x.names), &layer_norm_impl/2)
      |> rename(x.names)
    end

    defp layer_norm_impl(%LayerNorm{eps: eps, weight?: w?, bias?: b?}, [x | rest] = args) do
      type = Nx.Type.to_floating(merge_types(args))
      {w, rest} = if w?, do: {hd(rest), tl(rest)}, else: {nil, rest}
      b = if b?, do: hd(rest)
      xc = Nx.as_type(x, compute_type(type))
      centered = Nx.subtract(xc, Nx.mean(xc, axes: [-1], keep_axes: true))
      var = Nx.mean(Nx.multiply(centered, centered), axes: [-1], keep_axes: true)
      y = Nx.as_type(Nx.multiply(centered, Nx.rsqrt(Nx.add(var, eps))), type)
      y = if w, do: Nx.multiply(y, Nx.as_type(w, type)), else: y
      if b, do: Nx.add(y, Nx.as_type(b, type)), else: y
    end

    ## RoPE

    @doc """
    Rotary position embeddings over the first `dims` features of the last axis of
    `x` (`[B, ..., L, D]`, rank 3 or more), positions along the second-to-last axis.

    Position `p = (offset + i) * scale` of row `i` rotates feature pair `j` by the angle
    `p * base^(-2j / dims)`. The pairs are `(x[j], x[j + dims/2])` (the default, the
    GPT-NeoX/Llama "rotate half" layout) or, with `traditional: true`, consecutive
    features `(x[2j], x[2j + 1])`. Features past `dims` pass through.

    Options:

      * `:dims` - how many features rotate; even, at most `D` (default `D`).
      * `:traditional` - consecutive pairs (default `false`).
      * `:base` - the frequency base (default `10_000.0`).
      * `:scale` - multiplies the positions (default `1.0`).
      * `:offset` - the first position: an integer, a scalar integer tensor, or a vector
        of `B` integers, one per batch entry (default `0`).
      * `:freqs` - a vector of `dims / 2` wavelengths used instead of `base`: pair `j`
        rotates by `p / freqs[j]` (for scaled RoPE variants such as Llama 3's).

    The angles' cosines and sines are computed in f32 (f64 for f64 inputs) and cast to
    `x`'s type; the rotation runs in `x`'s type.

        iex> x = Nx.tensor([[[1.0, 0.0]], [[0.0, 1.0]]]) |> Nx.reshape({1, 2, 1, 2})
        iex> Emily.Fast.rope(x, offset: 1) |> Nx.to_flat_list() |> Enum.map(&Float.round(&1, 4))
        [0.5403, 0.8415, -0.8415, 0.5403]
    """
    @spec rope(Nx.Tensor.t(), keyword) :: Nx.Tensor.t()
    deftransform rope(x, opts \\ []) do
      opts =
        Keyword.validate!(opts,
          dims: nil,
          traditional: false,
          base: 10_000.0,
          scale: 1.0,
          offset: 0,
          freqs: nil
        )

      x = tensor!(x, "rope")
      check_rank!(x, 3, "rope")

      if not float?(x.type) do
        raise ArgumentError, "rope: expected a floating-point tensor, got #{inspect(x.type)}"
      end

      last = elem(x.shape, tuple_size(x.shape) - 1)
      dims = opts[:dims] || last

      if not (is_integer(dims) and dims > 0 and rem(dims, 2) == 0 and dims <= last) do
        raise ArgumentError,
              "rope: :dims must be a positive even integer at most #{last} (the last " <>
                "dimension of #{inspect(x.shape)}), got #{inspect(dims)}"
      end

      if not is_boolean(opts[:traditional]) do
        raise ArgumentError,
              "rope: :traditional must be a boolean, got #{inspect(opts[:traditional])}"
      end

      {offset, offset_args} = rope_offset!(opts[:offset], x)

      freqs_args =
        case opts[:freqs] do
          nil ->
            []

          freqs ->
            freqs = tensor!(freqs, "rope")

            if freqs.shape != {div(dims, 2)} do
              raise ArgumentError,
                    "rope: :freqs must be a vector of dims / 2 = #{div(dims, 2)} values, " <>
                      "got shape #{inspect(freqs.shape)}"
            end

            [freqs]
        end

      struct = %RoPE{
        dims: dims,
        traditional: opts[:traditional],
        base: float!(opts[:base], :base),
        scale: float!(opts[:scale], :scale),
        offset: offset,
        freqs?: freqs_args != []
      }

      args = [x | offset_args ++ freqs_args]

      block(struct, args, Nx.template(x.shape, x.type, names: x.names), &rope_default/2)
      |> rename(x.names)
    end

    defp rope_offset!(offset, _x) when is_integer(offset), do: {offset, []}

    defp rope_offset!(%T{} = offset, x) do
      batch = elem(x.shape, 0)

      cond do
        not match?({k, _} when k in [:s, :u], offset.type) ->
          raise ArgumentError,
                "rope: :offset must be an integer tensor, got #{inspect(offset.type)}"

        offset.shape not in [{}, {1}, {batch}] ->
          raise ArgumentError,
                "rope: :offset must be a scalar or a vector of #{batch} values (one per " <>
                  "batch entry), got shape #{inspect(offset.shape)}"

        true ->
          {:tensor, [offset]}
      end
    end

    defp rope_offset!(offset, _x) do
      raise ArgumentError,
            "rope: :offset must be an integer or an integer tensor, got #{inspect(offset)}"
    end

    defp rope_default(%RoPE{offset: :tensor} = s, [x, offset | freqs]),
      do: rope_impl(s, x, offset, List.first(freqs))

    defp rope_default(%RoPE{} = s, [x | freqs]), do: rope_impl(s, x, s.offset, List.first(freqs))

    defp rope_impl(%RoPE{dims: dims} = s, x, offset, freqs) do
      %T{shape: shape, type: type} = x
      rank = tuple_size(shape)
      axis = rank - 1
      len = elem(shape, rank - 2)
      half = div(dims, 2)
      compute = compute_type(type)

      # Positions: {L}, or {B, 1, ..., 1, L} with one offset per batch entry.
      positions = Nx.iota({len}, type: compute)

      positions =
        case offset do
          %T{shape: {b}} when b > 1 ->
            offset = Nx.reshape(Nx.as_type(offset, compute), {b, 1})
            positions = Nx.add(Nx.reshape(positions, {1, len}), offset)
            Nx.reshape(positions, List.to_tuple([b | List.duplicate(1, rank - 3)] ++ [len]))

          %T{} ->
            Nx.add(positions, Nx.as_type(Nx.reshape(offset, {}), compute))

          offset ->
            Nx.add(positions, offset)
        end

      positions = Nx.multiply(positions, s.scale)

      inv_freqs =
        case freqs do
          nil ->
            Nx.exp(Nx.multiply(Nx.iota({half}, type: compute), -:math.log(s.base) / half))

          freqs ->
            Nx.divide(1, Nx.as_type(freqs, compute))
        end

      theta = Nx.multiply(Nx.new_axis(positions, -1), inv_freqs)
      cos = Nx.as_type(Nx.cos(theta), type)
      sin = Nx.as_type(Nx.sin(theta), type)

      {x1, x2} =
        if s.traditional do
          {Nx.slice_along_axis(x, 0, dims, axis: axis, strides: 2),
           Nx.slice_along_axis(x, 1, dims - 1, axis: axis, strides: 2)}
        else
          {Nx.slice_along_axis(x, 0, half, axis: axis),
           Nx.slice_along_axis(x, half, half, axis: axis)}
        end

      r1 = Nx.subtract(Nx.multiply(x1, cos), Nx.multiply(x2, sin))
      r2 = Nx.add(Nx.multiply(x1, sin), Nx.multiply(x2, cos))

      rotated =
        if s.traditional do
          Nx.stack([r1, r2], axis: -1) |> Nx.reshape(put_elem(shape, axis, dims))
        else
          Nx.concatenate([r1, r2], axis: axis)
        end

      if dims < elem(shape, axis) do
        rest = Nx.slice_along_axis(x, dims, elem(shape, axis) - dims, axis: axis)
        Nx.concatenate([rotated, rest], axis: axis)
      else
        rotated
      end
    end

    ## Attention

    @doc """
    Scaled dot-product attention, `softmax(q kᵀ * scale + mask) v`, on `[B, heads, L, D]`
    tensors.

    `k` and `v` have the same number of heads, which divides the number of query heads
    (grouped-query and multi-query attention: each key/value head serves
    `heads(q) / heads(k)` consecutive query heads; do not repeat them beforehand). The
    result is `[B, heads(q), L(q), D(v)]`, in the floating type of the inputs merged.

    Options:

      * `:scale` - a number that multiplies the scores (default `1 / sqrt(D)`).
      * `:mask` - `nil` (default), `:causal`, or a tensor broadcastable to
        `[B, heads(q), L(q), L(k)]` (rank 4 at most). An integer mask (Nx's predicates
        return u8) keeps the scores where it is nonzero; a floating-point mask is added
        to the scores (in the result type). The causal mask is aligned to the end: query
        `i` sees keys up to `i + L(k) - L(q)`, so a query block continuing a cache sees
        the whole cache.
      * `:sinks` - attention sinks: a vector of one logit per query head (`{heads(q)}`),
        taken as the score of an extra key whose value is zero. It joins each softmax
        and is then dropped, so a head's weights over the real keys sum to less than one
        (as in gpt-oss). Default `nil`.

    Masked-out scores are set to the type's lowest finite value (not `-inf`), so a query
    that sees no key gets the mean of the values, as in MLX.

        iex> q = Nx.tensor([[[[1.0, 0.0]]]])
        iex> k = Nx.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])
        iex> v = Nx.tensor([[[[10.0], [20.0]]]])
        iex> Emily.Fast.scaled_dot_product_attention(q, k, v, scale: 1.0, mask: Nx.tensor([1, 0]))
        ...> |> Nx.to_flat_list()
        [10.0]
    """
    @spec scaled_dot_product_attention(tensor, tensor, tensor, keyword) :: Nx.Tensor.t()
    deftransform scaled_dot_product_attention(q, k, v, opts \\ []) do
      opts = Keyword.validate!(opts, scale: nil, mask: nil, sinks: nil)
      name = "scaled_dot_product_attention"
      [q, k, v] = Enum.map([q, k, v], &tensor!(&1, name))

      for {t, what} <- [{q, "queries"}, {k, "keys"}, {v, "values"}], tuple_size(t.shape) != 4 do
        raise ArgumentError,
              "#{name}: expected #{what} of rank 4 ([B, heads, L, D]), got shape " <>
                inspect(t.shape)
      end

      {b, nq, lq, d} = q.shape
      {bk, nk, lk, dk} = k.shape
      {bv, nv, lv, dv} = v.shape

      cond do
        bk != b or bv != b ->
          mismatch!(name, "batch sizes", q, k, v)

        dk != d ->
          mismatch!(name, "query and key feature sizes", q, k, v)

        nv != nk or lv != lk ->
          mismatch!(name, "key and value heads and lengths", q, k, v)

        rem(nq, nk) != 0 ->
          mismatch!(name, "heads: key/value heads must divide query heads", q, k, v)

        true ->
          :ok
      end

      scale = float!(opts[:scale] || 1 / :math.sqrt(d), :scale)
      type = result_type!([q, k, v], name)
      out_shape = {b, nq, lq, dv}

      {mask, mask_args} =
        case opts[:mask] do
          nil ->
            {nil, []}

          :causal ->
            {:causal, []}

          mask ->
            mask = tensor!(mask, name)
            check_mask!(mask, {b, nq, lq, lk}, name)
            {if(float?(mask.type), do: :additive, else: :boolean), [mask]}
        end

      sinks_args =
        case opts[:sinks] do
          nil ->
            []

          sinks ->
            [vector!(sinks, nq, name, "sinks", "one per query head")]
        end

      struct = %ScaledDotProductAttention{scale: scale, mask: mask, sinks?: sinks_args != []}
      args = [q, k, v | mask_args] ++ sinks_args

      block(struct, args, Nx.template(out_shape, type), &sdpa_impl/2)
      |> rename([nil, nil, nil, nil])
    end

    defp sdpa_impl(%ScaledDotProductAttention{scale: scale, mask: mode} = s, [q, k, v | rest]) do
      mask = if mode in [:boolean, :additive], do: hd(rest)
      sinks = if s.sinks?, do: List.last(rest)
      type = Nx.Type.to_floating(merge_types([q, k, v]))
      {b, nq, lq, d} = q.shape
      {_, nk, lk, _} = k.shape
      dv = elem(v.shape, 3)
      groups = div(nq, nk)

      # Query heads grouped by the key/value head that serves them: {B, Nk, G, Lq, D}.
      q = q |> Nx.as_type(type) |> Nx.multiply(scale) |> Nx.reshape({b, nk, groups, lq, d})
      k = Nx.as_type(k, type)
      v = Nx.as_type(v, type)
      scores = Nx.dot(q, [4], [0, 1], k, [3], [0, 1])
      lowest = type |> Nx.Constants.min_finite(backend: Nx.BinaryBackend) |> Nx.to_number()
      grouped = {b, nk, groups, lq, lk}

      scores =
        case mode do
          nil ->
            scores

          :causal ->
            rows = Nx.add(Nx.iota({lq, 1}), lk - lq)
            keep = Nx.greater_equal(rows, Nx.iota({1, lk}))
            Nx.select(Nx.broadcast(keep, grouped), scores, lowest)

          :boolean ->
            keep = mask |> Nx.broadcast({b, nq, lq, lk}) |> Nx.reshape(grouped)
            Nx.select(keep, scores, lowest)

          :additive ->
            add = mask |> Nx.as_type(type) |> Nx.broadcast({b, nq, lq, lk})
            Nx.add(scores, Nx.reshape(add, grouped))
        end

      scores = Nx.as_type(scores, compute_type(type))

      # A sink is one more column of scores (one logit per query head), dropped after
      # the softmax.
      scores =
        if sinks do
          column =
            sinks
            |> Nx.as_type(compute_type(type))
            |> Nx.reshape({1, nk, groups, 1, 1})
            |> Nx.broadcast({b, nk, groups, lq, 1})

          Nx.concatenate([scores, column], axis: 4)
        else
          scores
        end

      exp = Nx.exp(Nx.subtract(scores, Nx.reduce_max(scores, axes: [-1], keep_axes: true)))
      probs = Nx.as_type(Nx.divide(exp, Nx.sum(exp, axes: [-1], keep_axes: true)), type)
      probs = if sinks, do: Nx.slice_along_axis(probs, 0, lk, axis: 4), else: probs

      probs
      |> Nx.dot([4], [0, 1], v, [2], [0, 1])
      |> Nx.reshape({b, nq, lq, dv})
    end

    defp check_mask!(mask, target, name) do
      mask_dims = Tuple.to_list(mask.shape)
      target_dims = Tuple.to_list(target)

      broadcastable? =
        length(mask_dims) <= 4 and
          mask_dims
          |> Enum.reverse()
          |> Enum.zip(Enum.reverse(target_dims))
          |> Enum.all?(fn {m, t} -> m == 1 or m == t end)

      if not broadcastable? do
        raise ArgumentError,
              "#{name}: the mask's shape #{inspect(mask.shape)} does not broadcast to the " <>
                "scores' shape #{inspect(target)} ([B, heads, L(q), L(k)])"
      end
    end

    defp mismatch!(name, what, q, k, v) do
      raise ArgumentError,
            "#{name}: mismatched #{what} (queries #{inspect(q.shape)}, keys " <>
              "#{inspect(k.shape)}, values #{inspect(v.shape)})"
    end

    ## Emily.Backend and the native path

    @doc false
    # How Emily computes a block natively: `{op, args}`, the `Emily.Native` op and its
    # arguments after the stream, where `{:arg, i, type}` stands for the block's i-th
    # argument cast to `type`; `nil` where the block runs its default (f64, which MLX's
    # kernels compute in f32). Shared by Emily.Backend and Emily.Compiler's native path.
    @spec native_call(struct, Nx.Tensor.t(), [Nx.Tensor.t()]) :: {atom, list} | nil
    def native_call(struct, %T{type: type}, args) do
      if type in [{:f, 16}, {:bf, 16}, {:f, 32}], do: call(struct, type, args)
    end

    defp call(%RMSNorm{eps: eps, weight?: w?}, type, _args) do
      {:rms_norm, [{:arg, 0, type}, if(w?, do: {:arg, 1, type}), eps]}
    end

    defp call(%LayerNorm{eps: eps, weight?: w?, bias?: b?}, type, _args) do
      w = if w?, do: {:arg, 1, type}
      b = if b?, do: {:arg, if(w?, do: 2, else: 1), type}
      {:layer_norm, [{:arg, 0, type}, w, b, eps]}
    end

    defp call(%RoPE{offset: offset} = s, type, args) do
      freqs = if s.freqs?, do: {:arg, length(args) - 1, {:f, 32}}
      head = [{:arg, 0, type}, s.dims, s.traditional, s.base, s.scale]

      case offset do
        :tensor -> {:rope_array, head ++ [{:arg, 1, {:s, 32}}, freqs]}
        offset when abs(offset) < 2_147_483_648 -> {:rope, head ++ [offset, freqs]}
        _ -> nil
      end
    end

    defp call(%ScaledDotProductAttention{scale: scale, mask: mask, sinks?: s?}, type, args) do
      qkv = [{:arg, 0, type}, {:arg, 1, type}, {:arg, 2, type}, scale]
      sinks = if s?, do: {:arg, length(args) - 1, type}

      mask_args =
        case mask do
          nil -> ["", nil]
          :causal -> ["causal", nil]
          :boolean -> ["array", {:arg, 3, :bool}]
          :additive -> ["array", {:arg, 3, type}]
        end

      {:scaled_dot_product_attention, qkv ++ mask_args ++ [sinks]}
    end

    defp call(_struct, _type, _args), do: nil

    ## Helpers

    # Nx.block/4's default fun takes the struct and then each argument: `impl` takes the
    # struct and the list of arguments.
    defp block(struct, args, out, impl) do
      fun =
        case args do
          [_] -> fn s, a -> impl.(s, [a]) end
          [_, _] -> fn s, a, b -> impl.(s, [a, b]) end
          [_, _, _] -> fn s, a, b, c -> impl.(s, [a, b, c]) end
          [_, _, _, _] -> fn s, a, b, c, d -> impl.(s, [a, b, c, d]) end
          [_, _, _, _, _] -> fn s, a, b, c, d, e -> impl.(s, [a, b, c, d, e]) end
        end

      Nx.block(struct, args, out, fun)
    end

    defp tensor!(%T{vectorized_axes: [_ | _]}, name),
      do: raise(ArgumentError, "#{name}: vectorized tensors are not supported")

    defp tensor!(%T{} = t, _name), do: t
    defp tensor!(n, _name) when is_number(n), do: Nx.tensor(n)

    defp tensor!(other, name),
      do: raise(ArgumentError, "#{name}: expected a tensor, got #{inspect(other)}")

    defp check_rank!(%T{shape: shape}, min, name) do
      if tuple_size(shape) < min do
        raise ArgumentError,
              "#{name}: expected a tensor of rank #{min} or more, got shape #{inspect(shape)}"
      end
    end

    # The given vectors (nil ones dropped), each of the size of x's last axis.
    defp vector_args(vectors, x, name, labels) do
      last = elem(x.shape, tuple_size(x.shape) - 1)

      for {v, label} <- Enum.zip(vectors, labels), v != nil do
        vector!(v, last, name, label, "the last dimension of #{inspect(x.shape)}")
      end
    end

    # `v` as a tensor of shape `{size}`; `why` says where the size comes from.
    defp vector!(v, size, name, label, why) do
      v = tensor!(v, name)

      if v.shape != {size} do
        raise ArgumentError,
              "#{name}: expected #{label} of shape #{inspect({size})} (#{why}), " <>
                "got #{inspect(v.shape)}"
      end

      v
    end

    defp float!(n, _opt) when is_number(n), do: n * 1.0

    defp float!(other, opt),
      do: raise(ArgumentError, "expected #{inspect(opt)} to be a number, got #{inspect(other)}")

    defp merge_types([t | rest]), do: Enum.reduce(rest, t.type, &Nx.Type.merge(&1.type, &2))

    # The floating type of the inputs merged; MLX's kernels have no complex path.
    defp result_type!(args, name) do
      case Nx.Type.to_floating(merge_types(args)) do
        {:c, _} = type ->
          raise ArgumentError, "#{name}: expected real tensors, got #{inspect(type)}"

        type ->
          type
      end
    end

    defp float?({kind, _}), do: kind in [:f, :bf]

    # MLX computes statistics, angles and the softmax in f32 at least.
    defp compute_type(type), do: Nx.Type.merge(type, {:f, 32})

    defp rename(%T{names: names} = t, names), do: t
    defp rename(t, names), do: Nx.rename(t, names)
  end
end
