if Code.ensure_loaded?(Nx) do
  defmodule Emily.Quantization.Layers do
    @moduledoc """
    The Axon layers of a quantized model (see `Emily.Quantization.quantize_model/3`):
    each takes its kernel as an `Emily.QuantizedWeight` or as a plain tensor, so one
    rewritten model runs whichever layers its model state quantizes.
    """

    import Nx.Defn, only: [deftransform: 2]
    alias Emily.Quantization, as: Q

    @doc """
    A dense layer: `x · kernel + bias`. A quantized kernel holds the `{units, in}`
    transpose of the float kernel (quantized along `in`, the contracted axis) and
    runs `Emily.Quantization.quantized_matmul/3`; a tensor kernel runs `Nx.dot/2`, as
    `Axon.Layers.dense/4`.
    """
    deftransform dense(x, kernel, bias \\ 0, _opts \\ []) do
      dense_with(x, kernel, bias, 0)
    end

    @doc """
    Bumblebee's `dense_transposed` layer (its language-modelling heads): `x · kernelᵀ +
    bias`, the kernel `{units, in}`. A quantized kernel is that matrix quantized along
    `in` and runs `Emily.Quantization.quantized_matmul/3`; a tensor kernel runs
    `Nx.dot/4`.
    """
    deftransform dense_transposed(x, kernel, bias \\ 0, _opts \\ []) do
      dense_with(x, kernel, bias, 1)
    end

    # x · kernel (contracting the float kernel's axis `in_axis`) + bias; a quantized
    # kernel is always quantized along `in`. Axon passes an empty list for no bias.
    defp dense_with(x, kernel, bias, in_axis) do
      bias = if is_list(bias), do: 0, else: bias

      y =
        case kernel do
          %Emily.QuantizedWeight{} = qw -> Q.quantized_matmul(x, weight(qw))
          kernel -> Nx.dot(x, [Nx.rank(x) - 1], kernel, [in_axis])
        end

      Nx.add(y, bias)
    end

    @doc """
    An embedding layer: rows of the kernel by index. A quantized kernel (`{vocab,
    features}`, quantized along the features) gathers its packed rows and dequantizes
    only those (`Emily.Quantization.take/3`).
    """
    deftransform embedding(indices, kernel, opts \\ []) do
      _ = opts

      case kernel do
        %Emily.QuantizedWeight{} = qw -> Q.take(weight(qw), indices)
        kernel -> Nx.take(kernel, indices, axis: 0)
      end
    end

    # An Axon mixed-precision policy casts the float tensors of a parameter (an affine
    # weight's scales and biases) to its compute type: the weight then stands for that
    # type.
    defp weight(%Emily.QuantizedWeight{mode: :affine, scales: %{type: type}} = qw)
         when type != qw.type,
         do: %{qw | type: type}

    defp weight(qw), do: qw
  end

  defmodule Emily.Quantization.Model do
    @moduledoc false
    # Emily.Quantization.quantize_model/3: Axon is the user's dependency, not Emily's.
    @compile {:no_warn_undefined, [Axon, Axon.ModelState]}

    alias Emily.Quantization, as: Q
    alias Emily.Quantization.Layers

    # Layers whose kernel is a matrix the input is multiplied by: Axon's dense and
    # Bumblebee's dense_transposed (a kernel `{units, in}`, as its LM heads have).
    @dense_ops [:dense, :dense_transposed]

    @doc false
    # The CPU rule: packed unless the default device is the CPU, where MLX's quantized
    # kernel runs on one thread and BLAS on the float weights is faster.
    def packed?(nil), do: Emily.default_device() != :cpu
    def packed?(packed) when is_boolean(packed), do: packed

    def packed?(other),
      do: raise(ArgumentError, ":packed must be a boolean or nil, got #{inspect(other)}")

    # A layer is kept in float when its name is in :except, is under a name there (a
    # prefix ending at a dot: "decoder.blocks.0" keeps that block's layers) or matches
    # a regex there.
    defp except!(except) do
      Enum.map(List.wrap(except), fn
        %Regex{} = re ->
          re

        name when is_binary(name) or is_atom(name) ->
          to_string(name)

        other ->
          raise ArgumentError, ":except takes layer names and regexes, got #{inspect(other)}"
      end)
    end

    defp except?(except, name) do
      Enum.any?(except, fn
        %Regex{} = re -> Regex.match?(re, name)
        prefix -> name == prefix or String.starts_with?(name, prefix <> ".")
      end)
    end

    # A Bumblebee model (`Bumblebee.load_model/2`'s map): its model and params
    # quantized, the rest (the spec) kept.
    def quantize(%{model: %{__struct__: Axon} = model, params: state} = info, opts, [])
        when is_list(opts) do
      {model, state} = quantize(model, state, opts)
      %{info | model: model, params: state}
    end

    def quantize(model, %{__struct__: Axon.ModelState, data: data} = state, opts) do
      opts =
        Keyword.validate!(opts,
          mode: :affine,
          bits: nil,
          group_size: nil,
          global_scale: nil,
          except: [],
          embeddings: false,
          packed: nil
        )

      qopts = Keyword.take(opts, [:mode, :bits, :group_size, :global_scale])
      # Checks the options once, before any layer, and finds the group size.
      gs = Q.quantize(Nx.broadcast(0.0, {1, 128}), qopts).group_size
      packed? = packed?(opts[:packed])
      except = except!(opts[:except])
      ops = if opts[:embeddings], do: [:embedding | @dense_ops], else: @dense_ops

      chosen =
        for {name, op} <- Axon.properties(model),
            op in ops,
            not except?(except, name),
            kernel = get_in(data, [name, "kernel"]),
            quantizable?(kernel, op, gs),
            into: %{},
            do: {name, op}

      data =
        Enum.reduce(chosen, data, fn {name, op}, data ->
          update_in(data, [name, "kernel"], &convert(&1, op, qopts, packed?))
        end)

      state = %{state | data: data}

      if packed? and chosen != %{} do
        {rewrite(model), state}
      else
        {model, state}
      end
    end

    def quantize(_model, state, _opts) do
      raise ArgumentError,
            "quantize_model: expected an Axon.ModelState, got #{inspect(state)}"
    end

    # The group size must divide the axis quantized: a dense kernel's input (the first
    # axis of Axon's, the second of Bumblebee's transposed one), an embedding's features.
    defp quantizable?(%Nx.Tensor{type: type, shape: {a, b}}, op, gs)
         when type in [{:f, 16}, {:bf, 16}, {:f, 32}] do
      rem(if(op == :dense, do: a, else: b), gs) == 0
    end

    defp quantizable?(_kernel, _op, _gs), do: false

    defp convert(kernel, :dense, qopts, true), do: Q.quantize(Nx.transpose(kernel), qopts)

    defp convert(kernel, op, qopts, true) when op in [:embedding, :dense_transposed],
      do: Q.quantize(kernel, qopts)

    # Dequantized once, here: the model keeps its float layers (and BLAS), with the
    # quantized weights' values.
    defp convert(kernel, :dense, qopts, false) do
      kernel |> Nx.transpose() |> Q.quantize(qopts) |> Q.dequantize() |> Nx.transpose()
    end

    defp convert(kernel, op, qopts, false) when op in [:embedding, :dense_transposed],
      do: kernel |> Q.quantize(qopts) |> Q.dequantize()

    @doc false
    # The layers a packed kernel can reach, as Emily.Quantization.Layers (which take a
    # float kernel too). Bumblebee's dense_transposed takes its bias, when it has one,
    # as a third input: its arity says which.
    def rewrite(model) do
      Axon.map_nodes(model, fn
        %{op: :dense, meta: %{use_bias: false}} = node ->
          %{node | op: &Layers.dense/3}

        %{op: :dense} = node ->
          %{node | op: &Layers.dense/4}

        %{op: :embedding} = node ->
          %{node | op: &Layers.embedding/3}

        %{op_name: :dense_transposed, op: op} = node when is_function(op, 4) ->
          %{node | op: &Layers.dense_transposed/4}

        %{op_name: :dense_transposed, op: op} = node when is_function(op, 3) ->
          %{node | op: &Layers.dense_transposed/3}

        node ->
          node
      end)
    end
  end
end
