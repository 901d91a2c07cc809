if Code.ensure_loaded?(Nx) do
  defmodule Emily.Quantization do
    @moduledoc """
    Quantized weights on MLX: a guide.

    A quantized weight stores each element in a few bits and one scale (plus, in the
    affine mode, one bias) per group of consecutive elements along its last axis. A
    4-bit affine weight with groups of 64 takes 4.5 bits per element (0.28 times
    bf16's memory, counting its bf16 scales and biases; f32 ones make it 5 bits);
    decoding a model is bound by reading its weights, so where memory bandwidth
    limits it, smaller weights decode faster.

    ## Quantize, dequantize, multiply

        w = Nx.Random.normal(Nx.Random.key(0), shape: {4096, 1024}) |> elem(0)
        qw = Emily.Quantization.quantize(w, bits: 4, group_size: 64)
        #=> #Emily.QuantizedWeight<affine 4-bit group 64 f32[4096][1024] packed u32[4096][128]>

        y = Emily.Quantization.quantized_matmul(x, qw)   # x · ŵᵀ, x {..., 1024} -> {..., 4096}
        w_hat = Emily.Quantization.dequantize(qw)        # the float weight qw stands for

    `quantize/2` runs ahead of time (MLX computes it); `dequantize/2`,
    `quantized_matmul/3` and `take/3` (rows of a quantized embedding table) work
    eagerly and inside `defn`, on every backend: they are `Nx.block/4`s that run
    MLX's kernels on `Emily.Backend` and under `Emily.Compiler` (evaluator and native
    paths), and elsewhere the same computation in Nx ops (unpacking the bit streams,
    then `Nx.dot/4`). An `Emily.QuantizedWeight` is an `Nx.Container`: pass it to
    `defn` functions, `Nx.Defn.jit/2`, `Nx.Serving` and `Nx.backend_transfer/2` as
    you would a tensor.

    `quantized_matmul/3` multiplies by the transpose by default: a linear layer's
    weight is `{out, in}`, quantized along `in`, the axis the product contracts (the
    layout MLX's kernels read fastest, and the one mlx-lm stores). An Axon dense
    kernel is `{in, out}`: quantize its transpose, or use `transpose: false` with the
    kernel itself (then the groups run along `out`).

    ## Modes

    | mode | bits | group | scales | bits per element (with scales) |
    |---|---|---|---|---|
    | `:affine` | 2, 3, 4, 5, 6, 8 | 32, 64, 128 | weight's type, plus biases | bits + 2 × 16 / group (bf16) |
    | `:mxfp4` | 4 (E2M1) | 32 | E8M0 (powers of two), u8 | 4.25 |
    | `:nvfp4` | 4 (E2M1) | 16 | E4M3, u8 (optional f32 global scale) | 4.5 |
    | `:mxfp8` | 8 (E4M3) | 32 | E8M0, u8 | 8.25 |

    Affine maps each group's range onto `2^bits` evenly spaced levels (`w ≈ q · scale
    + bias`, with zero snapped onto the grid), so each element is within one level
    (`range / (2^bits - 1)`) of its value. The microscaling modes (`:mxfp4`,
    `:nvfp4`, `:mxfp8`) store small floats with a shared scale: each element is
    within a quarter of its group's largest magnitude (fp4) or a sixteenth (fp8).
    Give `:nvfp4` `global_scale: true` for weights far below 1, whose E4M3 group
    scales would otherwise underflow.

    ## Accuracy

    Two errors matter, and both are tested.

    **The kernel against the dequantized weight.** `quantized_matmul(x, qw)` against
    the f32 product `x · dequantize(qw, type: :f32)ᵀ`, for every mode, bits and group
    size: each element of the result is within `r · Σₖ |xₖ| |ŵₖ|` (the sum of the
    magnitudes it adds up), with `r` = 2⁻²⁰ for f32 inputs (2⁻¹⁰ on a GPU, whose f32
    matmuls are TF32), 2⁻⁵ for bf16 and 2⁻⁸ for f16 (MLX's CPU kernel accumulates in
    the input type). The default implementation (dequantize, then `Nx.dot/4`, on
    any other backend) meets the same bounds, so a model computes the same within
    them on Emily and elsewhere. `dequantize/2` gives bitwise the same values on
    every backend (Nx.BinaryBackend, which rounds to bf16 by truncation, within a
    bf16 step of MLX's for bf16 affine weights).

    **The quantized weight against the float one.** The relative error
    `‖x·ŵᵀ − x·wᵀ‖ / ‖x·wᵀ‖` for N(0, 1) weights `{256, 512}` and inputs `{8, 512}`
    (measured; the test asserts each row's bound over all its group sizes):

    | mode, bits | group 32 | group 64 | group 128 | bound |
    |---|---|---|---|---|
    | affine 2 | 0.35 | 0.39 | 0.43 | 0.45 |
    | affine 3 | 0.17 | 0.19 | 0.20 | 0.22 |
    | affine 4 | 0.080 | 0.090 | 0.10 | 0.11 |
    | affine 5 | 0.039 | 0.043 | 0.050 | 0.055 |
    | affine 6 | 0.020 | 0.022 | 0.024 | 0.027 |
    | affine 8 | 0.0050 | 0.0053 | 0.0060 | 0.007 |
    | mxfp4 | 0.12 | | | 0.13 |
    | nvfp4 (group 16) | 0.096 | | | 0.11 |
    | mxfp8 | 0.027 | | | 0.03 |

    Trained weights with outliers do worse at a given setting; 8-bit and 6-bit are
    near-lossless for most models, 4-bit with group 64 (mlx-lm's default) the usual
    trade, 2- and 3-bit need models trained for them.

    ## Whole models and the CPU rule

    `quantize_model/3` quantizes an Axon model's dense kernels (and, with
    `embeddings: true`, its embedding tables) in one call, keeping chosen layers
    (an LM head, say) in float with `:except`; given the map `Bumblebee.load_model/2`
    returns, it quantizes the Bumblebee model (its LM head too), for Bumblebee's
    servings. `load_mlx/2` loads a checkpoint that mlx-lm quantized (`mlx_lm.convert
    -q`, the `mlx-community` models) straight into the Bumblebee model of its
    architecture, its packed weights as they are.

    On a GPU the packed weights are the point: less memory, and fewer bytes read per
    token. On the CPU device MLX's `quantized_matmul` runs on one thread and is many
    times slower than a BLAS matmul of the float weights, so there `quantize_model/3`
    dequantizes once, at load, by default: the model computes with the quantized
    values at BLAS speed, without the memory saving. Pass `packed: true` to keep the
    weights packed on the CPU too (less memory, slower matmuls), or `packed: false`
    to dequantize on a GPU.

    Packed layers are for inference: their codes have no gradient. To train with
    less memory, see `Emily.MixedPrecision`.
    """

    import Nx.Defn, only: [deftransform: 2]
    alias Nx.Tensor, as: T
    alias Emily.QuantizedWeight, as: QW

    defmodule Dequantize do
      @moduledoc """
      The `Nx.block/4` struct of `Emily.Quantization.dequantize/2`. Its arguments are the
      packed codes, the scales and, where the flags say so, the biases and the global
      scale.
      """
      defstruct [:mode, :bits, :group_size, :type, biases?: false, global_scale?: false]
    end

    defmodule QuantizedMatmul do
      @moduledoc """
      The `Nx.block/4` struct of `Emily.Quantization.quantized_matmul/3`. Its arguments
      are `x`, the packed codes, the scales and, where the flags say so, the biases and
      the global scale.
      """
      defstruct [
        :mode,
        :bits,
        :group_size,
        :type,
        transpose: true,
        biases?: false,
        global_scale?: false
      ]
    end

    # Bits and group sizes MLX accepts per mode, the first of each the default.
    @modes %{
      affine: {[4, 2, 3, 5, 6, 8], [64, 32, 128]},
      mxfp4: {[4], [32]},
      nvfp4: {[4], [16]},
      mxfp8: {[8], [32]}
    }

    @float_types [{:f, 16}, {:bf, 16}, {:f, 32}]

    @doc false
    # The block structs, for Emily.Backend's and the native compiler's dispatch.
    def blocks, do: [Dequantize, QuantizedMatmul]

    @doc """
    The quantization modes with the bits and group sizes each accepts, the first of
    each its default.

        iex> Emily.Quantization.modes()[:mxfp4]
        %{bits: [4], group_sizes: [32]}
    """
    @spec modes() :: %{atom => %{bits: [pos_integer], group_sizes: [pos_integer]}}
    def modes, do: Map.new(@modes, fn {m, {b, g}} -> {m, %{bits: b, group_sizes: g}} end)

    ## Quantize

    @doc """
    Quantizes `tensor` along its last axis into an `Emily.QuantizedWeight`.

    `tensor` is an f16, bf16 or f32 tensor of rank 2 or more whose last axis is a
    multiple of the group size. MLX computes the codes and scales (the tensor is
    copied to `Emily.Backend` if it lives elsewhere); the result's tensors live on the
    input's backend. Not callable inside `defn` (quantize ahead of time and pass the
    weight in).

    Options:

      * `:mode` - `:affine` (default), `:mxfp4`, `:nvfp4` or `:mxfp8`.
      * `:bits` - `:affine`: 2, 3, 4, 5, 6 or 8 (default 4); the other modes have
        their own (4, 4, 8).
      * `:group_size` - `:affine`: 32, 64 or 128 (default 64); `:mxfp4` and `:mxfp8`
        32, `:nvfp4` 16.
      * `:global_scale` - `:nvfp4` only: `true` to compute the tensor's largest
        magnitude and quantize against it (weights far below 1 keep their precision;
        without it, groups whose largest value is under about `448 * 2^-9 * 6` lose it),
        or an f32 scalar to use instead. Default `nil`.

    Raises `ArgumentError` for a mode, bits or group size MLX does not accept, a last
    axis the group size does not divide, and a tensor of another type or rank.

        iex> qw = Emily.Quantization.quantize(Nx.iota({2, 32}, type: :f32), bits: 8, group_size: 32)
        iex> {qw.value.shape, qw.scales.shape, qw.biases.shape}
        {{2, 8}, {2, 1}, {2, 1}}
    """
    @spec quantize(Nx.Tensor.t(), keyword) :: QW.t()
    def quantize(tensor, opts \\ [])

    def quantize(%T{data: %Nx.Defn.Expr{}}, _opts) do
      raise ArgumentError,
            "quantize: cannot run inside defn; quantize the weight ahead of time and " <>
              "pass the Emily.QuantizedWeight in"
    end

    def quantize(%T{} = tensor, opts) do
      opts = Keyword.validate!(opts, mode: :affine, bits: nil, group_size: nil, global_scale: nil)
      {mode, bits, gs} = mode!(opts, "quantize")

      if tensor.vectorized_axes != [],
        do: raise(ArgumentError, "quantize: vectorized tensors are not supported")

      if tensor.type not in @float_types do
        raise ArgumentError,
              "quantize: expected an f16, bf16 or f32 tensor, got #{inspect(tensor.type)}"
      end

      rank = tuple_size(tensor.shape)

      if rank < 2 do
        raise ArgumentError,
              "quantize: expected a tensor of rank 2 or more, got shape #{inspect(tensor.shape)}"
      end

      last = elem(tensor.shape, rank - 1)

      if rem(last, gs) != 0 do
        raise ArgumentError,
              "quantize: the group size #{gs} does not divide the last axis of " <>
                "#{inspect(tensor.shape)} (#{last})"
      end

      global = global_scale!(opts[:global_scale], mode, tensor)
      backend = backend_of(tensor)
      emily = to_emily(tensor)
      # (Map patterns: Emily.Backend's compilation reads blocks/0 from this module.)
      %{__struct__: Emily.Backend, ref: ref, stream: s} = emily.data
      s = Emily.Stream.selected() || s

      {value, scales, biases, global} =
        case mode do
          :affine ->
            [wq, sc, bi] = Emily.Native.quantize(s, ref, gs, bits)
            {wq, sc, bi, nil}

          _ ->
            g = if global, do: to_emily(global).data.ref
            [wq, sc] = Emily.Native.quantize_mode(s, ref, gs, bits, Atom.to_string(mode), g)
            {wq, sc, nil, global}
        end

      qw = %QW{
        value: wrap(value, s),
        scales: wrap(scales, s),
        biases: biases && wrap(biases, s),
        global_scale: global && to_emily(global),
        mode: mode,
        bits: bits,
        group_size: gs,
        shape: tensor.shape,
        type: tensor.type
      }

      if backend == Emily.Backend, do: qw, else: Nx.backend_transfer(qw, backend)
    end

    def quantize(other, _opts),
      do: raise(ArgumentError, "quantize: expected a tensor, got #{inspect(other)}")

    defp mode!(opts, name) do
      mode = opts[:mode]

      case Map.fetch(@modes, mode) do
        {:ok, {[default_bits | _] = bits_list, [default_gs | _] = gs_list}} ->
          bits = opts[:bits] || default_bits
          gs = opts[:group_size] || default_gs

          if bits not in bits_list do
            raise ArgumentError,
                  "#{name}: mode #{inspect(mode)} takes bits #{list(bits_list)}, got " <>
                    inspect(bits)
          end

          if gs not in gs_list do
            raise ArgumentError,
                  "#{name}: mode #{inspect(mode)} takes group sizes #{list(gs_list)}, got " <>
                    inspect(gs)
          end

          {mode, bits, gs}

        :error ->
          raise ArgumentError,
                "#{name}: unknown mode #{inspect(mode)}, expected one of " <>
                  "#{list(Map.keys(@modes))}"
      end
    end

    defp list(items), do: items |> Enum.sort() |> Enum.map_join(", ", &inspect/1)

    defp global_scale!(nil, _mode, _tensor), do: nil

    defp global_scale!(g, mode, _tensor) when mode != :nvfp4 do
      raise ArgumentError,
            "quantize: :global_scale applies to mode :nvfp4 only, got #{inspect(g)} with " <>
              "mode #{inspect(mode)}"
    end

    defp global_scale!(true, _mode, tensor),
      do: tensor |> Nx.abs() |> Nx.reduce_max() |> Nx.as_type(:f32)

    defp global_scale!(g, _mode, _tensor) when is_number(g), do: Nx.tensor(g, type: :f32)

    defp global_scale!(%T{shape: {}} = g, _mode, _tensor), do: Nx.as_type(g, :f32)

    defp global_scale!(g, _mode, _tensor) do
      raise ArgumentError,
            "quantize: :global_scale must be true, a number or a scalar tensor, got " <>
              inspect(g)
    end

    defp backend_of(%T{data: %backend{}}), do: backend

    defp to_emily(%T{data: %{__struct__: Emily.Backend}} = t), do: t
    defp to_emily(%T{} = t), do: Nx.backend_copy(t, Emily.Backend)

    defp wrap(ref, s) do
      t = Nx.template(Emily.shape(ref), Emily.dtype(ref))
      Emily.Memory.created(Nx.byte_size(t))
      %{t | data: struct!(Emily.Backend, ref: ref, stream: s)}
    end

    ## Dequantize

    @doc """
    The float tensor `qw` stands for: its codes times its scales (plus its biases), of
    `qw.shape`, in `qw.type` or the `:type` option's (f16, bf16, f32 or f64).

    An `Nx.block/4`: on `Emily.Backend` and under `Emily.Compiler` it runs MLX's
    `dequantize`; on any other backend the same computation in Nx ops (unpacking the
    bit streams), giving the same values. Works inside and outside `defn`.

        iex> w = Nx.tensor([Enum.map(0..31, &(rem(&1, 16) * 0.5))])
        iex> qw = Emily.Quantization.quantize(w, bits: 4, group_size: 32)
        iex> back = Emily.Quantization.dequantize(qw)
        iex> Nx.to_flat_list(back) == Nx.to_flat_list(w)
        true
    """
    @spec dequantize(QW.t(), keyword) :: Nx.Tensor.t()
    deftransform dequantize(qw, opts \\ []) do
      opts = Keyword.validate!(opts, type: nil)
      qw = weight!(qw, "dequantize")
      type = out_type!(opts[:type] || qw.type, "dequantize")

      struct = %Dequantize{
        mode: qw.mode,
        bits: qw.bits,
        group_size: qw.group_size,
        type: type,
        biases?: qw.biases != nil,
        global_scale?: qw.global_scale != nil
      }

      block(struct, weight_args(qw), Nx.template(qw.shape, type), &dequantize_default/2)
    end

    @doc """
    `dequantize/2` under the name a `defn` body reads well with: the same block, for
    quantized layers inside a forward pass (an Axon layer's kernel that is an
    `Emily.QuantizedWeight`).

        defn forward(x, qw), do: Nx.dot(x, Emily.Quantization.dequantize_defn(qw))
    """
    @spec dequantize_defn(QW.t()) :: Nx.Tensor.t()
    deftransform(dequantize_defn(qw), do: dequantize(qw))

    @doc """
    Rows of a quantized matrix (an embedding table `{rows, features}` quantized along
    its features): `Nx.take(dequantize(qw), indices, axis: 0)`, computed by gathering
    the packed rows and their scales first and dequantizing only those. The result has
    shape `indices.shape ++ {features}`. Works inside and outside `defn`.
    """
    @spec take(QW.t(), Nx.Tensor.t(), keyword) :: Nx.Tensor.t()
    deftransform take(qw, indices, opts \\ []) do
      opts = Keyword.validate!(opts, type: nil)
      qw = weight!(qw, "take")

      if tuple_size(qw.shape) != 2 do
        raise ArgumentError,
              "take: expected a quantized matrix (rank 2), got shape #{inspect(qw.shape)}"
      end

      %T{} = indices = Nx.to_tensor(indices)

      if not match?({k, _} when k in [:s, :u], indices.type) do
        raise ArgumentError, "take: expected integer indices, got #{inspect(indices.type)}"
      end

      rows = %{
        qw
        | value: Nx.take(qw.value, indices, axis: 0),
          scales: Nx.take(qw.scales, indices, axis: 0),
          biases: qw.biases && Nx.take(qw.biases, indices, axis: 0),
          shape: Tuple.insert_at(indices.shape, tuple_size(indices.shape), elem(qw.shape, 1))
      }

      dequantize(rows, opts)
    end

    ## Quantized matmul

    @doc """
    `x` times the quantized matrix `qw`: `x · dequantize(qw)ᵀ` (with `transpose: true`,
    the default: `qw` is `{n, k}`, quantized along the contracted axis `k`, as a
    linear layer's `{out, in}` weight) or `x · dequantize(qw)` (`transpose: false`:
    `qw` is `{k, n}`). `x` is `{..., k}`; the result `{..., n}`, in the floating
    type of `x` and `qw.type` merged.

    An `Nx.block/4`: on `Emily.Backend` and under `Emily.Compiler` (both paths) it runs
    MLX's `quantized_matmul` on the packed weight (for f16, bf16 and f32; `:nvfp4`
    with a global scale, and f64, dequantize and multiply there too); on any other
    backend it dequantizes and runs `Nx.dot/4`. The two agree within the bounds in the
    module documentation. Works inside and outside `defn`.

        iex> w = Nx.iota({64, 64}, type: :f32) |> Nx.divide(4096)
        iex> qw = Emily.Quantization.quantize(w, bits: 8)
        iex> y = Emily.Quantization.quantized_matmul(Nx.broadcast(1.0, {1, 64}), qw)
        iex> Nx.shape(y)
        {1, 64}
    """
    @spec quantized_matmul(Nx.Tensor.t(), QW.t(), keyword) :: Nx.Tensor.t()
    deftransform quantized_matmul(x, qw, opts \\ []) do
      opts = Keyword.validate!(opts, transpose: true)
      name = "quantized_matmul"
      qw = weight!(qw, name)
      x = Nx.to_tensor(x)
      transpose = opts[:transpose]

      if not is_boolean(transpose),
        do:
          raise(ArgumentError, "#{name}: :transpose must be a boolean, got #{inspect(transpose)}")

      if x.vectorized_axes != [],
        do: raise(ArgumentError, "#{name}: vectorized tensors are not supported")

      if tuple_size(qw.shape) != 2 do
        raise ArgumentError,
              "#{name}: expected a quantized matrix (rank 2), got shape #{inspect(qw.shape)}"
      end

      if tuple_size(x.shape) < 1 do
        raise ArgumentError, "#{name}: expected x of rank 1 or more, got a scalar"
      end

      {n, k} = if transpose, do: qw.shape, else: {elem(qw.shape, 1), elem(qw.shape, 0)}
      rank = tuple_size(x.shape)

      if elem(x.shape, rank - 1) != k do
        raise ArgumentError,
              "#{name}: x's last axis (#{elem(x.shape, rank - 1)} in #{inspect(x.shape)}) " <>
                "does not match the weight's contracted axis (#{k} in #{inspect(qw.shape)}, " <>
                "transpose: #{transpose})"
      end

      type = out_type!(Nx.Type.to_floating(Nx.Type.merge(x.type, qw.type)), name)

      struct = %QuantizedMatmul{
        mode: qw.mode,
        bits: qw.bits,
        group_size: qw.group_size,
        type: type,
        transpose: transpose,
        biases?: qw.biases != nil,
        global_scale?: qw.global_scale != nil
      }

      out = Nx.template(put_elem(x.shape, rank - 1, n), type)
      block(struct, [x | weight_args(qw)], out, &quantized_matmul_default/2)
    end

    ## Whole models

    @doc """
    Quantizes an Axon model and its parameters in one call: `{model, model_state}`
    with every dense layer's kernel (and, with `embeddings: true`, every embedding
    table) quantized, the others left as they are.

    A dense kernel `{in, units}` is stored as the quantized `{units, in}` transpose
    (quantized along `in`, the axis the product contracts, which MLX's kernel reads
    fastest) and multiplied by `quantized_matmul/3`; an embedding table `{vocab,
    features}` is quantized along its features and read by `take/3` (the packed rows
    first, then only those dequantized). Layers whose quantized axis the group size
    does not divide, and kernels that are not f16, bf16 or f32, stay in float.

    Options: `:mode`, `:bits`, `:group_size` and `:global_scale` as in `quantize/2`;

      * `:except` - names of layers to keep in float (an LM head, say; names as
        `Axon.properties/1` lists them). Default `[]`.
      * `:embeddings` - quantize embedding tables too (default `false`).
      * `:packed` - keep the weights packed and multiply them with MLX's quantized
        kernel (`true`), or dequantize them once, here, and keep the model's float
        layers (`false`). The default is `false` when Emily's default device is the
        CPU and `true` otherwise: on the CPU MLX's `quantized_matmul` runs on one
        thread, many times slower than a BLAS matmul of the same weights, so there
        the packed form saves memory and costs time. Either way the model computes
        with the quantized weights' values.

    With `packed: true` the dense and embedding layers are rewritten into
    `Emily.Quantization.Layers` (which take a packed or a float kernel, so layers
    left in float keep working); the result is for inference (packed codes have no
    gradient, and `Axon.ModelState`'s freezing and training helpers walk only plain
    tensors). With `packed: false` the model is returned unchanged and trains as any.

        {qmodel, qstate} = Emily.Quantization.quantize_model(model, state, bits: 4, except: ["lm_head"])
        Axon.predict(qmodel, qstate, inputs, compiler: Emily.Compiler)

    **Bumblebee models.** `quantize_model(model_info, opts)` takes the map
    `Bumblebee.load_model/2` returns and gives it back with its model and params
    quantized, for Bumblebee's servings with `Emily.Compiler`. Besides the dense
    layers it quantizes Bumblebee's `dense_transposed` layers (the LM heads, kernel
    `{vocab, hidden}`, quantized along `hidden`). `:except` takes a layer's name, a
    prefix ending at a dot (`"decoder.blocks.0"`: that block's layers) or a regex:

        {:ok, model_info} = Bumblebee.load_model({:hf, "Qwen/Qwen3-0.6B"})
        model_info = Emily.Quantization.quantize_model(model_info,
          bits: 4, embeddings: true, except: ["language_modeling_head"])

    Norms, biases and Bumblebee's other parameters stay in float. On the tiny Qwen3
    and Llama of the conformance suite (`group_size: 32`), 8-bit greedy generation
    gives Transformers' float tokens (12 of 12 for each prompt) and 4-bit logits are
    within 0.35 of the float logits in relative norm (`‖Δ‖ / ‖logits‖`; 0.27 and 0.10
    measured, 0.41 and 0.12 with `embeddings: true`, bound 0.55): each 4-bit matmul
    adds about 0.09 (the table in the module documentation) and the logits pass through nine in series,
    which compound to about `0.09 · √9`.

    Needs Axon (a dependency of your project, not of Emily).
    """
    @spec quantize_model(struct, struct, keyword) :: {struct, struct}
    def quantize_model(model, model_state, opts \\ []),
      do: Emily.Quantization.Model.quantize(model, model_state, opts)

    @doc """
    Loads an mlx-lm quantized checkpoint into the Bumblebee model of its architecture:
    `{:ok, %{model: model, params: params, spec: spec}}`, as `Bumblebee.load_model/2`
    gives, for Bumblebee's servings (`Bumblebee.Text.generation/4` and the others)
    with `Emily.Compiler`. The packed weights are read as they are: no float copy of
    them is made on the way (with `packed: false`, the CPU rule's default, they are
    dequantized once, after reading).

    `repository` is a local directory (a path, or `{:local, path}`) holding what
    `mlx_lm.convert -q` writes (or an `mlx-community` repository, downloaded):
    `config.json` with its `quantization` entry (the global `bits`, `group_size` and
    `mode`, and the per-layer entries of mlx-lm's mixed recipes) and safetensors
    whose quantized layers are `<layer>.weight` (packed `u32` codes), `<layer>.scales`
    and, in the affine mode, `<layer>.biases`. Each such layer becomes an
    `Emily.QuantizedWeight` in the params, in the layout MLX's kernels read (a linear
    layer's `{out, in}`, an embedding's `{vocab, features}`), and its Bumblebee layer
    is rewritten as in `quantize_model/3`; a tied LM head shares the embedding's
    weight, as in mlx-lm. Every other parameter (norms, biases, layers left in float)
    loads as `Bumblebee.load_model/2` loads it.

    Tested on mlx-lm's conversions of Qwen3 and Llama (affine 4- and 8-bit and the
    `mixed_4_6` recipe, f32 and bf16): from f32 checkpoints, logits within 1.0e-4 of
    the largest of mlx-lm's (2e-6 measured) and the same greedy tokens; from bf16,
    within 6.0e-2 of it (mlx-lm computes in bf16). Other architectures whose quantized
    layers Bumblebee maps one tensor to one dense or embedding layer load the same
    way; a checkpoint with a quantized tensor that no such layer reads raises.

    Options:

      * `:packed` - as in `quantize_model/3`: keep the weights packed (`true`, the
        default off the CPU) or dequantize them once, here, into the model's float
        layers (`false`, the default where Emily's default device is the CPU).
      * `:type` - the float type of the model's parameters and computation, as
        `Bumblebee.load_model/2` takes it (the scales and biases are cast to it);
        default f32, as Bumblebee loads a bf16 checkpoint.
      * `:spec`, `:spec_overrides`, `:module`, `:architecture`, `:backend`,
        `:log_params_diff` - as `Bumblebee.load_model/2` takes them.

    Load the tokenizer and generation config from the same directory with
    `Bumblebee.load_tokenizer/2` and `Bumblebee.load_generation_config/2`.

        {:ok, model_info} = Emily.Quantization.load_mlx("Qwen3-0.6B-4bit", type: :bf16)
        {:ok, tokenizer} = Bumblebee.load_tokenizer({:local, "Qwen3-0.6B-4bit"})
        {:ok, config} = Bumblebee.load_generation_config({:local, "Qwen3-0.6B-4bit"})
        serving = Bumblebee.Text.generation(model_info, tokenizer, config,
          defn_options: [compiler: Emily.Compiler])

    Needs Bumblebee (a dependency of your project, not of Emily). Returns `{:error,
    reason}` for a directory without a readable config (or without its
    `quantization` entry) or weights, and raises `ArgumentError` for quantized
    weights that do not make a matrix of their stated bits and group size, or that
    no layer of the model reads.
    """
    @spec load_mlx(Path.t() | {:local, Path.t()}, keyword) :: {:ok, map} | {:error, String.t()}
    def load_mlx(repository, opts \\ []),
      do: Emily.Quantization.MLXCheckpoint.load(repository, opts)

    ## Defaults (any backend)

    defp dequantize_default(%Dequantize{type: type} = s, args),
      do: s |> from_args(args) |> decode(type)

    # The weight is dequantized to the result type and the product computed there, as
    # MLX's kernel does.
    defp quantized_matmul_default(%QuantizedMatmul{type: type} = s, [x | args]) do
      w = s |> from_args(args) |> decode(type)
      contract = if s.transpose, do: 1, else: 0
      Nx.dot(Nx.as_type(x, type), [tuple_size(x.shape) - 1], w, [contract])
    end

    # A QuantizedWeight made of a block's arguments.
    defp from_args(s, [value, scales | rest]) do
      {biases, rest} = if s.biases?, do: {hd(rest), tl(rest)}, else: {nil, rest}
      global = if s.global_scale?, do: hd(rest)
      rank = tuple_size(value.shape)
      k = div(elem(value.shape, rank - 1) * 32, s.bits)

      %QW{
        value: value,
        scales: scales,
        biases: biases,
        global_scale: global,
        mode: s.mode,
        bits: s.bits,
        group_size: s.group_size,
        shape: put_elem(value.shape, rank - 1, k),
        type: s.type
      }
    end

    # The weight in `type`, from its codes, rounded as MLX's kernels round: affine as
    # code * scale, then + bias, each in `type`; the fp modes in f32 (their values are
    # exact there; nvfp4's global scale is not), then cast.
    defp decode(%QW{shape: shape, group_size: gs} = qw, type) do
      rank = tuple_size(shape)
      k = elem(shape, rank - 1)
      grouped = Tuple.insert_at(put_elem(shape, rank - 1, div(k, gs)), rank, gs)
      codes = unpack(qw.value, qw.bits, k) |> Nx.reshape(grouped)

      w =
        case qw.mode do
          :affine ->
            codes
            |> Nx.as_type(type)
            |> Nx.multiply(Nx.new_axis(Nx.as_type(qw.scales, type), -1))
            |> Nx.add(Nx.new_axis(Nx.as_type(qw.biases, type), -1))

          :mxfp4 ->
            Nx.multiply(e2m1(codes), Nx.new_axis(e8m0(qw.scales), -1))

          :mxfp8 ->
            Nx.multiply(e4m3(codes), Nx.new_axis(e8m0(qw.scales), -1))

          :nvfp4 ->
            scales = e4m3(qw.scales)

            scales =
              if qw.global_scale,
                do: Nx.multiply(scales, Nx.divide(Nx.as_type(qw.global_scale, :f32), 448 * 6)),
                else: scales

            Nx.multiply(e2m1(codes), Nx.new_axis(scales, -1))
        end

      w |> Nx.reshape(shape) |> Nx.as_type(type)
    end

    # The `bits`-wide codes of each row of packed words, as u32, `k` per row: element i
    # of a row is bits [i * bits, (i + 1) * bits) of the row's little-endian bit stream.
    defp unpack(value, bits, k) do
      rank = tuple_size(value.shape)
      lead = Tuple.delete_at(value.shape, rank - 1)
      mask = 2 ** bits - 1

      if rem(32, bits) == 0 do
        shifts = Nx.multiply(Nx.iota({div(32, bits)}, type: {:u, 32}), bits)

        value
        |> Nx.new_axis(-1)
        |> Nx.right_shift(shifts)
        |> Nx.bitwise_and(mask)
        |> Nx.reshape(Tuple.insert_at(lead, rank - 1, k))
      else
        # Codes that straddle two words: read each from the 64 bits of its word and
        # the next.
        pos = Nx.multiply(Nx.iota({k}, type: {:u, 64}), bits)
        word = Nx.quotient(pos, 32)
        shift = Nx.remainder(pos, 32)
        pad = List.duplicate({0, 0, 0}, rank - 1) ++ [{0, 1, 0}]
        words = value |> Nx.as_type({:u, 64}) |> Nx.pad(0, pad)
        lo = Nx.take(words, word, axis: rank - 1)
        hi = Nx.take(words, Nx.add(word, 1), axis: rank - 1)

        lo
        |> Nx.bitwise_or(Nx.left_shift(hi, 32))
        |> Nx.right_shift(shift)
        |> Nx.bitwise_and(mask)
        |> Nx.as_type({:u, 32})
      end
    end

    # FP4 E2M1 codes (sign in bit 3): 0, 0.5, 1, 1.5, 2, 3, 4, 6.
    defp e2m1(codes) do
      e = codes |> Nx.right_shift(1) |> Nx.bitwise_and(3) |> Nx.as_type(:f32)
      m = codes |> Nx.bitwise_and(1) |> Nx.as_type(:f32)
      normal = Nx.multiply(Nx.pow(2.0, Nx.subtract(e, 1)), Nx.add(1, Nx.multiply(m, 0.5)))
      mag = Nx.select(Nx.equal(e, 0), Nx.multiply(m, 0.5), normal)
      Nx.select(Nx.bitwise_and(codes, 8), Nx.negate(mag), mag)
    end

    # FP8 E4M3 (no infinities; 0x7F and 0xFF are NaN).
    defp e4m3(codes) do
      codes = Nx.as_type(codes, {:u, 32})
      e = codes |> Nx.right_shift(3) |> Nx.bitwise_and(15)
      m = codes |> Nx.bitwise_and(7) |> Nx.as_type(:f32)
      ef = Nx.as_type(e, :f32)
      normal = Nx.multiply(Nx.add(m, 8), Nx.pow(2.0, Nx.subtract(ef, 10)))
      mag = Nx.select(Nx.equal(e, 0), Nx.multiply(m, 2.0 ** -9), normal)
      nan? = Nx.logical_and(Nx.equal(e, 15), Nx.equal(m, 7))
      mag = Nx.select(nan?, :nan, mag)
      Nx.select(Nx.bitwise_and(codes, 128), Nx.negate(mag), mag)
    end

    # E8M0 scales: 2^(code - 127).
    defp e8m0(codes), do: Nx.pow(2.0, Nx.subtract(Nx.as_type(codes, :f32), 127))

    ## Emily.Backend and the native path

    @doc false
    # How Emily computes a block natively: `{op, args}`, the `Emily.Native` op and its
    # arguments after the stream, `{:arg, i, type}` standing for the block's i-th
    # argument cast to `type` (as Emily.Fast.native_call/3); `nil` where the block runs
    # its default. Shared by Emily.Backend and Emily.Compiler's native path.
    @spec native_call(struct, Nx.Tensor.t(), [Nx.Tensor.t()]) :: {atom, list} | nil
    def native_call(%Dequantize{} = s, %T{type: type}, [_value, scales | _])
        when type in @float_types do
      scales_type = if s.mode == :affine, do: type, else: scales.type
      {biases, global} = extras(s, 2, type)
      mode = Atom.to_string(s.mode)

      {:dequantize,
       [
         {:arg, 0, {:u, 32}},
         {:arg, 1, scales_type},
         biases,
         s.group_size,
         s.bits,
         mode,
         global,
         type
       ]}
    end

    # MLX's quantized_matmul has no global scale: nvfp4 with one runs the default.
    def native_call(%QuantizedMatmul{global_scale?: false} = s, %T{type: type}, _args)
        when type in @float_types do
      scales_type = if s.mode == :affine, do: type, else: {:u, 8}
      {biases, nil} = extras(s, 3, type)

      {:quantized_matmul,
       [
         {:arg, 0, type},
         {:arg, 1, {:u, 32}},
         {:arg, 2, scales_type},
         biases,
         s.transpose,
         s.group_size,
         s.bits,
         Atom.to_string(s.mode)
       ]}
    end

    def native_call(_struct, _out, _args), do: nil

    # The biases' and global scale's argument specs, the biases at position `at`.
    defp extras(s, at, biases_type) do
      biases = if s.biases?, do: {:arg, at, biases_type}
      at = if s.biases?, do: at + 1, else: at
      global = if s.global_scale?, do: {:arg, at, {:f, 32}}
      {biases, global}
    end

    ## Helpers

    defp weight_args(%QW{} = qw),
      do: Enum.reject([qw.value, qw.scales, qw.biases, qw.global_scale], &is_nil/1)

    defp weight!(%QW{value: %T{}, scales: %T{}} = qw, _name), do: qw

    defp weight!(other, name) do
      raise ArgumentError,
            "#{name}: expected an Emily.QuantizedWeight (see Emily.Quantization.quantize/2), " <>
              "got #{inspect(other)}"
    end

    defp out_type!(type, name) do
      type = Nx.Type.normalize!(type)

      if type in [{:f, 64} | @float_types],
        do: type,
        else:
          raise(ArgumentError, "#{name}: expected a floating-point type, got #{inspect(type)}")
    end

    # Nx.block/4's default fun takes the struct and then each argument: `impl` takes the
    # struct and the list of arguments.
    defp block(struct, args, out, impl) do
      fun =
        case args do
          [_, _] -> fn s, a, b -> impl.(s, [a, b]) end
          [_, _, _] -> fn s, a, b, c -> impl.(s, [a, b, c]) end
          [_, _, _, _] -> fn s, a, b, c, d -> impl.(s, [a, b, c, d]) end
        end

      Nx.block(struct, args, out, fun)
    end
  end
end
