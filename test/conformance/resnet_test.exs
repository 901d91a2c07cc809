# Conformance: Bumblebee's ResNet (convolutional image classification, bottleneck blocks, batch norm) on Emily against Transformers (a tiny random
# checkpoint and featurizer from scripts/conformance_models.py): featurizer output,
# logits and hidden states, and the image-classification serving. Run with
# `mix test --only conformance` where Bumblebee is available.
if Code.ensure_loaded?(Bumblebee) do
  defmodule Emily.Conformance.ResNetTest do
    use ExUnit.Case, async: false
    @moduletag :conformance
    @moduletag timeout: 300_000

    import Emily.Conformance

    @name "resnet"

    setup_all do
      use_emily()
      {:ok, featurizer} = Bumblebee.load_featurizer(repo(@name))
      %{featurizer: featurizer, fixture: fixture(@name), images: Enum.map(0..3, &image/1)}
    end

    setup do
      use_emily()
    end

    # Bumblebee's layout is channels-last; Transformers' channels-first.
    defp channels_first(t),
      do: if(Nx.rank(t) == 4, do: Nx.transpose(t, axes: [0, 3, 1, 2]), else: t)

    test "the checkpoint and featurizer load as configured", ctx do
      %{featurizer: featurizer, fixture: f, images: images} = ctx
      %{spec: spec} = load(@name)
      assert spec.architecture == :for_image_classification
      assert spec.residual_block_type == :bottleneck
      assert {spec.embedding_size, spec.hidden_sizes, spec.depths} == {8, [8, 16, 24], [1, 2, 1]}
      assert spec.num_labels == 5
      assert spec.id_to_label == %{0 => "ant", 1 => "bee", 2 => "cat", 3 => "dog", 4 => "eel"}
      assert featurizer.__struct__ == Bumblebee.Vision.ConvNextFeaturizer
      refute featurizer.resize
      # Saved by Transformers 5 as a ConvNextImageProcessor, renamed by the script.
      assert featurizer.image_mean == [0.485, 0.456, 0.406]
      assert featurizer.image_std == [0.229, 0.224, 0.225]

      %{"pixel_values" => pixels} = Bumblebee.apply_featurizer(featurizer, images)
      slice = channels_first(pixels)[[.., .., 0..1, 0..3]]
      assert_close(slice, f["pixel_values_slice"], 1.0e-5, "pixel values")
    end

    for type <- [:f32, :bf16, :f16], mode <- [:eager, :compiled] do
      @tag type: type, mode: mode
      test "logits and hidden states, #{type} #{mode}", ctx do
        %{type: type, mode: mode, featurizer: featurizer, fixture: f, images: images} = ctx
        info = load(@name, type: type)
        inputs = Bumblebee.apply_featurizer(featurizer, images)

        out =
          refute_fallback(fn ->
            predict(info, inputs, mode, global_layer_options: [output_hidden_states: true])
          end)

        tol = tolerance(type)
        assert_close(out.logits, f["logits"], tol, "logits")
        hidden = elem(out.hidden_states, tuple_size(out.hidden_states) - 1)
        hidden = hidden |> channels_first() |> Nx.reshape({4, :auto})
        assert_close(hidden[[.., 0..15]], f["hidden_state_slice"], tol, "hidden state")
      end
    end

    test "image-classification serving: inline, batched and partitioned", ctx do
      %{featurizer: featurizer, fixture: f, images: images} = ctx
      info = load(@name)

      build =
        &Bumblebee.Vision.image_classification(info, featurizer,
          compile: [batch_size: 4],
          top_k: 5,
          defn_options: &1
        )

      inputs = images ++ Enum.take(images, 2)
      expected = f["predictions"] ++ Enum.take(f["predictions"], 2)

      for {how, results} <- refute_fallback(fn -> serve(build, inputs) end) do
        assert length(results) == 6

        for {%{predictions: predictions}, want} <- Enum.zip(results, expected) do
          assert Enum.map(predictions, & &1.label) == Enum.map(want, & &1["label"]), "#{how}"

          for {p, e} <- Enum.zip(predictions, want) do
            assert_in_delta p.score, e["score"], 1.0e-5, "#{how}"
          end
        end
      end
    end
  end
else
  defmodule Emily.Conformance.ResNetTest do
    use ExUnit.Case, async: true
    @moduletag :conformance
    require Emily.NxAbsent
    Emily.NxAbsent.placeholders()
  end
end
