# Conformance: Bumblebee's DistilBERT on Emily against Transformers (tiny random
# checkpoints from scripts/conformance_models.py): masked LM logits and hidden states,
# sequence classification, and the fill-mask, text-classification and text-embedding
# servings. Run with `mix test --only conformance` where Bumblebee is available.
if Code.ensure_loaded?(Bumblebee) do
  defmodule Emily.Conformance.DistilbertTest do
    use ExUnit.Case, async: false
    @moduletag :conformance
    @moduletag timeout: 300_000

    import Emily.Conformance

    setup_all do
      use_emily()
      {:ok, tokenizer} = Bumblebee.load_tokenizer(repo("distilbert_mlm"))
      %{tokenizer: tokenizer, mlm: fixture("distilbert_mlm"), cls: fixture("distilbert_cls")}
    end

    setup do
      use_emily()
    end

    test "the checkpoints load as the configured specs", %{tokenizer: tokenizer, mlm: mlm} do
      %{spec: spec} = load("distilbert_mlm")
      assert spec.architecture == :for_masked_language_modeling
      assert {spec.hidden_size, spec.num_blocks, spec.num_attention_heads} == {32, 2, 4}
      assert spec.intermediate_size == 64
      assert spec.max_positions == 64

      %{spec: spec} = load("distilbert_cls")
      assert spec.architecture == :for_sequence_classification
      assert spec.num_labels == 3
      assert spec.id_to_label == %{0 => "negative", 1 => "neutral", 2 => "positive"}

      inputs = Bumblebee.apply_tokenizer(tokenizer, mlm["sentences"])
      assert Nx.to_list(inputs["input_ids"]) == mlm["input_ids"]
      assert Nx.to_list(inputs["attention_mask"]) == mlm["attention_mask"]
    end

    for type <- [:f32, :bf16, :f16], mode <- [:eager, :compiled] do
      @tag type: type, mode: mode
      test "masked LM logits and hidden states, #{type} #{mode}", ctx do
        %{type: type, mode: mode, tokenizer: tokenizer, mlm: mlm} = ctx
        info = load("distilbert_mlm", type: type)
        inputs = Bumblebee.apply_tokenizer(tokenizer, mlm["sentences"])

        out =
          refute_fallback(fn ->
            predict(info, inputs, mode, global_layer_options: [output_hidden_states: true])
          end)

        tol = tolerance(type)
        assert_close(out.logits[[.., .., 0..15]], mlm["logits_slice"], tol, "logits")
        hidden = elem(out.hidden_states, tuple_size(out.hidden_states) - 1)
        assert_close(hidden[[.., .., 0..7]], mlm["hidden_state_slice"], tol, "hidden state")

        if type == :f32 do
          assert Nx.to_list(Nx.argmax(out.logits, axis: -1)) == mlm["logits_argmax"]
        end
      end

      @tag type: type, mode: mode
      test "sequence classification logits, #{type} #{mode}", ctx do
        %{type: type, mode: mode, tokenizer: tokenizer, mlm: mlm, cls: cls} = ctx
        info = load("distilbert_cls", type: type)
        inputs = Bumblebee.apply_tokenizer(tokenizer, mlm["sentences"])
        out = refute_fallback(fn -> predict(info, inputs, mode) end)
        assert_close(out.logits, cls["logits"], tolerance(type), "logits")
      end
    end

    test "fill-mask serving: inline, batched and partitioned", %{tokenizer: tokenizer, mlm: mlm} do
      info = load("distilbert_mlm")

      build =
        &Bumblebee.Text.fill_mask(info, tokenizer,
          compile: [batch_size: 4, sequence_length: 16],
          defn_options: &1
        )

      texts = List.duplicate(mlm["masked"], 6)
      expected = mlm["fill_mask"]

      for {how, results} <- refute_fallback(fn -> serve(build, texts) end) do
        assert length(results) == 6, "#{how}"

        for %{predictions: predictions} <- results do
          assert Enum.map(predictions, & &1.token) == Enum.map(expected, & &1["token"]),
                 "#{how}: #{inspect(predictions)} #{inspect(expected)}"

          for {p, e} <- Enum.zip(predictions, expected) do
            assert_in_delta p.score, e["score"], 1.0e-5, "#{how}"
          end
        end
      end
    end

    test "text-classification serving: inline, batched and partitioned", ctx do
      %{tokenizer: tokenizer, mlm: mlm, cls: cls} = ctx
      info = load("distilbert_cls")

      build =
        &Bumblebee.Text.text_classification(info, tokenizer,
          compile: [batch_size: 4, sequence_length: 16],
          top_k: 3,
          defn_options: &1
        )

      texts = mlm["sentences"] ++ Enum.take(mlm["sentences"], 2)
      expected = cls["predictions"] ++ Enum.take(cls["predictions"], 2)

      for {how, results} <- refute_fallback(fn -> serve(build, texts) end) do
        for {%{predictions: predictions}, want} <- Enum.zip(results, expected) do
          assert Enum.map(predictions, & &1.label) == Enum.map(want, & &1["label"]), "#{how}"

          for {p, e} <- Enum.zip(predictions, want) do
            assert_in_delta p.score, e["score"], 1.0e-5, "#{how}"
          end
        end
      end
    end

    test "text-embedding serving (mean pooling): inline, batched and partitioned", ctx do
      %{tokenizer: tokenizer, mlm: mlm} = ctx
      info = load("distilbert_mlm", architecture: :base, strict: false)

      build =
        &Bumblebee.Text.text_embedding(info, tokenizer,
          compile: [batch_size: 4, sequence_length: 16],
          output_attribute: :hidden_state,
          output_pool: :mean_pooling,
          defn_options: &1
        )

      expected = tensor(mlm["mean_pooled"])

      for {how, results} <- refute_fallback(fn -> serve(build, mlm["sentences"]) end) do
        for {%{embedding: embedding}, i} <- Enum.with_index(results) do
          assert_close(embedding, expected[i], tolerance(:f32), "#{how} embedding #{i}")
        end
      end
    end
  end
else
  defmodule Emily.Conformance.DistilbertTest do
    use ExUnit.Case, async: true
    @moduletag :conformance
    require Emily.NxAbsent
    Emily.NxAbsent.placeholders()
  end
end
