# Conformance: Bumblebee's CLIP (dual text/image encoder) on Emily against Transformers
# (a tiny random checkpoint, tokenizer and featurizer from scripts/conformance_models.py):
# both embeddings and the similarity logits, and the text-embedding serving over the text
# tower. Run with `mix test --only conformance` where Bumblebee is available.
if Code.ensure_loaded?(Bumblebee) do
  defmodule Emily.Conformance.ClipTest do
    use ExUnit.Case, async: false
    @moduletag :conformance
    @moduletag timeout: 300_000

    import Emily.Conformance

    @name "clip"

    setup_all do
      use_emily()
      {:ok, tokenizer} = Bumblebee.load_tokenizer(repo(@name))
      {:ok, featurizer} = Bumblebee.load_featurizer(repo(@name))
      tokenizer = Bumblebee.configure(tokenizer, length: 16)
      %{tokenizer: tokenizer, featurizer: featurizer, fixture: fixture(@name)}
    end

    setup do
      use_emily()
    end

    defp inputs(%{tokenizer: tokenizer, featurizer: featurizer, fixture: f}) do
      text = Bumblebee.apply_tokenizer(tokenizer, f["sentences"])
      images = Bumblebee.apply_featurizer(featurizer, Enum.map(0..3, &image/1))
      Map.merge(Map.take(text, ["input_ids", "attention_mask"]), images)
    end

    defp l2_normalize(t),
      do: Nx.divide(t, Nx.sqrt(Nx.sum(Nx.multiply(t, t), axes: [-1], keep_axes: true)))

    test "the checkpoint, tokenizer and featurizer load as configured", ctx do
      %{spec: spec} = load(@name)
      assert spec.architecture == :base

      assert {spec.text_spec.hidden_size, spec.text_spec.num_blocks, spec.text_spec.max_positions} ==
               {32, 2, 16}

      assert {spec.vision_spec.image_size, spec.vision_spec.patch_size} == {32, 8}
      assert spec.projection_size == 16
      assert ctx.featurizer.__struct__ == Bumblebee.Vision.ClipFeaturizer
      refute ctx.featurizer.resize
      assert ctx.featurizer.crop_size == %{height: 32, width: 32}

      inputs = inputs(ctx)
      assert Nx.to_list(inputs["input_ids"]) == ctx.fixture["input_ids"]
      assert Nx.to_list(inputs["attention_mask"]) == ctx.fixture["attention_mask"]
      # Bumblebee pools the text tower at the largest id, which must be the end token.
      assert Enum.max(List.flatten(ctx.fixture["input_ids"])) ==
               Bumblebee.Tokenizer.token_to_id(ctx.tokenizer, "<|endoftext|>")
    end

    for type <- [:f32, :bf16, :f16], mode <- [:eager, :compiled] do
      @tag type: type, mode: mode
      test "embeddings and similarity logits, #{type} #{mode}", %{type: type, mode: mode} = ctx do
        info = load(@name, type: type)
        inputs = inputs(ctx)
        out = refute_fallback(fn -> predict(info, inputs, mode) end)
        tol = tolerance(type)
        f = ctx.fixture
        assert_close(out.logits_per_text, f["logits_per_text"], tol, "logits per text")

        assert_close(
          l2_normalize(Nx.as_type(out.text_embedding, :f32)),
          f["text_embeds"],
          tol,
          "text"
        )

        assert_close(
          l2_normalize(Nx.as_type(out.image_embedding, :f32)),
          f["image_embeds"],
          tol,
          "image"
        )
      end
    end

    test "text-embedding serving: inline, batched and partitioned", ctx do
      # The text tower alone, from the same checkpoint (so the image tower goes unused).
      info =
        load(@name, module: Bumblebee.Text.ClipText, architecture: :for_embedding, strict: false)

      build =
        &Bumblebee.Text.text_embedding(info, ctx.tokenizer,
          compile: [batch_size: 4, sequence_length: 16],
          output_attribute: :embedding,
          embedding_processor: :l2_norm,
          defn_options: &1
        )

      expected = tensor(ctx.fixture["text_embeds"])

      for {how, results} <- refute_fallback(fn -> serve(build, ctx.fixture["sentences"]) end) do
        for {%{embedding: embedding}, i} <- Enum.with_index(results) do
          assert_close(embedding, expected[i], tolerance(:f32), "#{how} embedding #{i}")
        end
      end
    end
  end
else
  defmodule Emily.Conformance.ClipTest do
    use ExUnit.Case, async: true
    @moduletag :conformance
    require Emily.NxAbsent
    Emily.NxAbsent.placeholders()
  end
end
