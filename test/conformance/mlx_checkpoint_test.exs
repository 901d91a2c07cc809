# Conformance: mlx-lm quantized checkpoints (scripts/mlx_lm_models.py: mlx_lm.convert on the
# tiny Qwen3 and Llama, 4- and 8-bit, f32 and bf16, and the mixed_4_6 recipe) loaded by
# Emily.Quantization.load_mlx/2 straight into Bumblebee's models, against mlx-lm's own
# logits and greedy tokens, packed and dequantized at load, on both of Emily.Compiler's
# paths, with no fallback; the text-generation serving; malformed checkpoints. Run with
# `mix test --only conformance` where Bumblebee is available.
if Code.ensure_loaded?(Bumblebee) do
  defmodule Emily.Conformance.MLXCheckpointTest do
    use ExUnit.Case, async: false
    @moduletag :conformance
    @moduletag timeout: 600_000

    import Emily.Conformance
    alias Emily.Quantization, as: Q
    alias Emily.QuantizedWeight, as: QW

    @root Path.expand("models", __DIR__)
    @paths [
      native: [compiler: Emily.Compiler],
      evaluator: [compiler: Emily.Compiler, native: false]
    ]

    # f32 checkpoints: Emily runs MLX's kernels (quantized_matmul, dequantize, gather) on
    # the same codes, so it meets the suite's f32 bound (1.0e-4 of the largest logit;
    # 2e-6 measured). The bf16 one: mlx-lm computes in bf16, Emily in f32 (Bumblebee's
    # default type) or bf16: the suite's bf16 bound (6.0e-2; 0.026 to 0.041 measured).
    @checkpoints [
      {"qwen3_mlx_q4", :f32},
      {"qwen3_mlx_q8", :f32},
      {"qwen3_mlx_q4_bf16", :bf16},
      {"llama_mlx_q4", :f32},
      {"llama_mlx_q8", :f32},
      {"llama_mlx_mixed_4_6", :f32}
    ]

    setup do
      use_emily()
    end

    defp dir(name), do: Path.join(@root, name)

    defp load_mlx!(name, opts) do
      {{:ok, info}, log} =
        ExUnit.CaptureLog.with_log([level: :debug], fn ->
          Q.load_mlx(dir(name), [log_params_diff: true] ++ opts)
        end)

      # Bumblebee lists every parameter it could not load, or that the checkpoint had
      # and no layer read; there are none.
      refute log =~ "parameters were", "#{name}: #{log}"
      info
    end

    defp generate_with(%{model: model, params: params, spec: spec}, config, ids, defn_opts) do
      fun = Bumblebee.Text.Generation.build_generate(model, spec, config)

      inputs = %{
        "input_ids" => Nx.tensor([ids]),
        "attention_mask" => Nx.broadcast(1, {1, length(ids)}),
        "seed" => Nx.tensor([0])
      }

      %{token_ids: ids} = Nx.Defn.jit(fun, defn_opts).(params, inputs)
      ids |> Nx.to_list() |> hd()
    end

    # The layers rewritten into Emily's quantized ones.
    defp quantized_layers(%{model: model}) do
      Axon.reduce_nodes(model, 0, fn
        %{op: op}, n when is_function(op) ->
          if Function.info(op)[:module] == Emily.Quantization.Layers, do: n + 1, else: n

        _node, n ->
          n
      end)
    end

    defp kernels(%{params: %{data: data}}),
      do: for({layer, %{"kernel" => k}} <- data, into: %{}, do: {layer, k})

    for {name, type} <- @checkpoints, packed <- [true, false], {path, _} <- @paths do
      @tag name: name, type: type, packed: packed, path: path
      test "#{name}: mlx-lm's logits and greedy tokens, packed: #{packed}, #{path}", ctx do
        %{name: name, type: type, packed: packed, path: path} = ctx
        f = fixture(name)
        info = load_mlx!(name, packed: packed)
        assert info.spec.__struct__ == load(f["base"]).spec.__struct__
        defn_opts = @paths[path]

        out =
          refute_fallback(fn ->
            Axon.predict(
              info.model,
              info.params,
              %{"input_ids" => Nx.tensor([hd(f["prompt_ids"])])},
              defn_opts
            )
          end)

        assert_close(out.logits, f["logits"], tolerance(type), "logits")

        {:ok, config} = Bumblebee.load_generation_config({:local, dir(name)})
        config = Bumblebee.configure(config, max_new_tokens: f["max_new_tokens"])

        for {ids, argmax, expected} <-
              Enum.zip([f["prompt_ids"], f["logits_argmax"], f["generated_ids"]]) do
          logits =
            Axon.predict(info.model, info.params, %{"input_ids" => Nx.tensor([ids])}, defn_opts).logits

          assert Nx.to_list(Nx.argmax(logits, axis: -1)) == argmax

          assert refute_fallback(fn -> generate_with(info, config, ids, defn_opts) end) ==
                   expected
        end
      end
    end

    test "the quantized layers load packed, as the checkpoint states them, at a fraction of the float size" do
      float = load("llama")
      mixed = load_mlx!("llama_mlx_mixed_4_6", packed: true)
      q = kernels(mixed)

      # mlx-lm's {out, in} layout, the one Emily's quantized layers read.
      assert %QW{bits: 4, group_size: 32, mode: :affine, shape: {64, 32}, type: {:f, 32}} =
               q["decoder.blocks.0.ffn.intermediate"]

      assert %QW{bits: 4, shape: {437, 32}} = q["embedder.token_embedding"]
      # The mixed recipe's 6-bit layers, from their own entries of config.json.
      assert %QW{bits: 6, shape: {32, 64}} = q["decoder.blocks.1.ffn.output"]
      assert %QW{bits: 6, shape: {8, 32}} = q["decoder.blocks.1.self_attention.value"]
      assert %QW{bits: 6, shape: {437, 32}} = q["language_modeling_head.output"]
      assert %Nx.Tensor{} = mixed.params.data["output_norm"]["weight"]
      # 14 dense layers, the embedding and the head
      assert quantized_layers(mixed) == 16

      quantized = q |> Map.values() |> Enum.map(&QW.byte_size/1) |> Enum.sum()
      f32 = float |> kernels() |> Map.values() |> Enum.map(&Nx.byte_size/1) |> Enum.sum()
      # 4 bits (6 for some), and f32 scales and biases per group of 32 add 2: under a fifth.
      assert quantized < 0.21 * f32

      # Qwen3's tied head reads the embedding's codes, one weight for both.
      qwen3 = load_mlx!("qwen3_mlx_q4", packed: true)

      assert qwen3.params.data["language_modeling_head.output"]["kernel"] ==
               qwen3.params.data["embedder.token_embedding"]["kernel"]

      # The CPU rule: dequantized at load, into the float layers of Bumblebee's model.
      dequantized = load_mlx!("llama_mlx_mixed_4_6", packed: false)
      assert quantized_layers(dequantized) == 0
      k = kernels(dequantized)
      assert %Nx.Tensor{shape: {32, 64}} = k["decoder.blocks.0.ffn.intermediate"]

      assert Nx.to_flat_list(k["decoder.blocks.1.ffn.output"]) ==
               Nx.to_flat_list(Nx.transpose(Q.dequantize(q["decoder.blocks.1.ffn.output"])))
    end

    test "bf16: the model in bf16, scales and biases as the checkpoint has them" do
      name = "qwen3_mlx_q4_bf16"
      f = fixture(name)

      for packed <- [true, false] do
        info = load_mlx!(name, packed: packed, type: :bf16)
        kernel = info.params.data["decoder.blocks.0.ffn.gate"]["kernel"]

        if packed do
          assert %QW{type: {:bf, 16}, scales: %{type: {:bf, 16}}} = kernel
        else
          assert %Nx.Tensor{type: {:bf, 16}} = kernel
        end

        for {path, defn_opts} <- @paths do
          out =
            refute_fallback(fn ->
              Axon.predict(
                info.model,
                info.params,
                %{"input_ids" => Nx.tensor([hd(f["prompt_ids"])])},
                defn_opts
              )
            end)

          assert out.logits.type == {:bf, 16}
          assert_close(out.logits, f["logits"], tolerance(:bf16), "#{path}, packed: #{packed}")
        end
      end
    end

    test "text-generation serving of an mlx-lm checkpoint: inline, batched and partitioned" do
      name = "qwen3_mlx_q4"
      f = fixture(name)
      info = load_mlx!(name, packed: true)
      {:ok, tokenizer} = Bumblebee.load_tokenizer({:local, dir(name)})
      {:ok, config} = Bumblebee.load_generation_config({:local, dir(name)})
      config = Bumblebee.configure(config, max_new_tokens: f["max_new_tokens"])

      build =
        &Bumblebee.Text.generation(info, tokenizer, config,
          compile: [batch_size: 4, sequence_length: 8],
          defn_options: &1
        )

      prompts = f["base"] |> fixture() |> Map.fetch!("prompts")
      texts = Enum.map(f["generated_ids"], &Bumblebee.Tokenizer.decode(tokenizer, &1))
      prompts = prompts ++ Enum.take(prompts, 2)
      expected = texts ++ Enum.take(texts, 2)

      for {how, results} <- refute_fallback(fn -> serve(build, prompts) end) do
        got = for %{results: [%{text: text}]} <- List.wrap(results), do: text
        assert got == expected, "#{how}: #{inspect(got)}"
      end
    end

    @tag :tmp_dir
    test "checkpoints load_mlx refuses, and why", %{tmp_dir: tmp} do
      # A float checkpoint: no quantization entry.
      assert {:error, message} = Q.load_mlx(Path.join(@root, "qwen3"))
      assert message =~ ~s(no "quantization" entry)

      assert {:error, message} = Q.load_mlx(Path.join(tmp, "absent"))
      assert message =~ "could not read"

      assert_raise ArgumentError, ~r/a local checkpoint directory/, fn ->
        Q.load_mlx({:hf, "mlx-community/Qwen3-0.6B-4bit"})
      end

      # The config's bits disagree with the codes' width.
      copy = fn dest, edit ->
        File.cp_r!(dir("llama_mlx_q4"), dest)
        config = Path.join(dest, "config.json")

        File.write!(
          config,
          config |> File.read!() |> Jason.decode!() |> edit.() |> Jason.encode!()
        )

        dest
      end

      wrong_bits = copy.(Path.join(tmp, "bits"), &put_in(&1, ["quantization", "bits"], 8))

      assert_raise ArgumentError, ~r/do not make a 8-bit, group 32 affine matrix/, fn ->
        Q.load_mlx(wrong_bits)
      end

      unknown = copy.(Path.join(tmp, "mode"), &put_in(&1, ["quantization", "mode"], "int3"))

      assert_raise ArgumentError, ~r/unknown quantization mode "int3"/, fn ->
        Q.load_mlx(unknown)
      end

      # A quantized tensor no layer of the Bumblebee model reads.
      extra = copy.(Path.join(tmp, "extra"), & &1)
      weights = Path.join(extra, "model.safetensors")
      tensors = Safetensors.read!(weights)
      prefix = "model.layers.0.mlp.down_proj"

      tensors =
        for suffix <- ["weight", "scales", "biases"], into: tensors do
          {"model.layers.0.mlp.extra_proj." <> suffix, tensors["#{prefix}.#{suffix}"]}
        end

      File.rm!(Path.join(extra, "model.safetensors.index.json"))
      Safetensors.write!(weights, tensors)

      assert_raise ArgumentError,
                   ~r/reads the quantized weights model.layers.0.mlp.extra_proj/,
                   fn ->
                     Q.load_mlx(extra)
                   end
    end
  end
else
  defmodule Emily.Conformance.MLXCheckpointTest do
    use ExUnit.Case, async: true
    @moduletag :conformance
    require Emily.NxAbsent
    Emily.NxAbsent.placeholders()
  end
end
