# Conformance: Emily.Compiler's fusion rewrites on the tiny Bumblebee models. Each
# model's forward pass (and Qwen3's and Whisper's generation loops) compiled with the
# rewrites reports, through the `[:emily, :compiler, :fusion]` telemetry, the fused
# kernels for each of its norms and attentions, and agrees with the same model compiled
# with `fuse: false` (the per-model suites compare the rewritten programs, the default,
# with Transformers). Run with `mix test --only conformance` where Bumblebee is
# available.
if Code.ensure_loaded?(Bumblebee) do
  defmodule Emily.Conformance.FusionTest do
    use ExUnit.Case, async: false
    @moduletag :conformance
    @moduletag timeout: 300_000

    import Emily.Conformance

    setup do
      use_emily()
    end

    # The rewrites the lowerings `fun` makes report (programs not cached, so that each is
    # lowered here), and what `fun` returns.
    defp fusions(fun) do
      parent = self()
      ref = make_ref()
      id = {__MODULE__, ref}

      :telemetry.attach(
        id,
        [:emily, :compiler, :fusion],
        &__MODULE__.forward/4,
        {parent, ref}
      )

      try do
        result = refute_fallback(fun)
        {result, collected(ref, [])}
      after
        :telemetry.detach(id)
      end
    end

    defp collected(ref, acc) do
      receive do
        {^ref, rewrites} -> collected(ref, acc ++ rewrites)
      after
        0 -> acc
      end
    end

    @doc false
    def forward(_event, _measurements, %{rewrites: rewrites}, {pid, ref}),
      do: send(pid, {ref, rewrites})

    defp count(rewrites, kind), do: Enum.count(rewrites, &(&1.rewrite == kind))

    # The model's forward pass with the rewrites (listed) and without, in `type`: their
    # outputs under `key` agree within the type's tolerance (of their magnitude).
    defp forward_both(name, inputs, type, key) do
      info = load(name, type: type)
      opts = [compiler: Emily.Compiler, cache: false]
      {fused, rewrites} = fusions(fn -> Axon.predict(info.model, info.params, inputs, opts) end)
      plain = Axon.predict(info.model, info.params, inputs, opts ++ [fuse: false])

      a = fused |> Map.fetch!(key) |> Nx.backend_transfer(Nx.BinaryBackend) |> Nx.as_type(:f64)
      b = plain |> Map.fetch!(key) |> Nx.backend_transfer(Nx.BinaryBackend) |> Nx.as_type(:f64)
      diff = Nx.subtract(a, b) |> Nx.abs() |> Nx.reduce_max() |> Nx.to_number()
      scale = max(1.0, b |> Nx.abs() |> Nx.reduce_max() |> Nx.to_number())

      assert diff <= tolerance(type) * scale,
             "#{name} #{type}: fused and unfused differ by #{diff}"

      {info.spec, rewrites}
    end

    defp text_inputs(name) do
      {:ok, tokenizer} = Bumblebee.load_tokenizer(repo(name))
      f = fixture(name)
      sentences = f["prompts"] || f["sentences"]
      Bumblebee.apply_tokenizer(tokenizer, sentences)
    end

    for type <- [:f32, :bf16] do
      @tag type: type
      test "Qwen3: RMS norms (QK norms too) and grouped-query attention, #{type}", %{type: type} do
        {spec, rewrites} = forward_both("qwen3", text_inputs("qwen3"), type, :logits)
        # Per block: the two norms, the query and key norms; then the final norm.
        assert count(rewrites, :rms_norm) == 4 * spec.num_blocks + 1
        # Each block's gated feed-forward: up * silu(gate), one kernel.
        assert for(%{rewrite: :silu, gated: g} <- rewrites, do: g) ==
                 List.duplicate(true, spec.num_blocks)

        attention = Enum.filter(rewrites, &(&1.rewrite == :scaled_dot_product_attention))
        assert length(attention) == spec.num_blocks

        for a <- attention do
          assert a.heads == {spec.num_attention_heads, spec.num_key_value_heads}
          assert a.mask == :additive
        end
      end

      @tag type: type
      test "Llama: RMS norms and grouped-query attention, #{type}", %{type: type} do
        {spec, rewrites} = forward_both("llama", text_inputs("llama"), type, :logits)
        assert count(rewrites, :rms_norm) == 2 * spec.num_blocks + 1

        assert for(%{rewrite: :silu, gated: g} <- rewrites, do: g) ==
                 List.duplicate(true, spec.num_blocks)

        assert for(%{rewrite: :scaled_dot_product_attention, heads: h} <- rewrites, do: h) ==
                 List.duplicate(
                   {spec.num_attention_heads, spec.num_key_value_heads},
                   spec.num_blocks
                 )
      end

      @tag type: type
      test "DistilBERT: layer norms and padded attention, #{type}", %{type: type} do
        {spec, rewrites} =
          forward_both("distilbert_mlm", text_inputs("distilbert_mlm"), type, :logits)

        # The embeddings' norm, two per block, the masked LM head's.
        assert count(rewrites, :layer_norm) == 2 * spec.num_blocks + 2
        assert count(rewrites, :scaled_dot_product_attention) == spec.num_blocks
        # Each block's feed-forward activation, and the LM head's.
        assert count(rewrites, :gelu) == spec.num_blocks + 1
        # Each block's query, key, value and output projections and its two feed-forward
        # layers, and the LM head's transform (its projection onto the tied embedding is
        # a product of the transposed table).
        assert count(rewrites, :dense) == 6 * spec.num_blocks + 1
      end

      @tag type: type
      test "ViT: layer norms and attention, #{type}", %{type: type} do
        {:ok, featurizer} = Bumblebee.load_featurizer(repo("vit"))
        inputs = Bumblebee.apply_featurizer(featurizer, [image(0), image(1)])
        {spec, rewrites} = forward_both("vit", inputs, type, :logits)
        assert count(rewrites, :layer_norm) == 2 * spec.num_blocks + 1
        assert count(rewrites, :scaled_dot_product_attention) == spec.num_blocks
        assert count(rewrites, :gelu) == spec.num_blocks
      end

      @tag type: type
      test "Whisper: encoder and decoder norms, self- and cross-attention, #{type}", ctx do
        %{type: type} = ctx
        {:ok, featurizer} = Bumblebee.load_featurizer(repo("whisper"))
        f = fixture("whisper")

        inputs = %{
          "input_features" =>
            Bumblebee.apply_featurizer(featurizer, [audio(0)])["input_features"],
          "decoder_input_ids" => Nx.tensor([f["decoder_input_ids"]])
        }

        {spec, rewrites} = forward_both("whisper", inputs, type, :logits)
        enc = spec.encoder_num_blocks
        dec = spec.decoder_num_blocks
        assert count(rewrites, :layer_norm) == 2 * enc + 1 + 3 * dec + 1
        assert count(rewrites, :scaled_dot_product_attention) == enc + 2 * dec
        # The encoder's two convolutions and each block's feed-forward activation.
        assert count(rewrites, :gelu) == 2 + enc + dec
      end
    end

    test "Qwen3's and Whisper's generation loops run the fused kernels in every step" do
      info = load("qwen3")
      {:ok, config} = Bumblebee.load_generation_config(repo("qwen3"))
      f = fixture("qwen3")
      config = Bumblebee.configure(config, max_new_tokens: f["max_new_tokens"])
      ids = hd(f["prompt_ids"])

      inputs = %{
        "input_ids" => Nx.tensor([ids]),
        "attention_mask" => Nx.broadcast(1, {1, length(ids)})
      }

      fun = Bumblebee.Text.Generation.build_generate(info.model, info.spec, config)
      inputs = Map.put(inputs, "seed", Nx.tensor([0], type: :s64))
      jit = Nx.Defn.jit(fun, compiler: Emily.Compiler, cache: false)
      {%{token_ids: tokens}, rewrites} = fusions(fn -> jit.(info.params, inputs) end)
      assert Nx.to_list(tokens) == [hd(f["generated_ids"])]

      # The prompt's pass and the loop's step (each lowered once) both fuse every
      # block's attention (over the cache: its heads repeated, as Bumblebee caches them)
      # and norms; the step (one position per row) also every block's query and key
      # rotary embeddings, the prompt's pass (any positions) none.
      blocks = info.spec.num_blocks
      assert count(rewrites, :scaled_dot_product_attention) >= 2 * blocks
      assert count(rewrites, :rms_norm) >= 2 * (4 * blocks + 1)
      assert count(rewrites, :rope) == 2 * blocks
      # Both write each block's keys and values into the cache unrepeated.
      assert count(rewrites, :repeated_update) == 2 * 2 * blocks

      info = load("whisper")
      {:ok, featurizer} = Bumblebee.load_featurizer(repo("whisper"))
      {:ok, config} = Bumblebee.load_generation_config(repo("whisper"))
      wf = fixture("whisper")
      # (Bumblebee counts the three forced prefix tokens among the new ones.)
      config = Bumblebee.configure(config, max_new_tokens: wf["max_new_tokens"] + 3)
      [_sot | forced] = wf["decoder_input_ids"]
      config = %{config | forced_token_ids: Enum.with_index(forced, &{&2 + 1, &1})}
      inputs = Map.take(Bumblebee.apply_featurizer(featurizer, [audio(0)]), ["input_features"])
      inputs = Map.put(inputs, "seed", Nx.tensor([0], type: :s64))
      fun = Bumblebee.Text.Generation.build_generate(info.model, info.spec, config)
      jit = Nx.Defn.jit(fun, compiler: Emily.Compiler, cache: false)
      {%{token_ids: tokens}, rewrites} = fusions(fn -> jit.(info.params, inputs) end)
      assert Enum.drop(hd(Nx.to_list(tokens)), 3) == hd(wf["generated_ids"])
      assert count(rewrites, :scaled_dot_product_attention) >= 2 * info.spec.decoder_num_blocks
      assert count(rewrites, :layer_norm) >= 2 * info.spec.decoder_num_blocks
    end
  end
else
  defmodule Emily.Conformance.FusionTest do
    use ExUnit.Case, async: true
    @moduletag :conformance
    require Emily.NxAbsent
    Emily.NxAbsent.placeholders()
  end
end
