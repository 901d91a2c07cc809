# Conformance: Bumblebee's BART (encoder-decoder text model) on Emily against Transformers
# (a tiny random checkpoint from scripts/conformance_models.py): encoder and decoder
# hidden states and logits, greedy generation, and the text-generation serving. Run with
# `mix test --only conformance` where Bumblebee is available.
if Code.ensure_loaded?(Bumblebee) do
  defmodule Emily.Conformance.BartTest do
    use ExUnit.Case, async: false
    @moduletag :conformance
    @moduletag timeout: 300_000

    import Emily.Conformance

    @name "bart"

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

    test "the checkpoint loads as the configured spec", ctx do
      %{tokenizer: tokenizer, config: config, fixture: f} = ctx
      %{spec: spec} = load(@name)
      assert spec.architecture == :for_conditional_generation
      assert {spec.hidden_size, spec.encoder_num_blocks, spec.decoder_num_blocks} == {32, 2, 2}
      assert {spec.encoder_num_attention_heads, spec.decoder_num_attention_heads} == {4, 4}
      assert {spec.encoder_intermediate_size, spec.max_positions} == {64, 64}
      refute spec.scale_embedding

      assert {config.decoder_start_token_id, config.eos_token_id, config.pad_token_id} ==
               {2, 2, 1}

      assert config.forced_bos_token_id == nil

      for {sentence, ids} <- Enum.zip(f["sentences"], f["input_ids"]) do
        assert Nx.to_flat_list(Bumblebee.apply_tokenizer(tokenizer, sentence)["input_ids"]) ==
                 ids
      end
    end

    for type <- [:f32, :bf16, :f16], mode <- [:eager, :compiled] do
      @tag type: type, mode: mode
      test "encoder, decoder and logits, #{type} #{mode}", %{type: type, mode: mode, fixture: f} do
        info = load(@name, type: type)

        inputs = %{
          "input_ids" => Nx.tensor([hd(f["input_ids"])]),
          "decoder_input_ids" => Nx.tensor([f["decoder_input_ids"]])
        }

        out =
          refute_fallback(fn ->
            predict(info, inputs, mode, global_layer_options: [output_hidden_states: true])
          end)

        tol = tolerance(type)
        assert_close(out.logits[[.., .., 0..15]], f["logits_slice"], tol, "logits")

        assert_close(
          out.encoder_hidden_state[[.., .., 0..7]],
          f["encoder_hidden_state_slice"],
          tol,
          "encoder"
        )

        decoder = elem(out.decoder_hidden_states, tuple_size(out.decoder_hidden_states) - 1)
        assert_close(decoder[[.., .., 0..7]], f["decoder_hidden_state_slice"], tol, "decoder")

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

        assert_greedy(info, config, f["input_ids"], f["generated_ids"], mode)
      end
    end

    test "text-generation serving: inline, batched and partitioned", ctx do
      %{tokenizer: tokenizer, config: config, fixture: f} = ctx
      info = load(@name)

      # The serving pads each input on the left to 16 tokens: its reference is Transformers
      # on that padded batch.
      assert_generation_serving(
        info,
        tokenizer,
        config,
        f["sentences"],
        f["serving_generated_text"],
        16
      )
    end
  end
else
  defmodule Emily.Conformance.BartTest do
    use ExUnit.Case, async: true
    @moduletag :conformance
    require Emily.NxAbsent
    Emily.NxAbsent.placeholders()
  end
end
