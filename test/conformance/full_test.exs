# Full-size lanes: real checkpoints, opt-in by tag (`mix test --only qwen3_full`, ...),
# read from $EMILY_CONFORMANCE_MODELS/<owner>--<name> or from the Hugging Face cache
# ($HF_HOME/hub or ~/.cache/huggingface/hub, models--<owner>--<name>/snapshots/*); a lane
# whose checkpoint is absent is skipped with the reason. Each lane runs the model on Emily
# eager and compiled with no fallback, and the two must agree (logits within 1e-4, greedy
# tokens equal). See test/conformance/README.md.
if Code.ensure_loaded?(Bumblebee) do
  defmodule Emily.Conformance.FullTest do
    use ExUnit.Case, async: false
    @moduletag :full
    @moduletag timeout: 1_800_000

    import Emily.Conformance

    setup do
      use_emily()
    end

    defp load_local(dir, opts \\ []) do
      {:ok, info} = Bumblebee.load_model({:local, dir}, opts)
      info
    end

    defp agree(info, inputs, key) do
      [eager, compiled] =
        for mode <- [:eager, :compiled] do
          refute_fallback(fn -> Map.fetch!(predict(info, inputs, mode), key) end)
        end

      assert_close(compiled, Nx.backend_transfer(eager, Nx.BinaryBackend), 1.0e-4, "#{key}")
    end

    @lanes [
      {:qwen3_full, "Qwen/Qwen3-0.6B", :generation},
      {:distilbert_full, "distilbert/distilbert-base-uncased-finetuned-sst-2-english", :text},
      {:vit_full, "google/vit-base-patch16-224", :image},
      {:whisper_full, "openai/whisper-tiny", :speech}
    ]

    for {tag, hub_id, kind} <- @lanes do
      dir = Emily.Conformance.local_checkpoint(hub_id)
      @tag tag
      @tag dir: dir, kind: kind
      @tag skip:
             dir == nil &&
               "checkpoint #{hub_id} not found in $EMILY_CONFORMANCE_MODELS/" <>
                 "#{String.replace(hub_id, "/", "--")} nor in the Hugging Face cache"

      test "#{hub_id}: eager and compiled agree, no fallback", %{dir: dir, kind: kind} do
        run_lane(kind, dir)
      end
    end

    defp run_lane(:generation, dir) do
      info = load_local(dir)
      {:ok, tokenizer} = Bumblebee.load_tokenizer({:local, dir})
      {:ok, config} = Bumblebee.load_generation_config({:local, dir})
      config = Bumblebee.configure(config, max_new_tokens: 16, strategy: %{type: :greedy_search})
      inputs = Bumblebee.apply_tokenizer(tokenizer, "The capital of France is")
      agree(info, inputs, :logits)

      [eager, compiled] =
        for mode <- [:eager, :compiled],
            do: refute_fallback(fn -> generate(info, config, inputs, mode) end)

      assert eager == compiled
    end

    defp run_lane(:text, dir) do
      info = load_local(dir)
      {:ok, tokenizer} = Bumblebee.load_tokenizer({:local, dir})
      inputs = Bumblebee.apply_tokenizer(tokenizer, ["a delightful film", "a dull, tedious film"])
      agree(info, inputs, :logits)

      serving =
        Bumblebee.Text.text_classification(info, tokenizer,
          defn_options: [compiler: Emily.Compiler]
        )

      %{predictions: [top | _]} =
        refute_fallback(fn -> Nx.Serving.run(serving, "a delightful film") end)

      assert top.label == "POSITIVE"
    end

    defp run_lane(:image, dir) do
      info = load_local(dir)
      {:ok, featurizer} = Bumblebee.load_featurizer({:local, dir})
      inputs = Bumblebee.apply_featurizer(featurizer, [image(0, 224), image(1, 224)])
      agree(info, inputs, :logits)
    end

    defp run_lane(:speech, dir) do
      info = load_local(dir)
      {:ok, featurizer} = Bumblebee.load_featurizer({:local, dir})
      {:ok, tokenizer} = Bumblebee.load_tokenizer({:local, dir})
      {:ok, config} = Bumblebee.load_generation_config({:local, dir})
      inputs = Bumblebee.apply_featurizer(featurizer, [audio(0)])
      inputs = Map.put(inputs, "decoder_input_ids", Nx.tensor([[config.decoder_start_token_id]]))
      agree(info, inputs, :logits)

      serving =
        Bumblebee.Audio.speech_to_text_whisper(info, featurizer, tokenizer, config,
          defn_options: [compiler: Emily.Compiler]
        )

      assert %{chunks: [_ | _]} = refute_fallback(fn -> Nx.Serving.run(serving, audio(0)) end)
    end
  end
else
  defmodule Emily.Conformance.FullTest do
    use ExUnit.Case, async: true
    @moduletag :full
    require Emily.NxAbsent
    Emily.NxAbsent.placeholders()
  end
end
