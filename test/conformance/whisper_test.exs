# Conformance: Bumblebee's Whisper (speech to text, encoder-decoder) on Emily against
# Transformers (a tiny random checkpoint, tokenizer and featurizer with one-second windows
# from scripts/conformance_models.py): log-mel features, encoder states and logits, greedy
# decoding after the forced <|en|><|transcribe|><|notimestamps|> prefix, and the
# speech-to-text serving. Run with `mix test --only conformance` where Bumblebee is
# available.
if Code.ensure_loaded?(Bumblebee) do
  defmodule Emily.Conformance.WhisperTest do
    use ExUnit.Case, async: false
    @moduletag :conformance
    @moduletag timeout: 300_000

    import Emily.Conformance

    @name "whisper"

    setup_all do
      use_emily()
      {:ok, tokenizer} = Bumblebee.load_tokenizer(repo(@name))
      {:ok, featurizer} = Bumblebee.load_featurizer(repo(@name))
      {:ok, config} = Bumblebee.load_generation_config(repo(@name))
      fixture = fixture(@name)
      # Bumblebee counts the three forced prefix tokens among the new ones.
      config = Bumblebee.configure(config, max_new_tokens: fixture["max_new_tokens"] + 3)

      %{
        tokenizer: tokenizer,
        featurizer: featurizer,
        config: config,
        fixture: fixture,
        audio: Enum.map(0..3, &audio/1)
      }
    end

    setup do
      use_emily()
    end

    defp features(ctx), do: Bumblebee.apply_featurizer(ctx.featurizer, ctx.audio)

    test "the checkpoint, tokenizer, featurizer and generation config load as configured", ctx do
      %{spec: spec} = load(@name)
      assert spec.architecture == :for_conditional_generation
      assert {spec.hidden_size, spec.encoder_num_blocks, spec.decoder_num_blocks} == {32, 2, 2}

      assert {spec.feature_size, spec.encoder_max_positions, spec.decoder_max_positions} ==
               {80, 50, 64}

      assert {ctx.featurizer.num_seconds, ctx.featurizer.feature_size} == {1, 80}

      [sot, en, transcribe, notimestamps] = ctx.fixture["decoder_input_ids"]
      extra = ctx.config.extra_config
      assert ctx.config.decoder_start_token_id == sot
      assert extra.language_to_token_id["en"] == en
      assert extra.task_to_token_id[:transcribe] == transcribe
      assert extra.no_timestamps_token_id == notimestamps
      # Special tokens follow the ordinary vocabulary, so no ordinary id reads as a
      # timestamp (those start after <|notimestamps|>).
      assert notimestamps == spec.vocab_size - 1
      assert Bumblebee.Tokenizer.token_to_id(ctx.tokenizer, "<|notimestamps|>") == notimestamps

      %{"input_features" => features} = features(ctx)
      slice = Nx.transpose(features, axes: [0, 2, 1])[[.., 0..3, 0..7]]
      assert_close(slice, ctx.fixture["input_features_slice"], 1.0e-4, "log-mel features")
    end

    for type <- [:f32, :bf16, :f16], mode <- [:eager, :compiled] do
      @tag type: type, mode: mode
      test "encoder states and logits, #{type} #{mode}", %{type: type, mode: mode} = ctx do
        info = load(@name, type: type)
        f = ctx.fixture

        inputs = %{
          "input_features" => features(ctx)["input_features"][0..0],
          "decoder_input_ids" => Nx.tensor([f["decoder_input_ids"]])
        }

        out = refute_fallback(fn -> predict(info, inputs, mode) end)
        tol = tolerance(type)
        assert_close(out.logits[[.., .., 0..15]], f["logits_slice"], tol, "logits")
        encoder = out.encoder_hidden_state[[.., 0..7, 0..7]]
        assert_close(encoder, f["encoder_hidden_state_slice"], tol, "encoder")

        if type == :f32 do
          assert Nx.to_list(Nx.argmax(out.logits, axis: -1)) == f["logits_argmax"]
        end
      end
    end

    for mode <- [:eager, :compiled] do
      @tag mode: mode
      test "greedy decoding matches Transformers token for token, #{mode}", %{mode: mode} = ctx do
        info = load(@name)
        [_sot | forced] = ctx.fixture["decoder_input_ids"]
        config = %{ctx.config | forced_token_ids: Enum.with_index(forced, &{&2 + 1, &1})}
        inputs = Map.take(features(ctx), ["input_features"])
        ids = refute_fallback(fn -> generate(info, config, inputs, mode) end)
        assert Enum.map(ids, &Enum.drop(&1, 3)) == ctx.fixture["generated_ids"]
      end
    end

    test "speech-to-text serving: inline, batched and partitioned", ctx do
      info = load(@name)

      build =
        &Bumblebee.Audio.speech_to_text_whisper(info, ctx.featurizer, ctx.tokenizer, ctx.config,
          compile: [batch_size: 4],
          language: "en",
          task: :transcribe,
          defn_options: &1
        )

      inputs = ctx.audio ++ Enum.take(ctx.audio, 2)
      expected = ctx.fixture["generated_text"] ++ Enum.take(ctx.fixture["generated_text"], 2)

      for {how, results} <- refute_fallback(fn -> serve(build, inputs, inline: :each) end) do
        texts = for %{chunks: chunks} <- results, do: Enum.map_join(chunks, & &1.text)
        assert texts == Enum.map(expected, &String.trim/1), "#{how}: #{inspect(texts)}"
      end
    end
  end
else
  defmodule Emily.Conformance.WhisperTest do
    use ExUnit.Case, async: true
    @moduletag :conformance
    require Emily.NxAbsent
    Emily.NxAbsent.placeholders()
  end
end
