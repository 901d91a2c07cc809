# Conformance: Bumblebee's Llama (causal LM, grouped-query attention: 8 query heads over 2
# key/value heads, untied head) on Emily against Transformers (a tiny random checkpoint from
# scripts/conformance_models.py): logits and hidden states, greedy generation, and the
# text-generation serving. Run with `mix test --only conformance` where Bumblebee is
# available.
if Code.ensure_loaded?(Bumblebee) do
  defmodule Emily.Conformance.LlamaTest do
    use ExUnit.Case, async: false
    @moduletag :conformance
    @moduletag timeout: 300_000

    import Emily.Conformance

    @name "llama"

    setup_all do
      use_emily()
      {:ok, tokenizer} = Bumblebee.load_tokenizer(repo(@name))
      {:ok, config} = Bumblebee.load_generation_config(repo(@name))
      fixture = fixture(@name)
      config = Bumblebee.configure(config, max_new_tokens: fixture["max_new_tokens"])
      %{tokenizer: tokenizer, config: config, fixture: fixture}
    end

    setup do
      use_emily()
    end

    test "the checkpoint loads as the configured spec", %{tokenizer: tokenizer, fixture: f} do
      %{spec: spec} = load(@name)
      assert spec.architecture == :for_causal_language_modeling
      assert {spec.hidden_size, spec.num_blocks, spec.intermediate_size} == {32, 2, 64}
      assert {spec.num_attention_heads, spec.num_key_value_heads} == {8, 2}

      # Saved by Transformers 5 under rope_parameters; Bumblebee's default is 10_000.
      assert spec.rotary_embedding_base == 20000.0
      refute spec.tie_word_embeddings
      assert_in_delta spec.layer_norm_epsilon, 1.0e-5, 1.0e-12

      for {prompt, ids} <- Enum.zip(f["prompts"], f["prompt_ids"]) do
        assert Nx.to_flat_list(Bumblebee.apply_tokenizer(tokenizer, prompt)["input_ids"]) == ids
      end
    end

    for type <- [:f32, :bf16, :f16], mode <- [:eager, :compiled] do
      @tag type: type, mode: mode
      test "logits and hidden states, #{type} #{mode}", %{type: type, mode: mode, fixture: f} do
        info = load(@name, type: type)
        inputs = %{"input_ids" => Nx.tensor([hd(f["prompt_ids"])])}

        out =
          refute_fallback(fn ->
            predict(info, inputs, mode, global_layer_options: [output_hidden_states: true])
          end)

        tol = tolerance(type)
        assert_close(out.logits[[.., .., 0..15]], f["logits_slice"], tol, "logits")
        hidden = elem(out.hidden_states, tuple_size(out.hidden_states) - 1)
        assert_close(hidden[[.., .., 0..7]], f["hidden_state_slice"], tol, "hidden state")

        if type == :f32 do
          assert Nx.to_list(Nx.argmax(out.logits, axis: -1)) == f["logits_argmax"]
        end
      end
    end

    for mode <- [:eager, :compiled] do
      @tag mode: mode
      test "greedy generation matches Transformers token for token, #{mode}", ctx do
        %{mode: mode, config: config, fixture: f} = ctx
        info = load(@name)

        assert_greedy(info, config, f["prompt_ids"], f["generated_ids"], mode)
      end
    end

    test "text-generation serving: inline, batched and partitioned", ctx do
      %{tokenizer: tokenizer, config: config, fixture: f} = ctx
      info = load(@name)

      assert_generation_serving(info, tokenizer, config, f["prompts"], f["generated_text"], 8)
    end
  end
else
  defmodule Emily.Conformance.LlamaTest do
    use ExUnit.Case, async: true
    @moduletag :conformance
    require Emily.NxAbsent
    Emily.NxAbsent.placeholders()
  end
end
