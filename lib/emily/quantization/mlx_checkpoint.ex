if Code.ensure_loaded?(Nx) do
  defmodule Emily.Quantization.MLXCheckpoint do
    @moduledoc false
    # Emily.Quantization.load_mlx/2: an mlx-lm quantized checkpoint into the Bumblebee
    # model of its architecture. Bumblebee, Axon and Safetensors are the user's
    # dependencies, not Emily's.
    @compile {:no_warn_undefined,
              [
                Axon,
                Bumblebee,
                Bumblebee.Conversion.PyTorchParams,
                Bumblebee.HuggingFace.Transformers.Model,
                Jason,
                Safetensors
              ]}

    alias Emily.Quantization, as: Q
    alias Emily.QuantizedWeight, as: QW

    # The layers whose kernel a quantized tensor of mlx-lm can be: its QuantizedLinear
    # (Axon's dense; Bumblebee's dense_transposed LM heads) and QuantizedEmbedding.
    @ops [:dense, :dense_transposed, :embedding]

    def load(repository, opts) do
      opts =
        Keyword.validate!(opts, [
          :spec,
          :spec_overrides,
          :module,
          :architecture,
          :type,
          :backend,
          :log_params_diff,
          :packed
        ])

      for dep <- [Bumblebee, Safetensors], not Code.ensure_loaded?(dep) do
        raise ArgumentError,
              "load_mlx: needs #{inspect(dep)} (add :bumblebee to your dependencies)"
      end

      packed? = Emily.Quantization.Model.packed?(opts[:packed])
      dir = dir!(repository)

      with {:ok, config} <- read_json(Path.join(dir, "config.json")),
           {:ok, quantization} <- quantization(config, dir),
           {:ok, spec} <- spec(dir, opts),
           {:ok, paths} <- params_paths(dir) do
        model = Bumblebee.build_model(spec, Keyword.take(opts, [:type]))

        tensors =
          paths |> Enum.map(&Safetensors.read!(&1, lazy: true)) |> Enum.reduce(&Map.merge/2)

        quantized = quantized!(tensors, quantization)
        mapping = Bumblebee.HuggingFace.Transformers.Model.params_mapping(spec)
        layers = layers!(model, mapping, quantized)

        state =
          Bumblebee.Conversion.PyTorchParams.load_params!(
            model,
            spec.__struct__.input_template(spec),
            paths,
            [
              params_mapping: mapping,
              loader_fun: &stand_ins(Safetensors.read!(&1, lazy: true), quantized)
            ] ++ Keyword.take(opts, [:backend, :log_params_diff])
          )

        state = put_weights(state, layers, quantized, packed?, opts[:backend])

        model =
          if packed? and layers != [], do: Emily.Quantization.Model.rewrite(model), else: model

        {:ok, %{model: model, params: state, spec: spec}}
      end
    end

    defp dir!({:local, dir}) when is_binary(dir), do: dir
    defp dir!(dir) when is_binary(dir), do: dir

    defp dir!(other) do
      raise ArgumentError,
            "load_mlx: expected a local checkpoint directory (a path or {:local, path}), got " <>
              "#{inspect(other)}; download a Hugging Face repository first (for example " <>
              "with `hf download`)"
    end

    defp read_json(path) do
      with {:ok, binary} <- File.read(path) |> error("could not read #{path}"),
           {:ok, json} <- Jason.decode(binary) |> error("could not decode #{path}") do
        {:ok, json}
      end
    end

    defp error({:error, reason}, message), do: {:error, "#{message}: #{inspect(reason)}"}
    defp error(ok, _message), do: ok

    defp quantization(%{"quantization" => %{} = q}, _dir), do: {:ok, q}

    defp quantization(_config, dir) do
      {:error,
       "#{dir}/config.json has no \"quantization\" entry: not an mlx-lm quantized " <>
         "checkpoint (load a float one with Bumblebee.load_model/2)"}
    end

    defp spec(dir, opts) do
      result =
        if spec = opts[:spec],
          do: {:ok, spec},
          else: Bumblebee.load_spec({:local, dir}, Keyword.take(opts, [:module, :architecture]))

      case {result, opts[:spec_overrides]} do
        {{:ok, spec}, overrides} when overrides != nil ->
          {:ok, Bumblebee.configure(spec, overrides)}

        {result, _} ->
          result
      end
    end

    # One model.safetensors, or the shards its index names.
    defp params_paths(dir) do
      index = Path.join(dir, "model.safetensors.index.json")
      single = Path.join(dir, "model.safetensors")

      cond do
        File.exists?(index) ->
          with {:ok, %{"weight_map" => map}} <- read_json(index) do
            {:ok,
             map |> Map.values() |> Enum.uniq() |> Enum.sort() |> Enum.map(&Path.join(dir, &1))}
          end

        File.exists?(single) ->
          {:ok, [single]}

        true ->
          {:error, "#{dir} has no model.safetensors (nor its index)"}
      end
    end

    # `prefix => %{weight, scales, biases, mode, bits, group_size, shape}` for every
    # quantized tensor of the checkpoint (one with `<prefix>.scales`), its settings from
    # its own entry of `quantization` (mlx-lm's mixed recipes) or the global ones.
    defp quantized!(tensors, quantization) do
      for {key, scales} <- tensors,
          String.ends_with?(key, ".scales"),
          prefix = String.replace_suffix(key, ".scales", ""),
          into: %{} do
        settings =
          case quantization[prefix] do
            %{} = own -> own
            _ -> quantization
          end

        weight =
          tensors[prefix <> ".weight"] ||
            raise ArgumentError, "load_mlx: #{key} has no #{prefix}.weight beside it"

        {prefix, describe!(prefix, weight, scales, tensors[prefix <> ".biases"], settings)}
      end
    end

    defp describe!(prefix, weight, scales, biases, settings) do
      mode = mode!(prefix, settings["mode"] || "affine")
      %{bits: bits_list, group_sizes: gs_list} = Q.modes()[mode]
      bits = settings["bits"]
      gs = settings["group_size"]

      if bits not in bits_list or gs not in gs_list do
        raise ArgumentError,
              "load_mlx: #{prefix}: mode #{mode} takes bits #{inspect(bits_list)} and group " <>
                "sizes #{inspect(gs_list)}, the checkpoint says bits #{inspect(bits)}, group " <>
                "size #{inspect(gs)}"
      end

      {rows, words} =
        case weight do
          %{type: {:u, 32}, shape: {rows, words}} ->
            {rows, words}

          %{type: type, shape: shape} ->
            raise ArgumentError,
                  "load_mlx: #{prefix}.weight is #{inspect(type)} #{inspect(shape)}, expected " <>
                    "packed u32 codes of a matrix"
        end

      cols = div(words * 32, bits)

      if rem(words * 32, bits) != 0 or scales.shape != {rows, div(cols, gs)} or
           (biases != nil and biases.shape != scales.shape) or mode == :affine != (biases != nil) do
        raise ArgumentError,
              "load_mlx: #{prefix}: codes #{inspect(weight.shape)}, scales " <>
                "#{inspect(scales.shape)} and biases #{inspect(biases && biases.shape)} do not " <>
                "make a #{bits}-bit, group #{gs} #{mode} matrix"
      end

      %{
        weight: weight,
        scales: scales,
        biases: biases,
        mode: mode,
        bits: bits,
        group_size: gs,
        shape: {rows, cols}
      }
    end

    defp mode!(prefix, mode) do
      Enum.find(Map.keys(Q.modes()), &(Atom.to_string(&1) == mode)) ||
        raise ArgumentError, "load_mlx: #{prefix}: unknown quantization mode #{inspect(mode)}"
    end

    # `[{layer, op, prefix}]`: the Bumblebee layer each quantized tensor is the kernel of,
    # by the spec's params mapping (a layer name or template to the checkpoint's layer
    # name, or a list of names to try). Every quantized tensor must find its layer (a
    # tied LM head shares the embedding's): one that Bumblebee would build from several
    # tensors, or read for another kind of layer, cannot be loaded packed.
    defp layers!(model, mapping, quantized) do
      layers =
        for {name, op} <- Axon.properties(model),
            op in @ops,
            prefix = Enum.find(sources(name, mapping), &Map.has_key?(quantized, &1)),
            do: {name, op, prefix}

      claimed = MapSet.new(layers, &elem(&1, 2))

      case Enum.reject(Map.keys(quantized), &MapSet.member?(claimed, &1)) do
        [] ->
          layers

        left ->
          raise ArgumentError,
                "load_mlx: no dense or embedding layer of the Bumblebee model reads the " <>
                  "quantized weights #{Enum.join(Enum.sort(left), ", ")}"
      end
    end

    defp sources(name, mapping) do
      source =
        case mapping do
          %{^name => source} ->
            source

          mapping ->
            Enum.find_value(mapping, fn {template, source} ->
              if subs = match(template, name), do: fill(source, subs)
            end)
        end

      case source do
        source when is_binary(source) -> [source]
        sources when is_list(sources) -> Enum.filter(sources, &is_binary/1)
        _ -> []
      end
    end

    # A template's `{n}` placeholders each stand for one dot-free segment.
    defp match(template, name) do
      parts = Regex.split(~r/\{\w+\}/, template, include_captures: true)

      regex =
        Enum.map_join(parts, fn
          "{" <> _ = key -> "(?<#{String.trim(key, "{") |> String.trim("}")}>[^.]+)"
          text -> Regex.escape(text)
        end)

      Regex.named_captures(~r/^#{regex}$/, name)
    end

    defp fill(source, subs) when is_binary(source) do
      Regex.replace(~r/\{(\w+)\}/, source, fn whole, key -> Map.get(subs, key, whole) end)
    end

    defp fill(sources, subs) when is_list(sources), do: Enum.map(sources, &fill(&1, subs))
    defp fill(other, _subs), do: other

    # The state Bumblebee loads: each quantized tensor's codes replaced by a zero matrix
    # of the float weight's shape, a broadcast scalar (MLX allocates no more than one
    # element for it), so that Bumblebee loads every other parameter as it would and
    # checks the layer's shape. put_weights/5 then puts the quantized weight in its place.
    defp stand_ins(tensors, quantized) do
      Enum.reduce(quantized, tensors, fn {prefix, q}, tensors ->
        if Map.has_key?(tensors, prefix <> ".weight") do
          zero = Nx.tensor(0, type: float_type(q), backend: Emily.Backend)

          tensors
          |> Map.put(prefix <> ".weight", Nx.broadcast(zero, q.shape))
          |> Map.drop([prefix <> ".scales", prefix <> ".biases"])
        else
          tensors
        end
      end)
    end

    defp float_type(%{mode: :affine, scales: %{type: type}}), do: type
    defp float_type(_q), do: {:f, 32}

    defp put_weights(state, layers, quantized, packed?, backend) do
      with_backend(backend, fn ->
        {data, _shared} =
          Enum.reduce(layers, {state.data, %{}}, fn {name, op, prefix}, {data, shared} ->
            # The type Bumblebee gave the layer's float kernel (the :type option's, or f32).
            type = Nx.type(data[name]["kernel"])
            key = {prefix, type}
            qw = shared[key] || weight(quantized[prefix], type)
            kernel = if packed?, do: qw, else: dequantized(qw, op)
            {put_in(data, [name, "kernel"], kernel), Map.put(shared, key, qw)}
          end)

        %{state | data: data}
      end)
    end

    defp with_backend(nil, fun), do: fun.()
    defp with_backend(backend, fun), do: Nx.with_default_backend(backend, fun)

    defp weight(q, type) do
      cast = fn
        nil -> nil
        t when q.mode == :affine -> t |> Nx.to_tensor() |> Nx.as_type(type)
        t -> Nx.to_tensor(t)
      end

      %QW{
        value: Nx.to_tensor(q.weight),
        scales: cast.(q.scales),
        biases: cast.(q.biases),
        mode: q.mode,
        bits: q.bits,
        group_size: q.group_size,
        shape: q.shape,
        type: type
      }
    end

    # The CPU rule: the float kernel Bumblebee's layer takes, dequantized once here.
    defp dequantized(qw, :dense), do: qw |> Q.dequantize() |> Nx.transpose()
    defp dequantized(qw, _op), do: Q.dequantize(qw)
  end
end
