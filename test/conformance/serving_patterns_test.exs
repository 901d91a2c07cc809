# The three ways the README shows to serve a Bumblebee model on Emily, each run on the
# tiny DistilBERT classifier against Transformers' predictions: one serving on the
# default stream; one model's weights shared by servings on a pool of Emily.Streams; K
# servings each holding its own copy. Run with `mix test --only conformance`.
if Code.ensure_loaded?(Bumblebee) do
  defmodule Emily.Conformance.ServingPatternsTest do
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

    defp classifier(info, tokenizer, defn_options) do
      Bumblebee.Text.text_classification(info, tokenizer,
        compile: [batch_size: 4, sequence_length: 16],
        top_k: 3,
        defn_options: [compiler: Emily.Compiler] ++ defn_options
      )
    end

    # Each text sent from its own process, as a service's requests arrive.
    defp concurrently(texts, run) do
      texts |> Enum.map(&Task.async(fn -> run.(&1) end)) |> Enum.map(&Task.await(&1, 60_000))
    end

    defp assert_predictions(results, expected) do
      assert length(results) == length(expected)

      for {%{predictions: predictions}, want} <- Enum.zip(results, expected) do
        assert Enum.map(predictions, & &1.label) == Enum.map(want, & &1["label"])

        for {p, e} <- Enum.zip(predictions, want) do
          assert_in_delta p.score, e["score"], 1.0e-5
        end
      end
    end

    defp texts_and_expected(%{mlm: mlm, cls: cls}) do
      {mlm["sentences"] ++ mlm["sentences"], cls["predictions"] ++ cls["predictions"]}
    end

    test "one serving on the default stream", ctx do
      {texts, expected} = texts_and_expected(ctx)
      serving = classifier(load("distilbert_cls"), ctx.tokenizer, [])
      name = :"#{__MODULE__}.Default"
      start_supervised!({Nx.Serving, serving: serving, name: name, batch_timeout: 20})

      results =
        refute_fallback(fn -> concurrently(texts, &Nx.Serving.batched_run(name, &1)) end)

      assert_predictions(results, expected)
    end

    test "a pool of streams sharing one model's weights", ctx do
      {texts, expected} = texts_and_expected(ctx)
      info = load("distilbert_cls")
      streams = for _ <- 1..3, do: Emily.Stream.new(:cpu)

      names =
        for {stream, i} <- Enum.with_index(streams) do
          name = :"#{__MODULE__}.Pool#{i}"
          serving = classifier(info, ctx.tokenizer, stream: stream)
          spec = {Nx.Serving, serving: serving, name: name, batch_timeout: 20}
          start_supervised!(Supervisor.child_spec(spec, id: name))
          name
        end

      before = Emily.Memory.stats()

      results =
        refute_fallback(fn ->
          texts
          |> Enum.with_index()
          |> Enum.map(fn {text, i} ->
            name = Enum.at(names, rem(i, length(names)))
            Task.async(fn -> Nx.Serving.batched_run(name, text) end)
          end)
          |> Enum.map(&Task.await(&1, 60_000))
        end)

      assert_predictions(results, expected)

      # Every serving ran on its own stream's worker thread, reading the one copy of the
      # weights: after serving on three streams, MLX holds less than half a copy more.
      for stream <- streams, do: assert(Emily.Stream.name(stream) =~ ~r/^emily-cpu-\d+$/)
      param_bytes = params_bytes(info.params)
      assert Emily.Memory.stats().active - before.active < div(param_bytes, 2)
    end

    test "K servings, each with its own copy of the weights", ctx do
      {texts, expected} = texts_and_expected(ctx)

      names =
        for i <- 1..2 do
          name = :"#{__MODULE__}.Copy#{i}"
          serving = classifier(load("distilbert_cls"), ctx.tokenizer, [])
          spec = {Nx.Serving, serving: serving, name: name, batch_timeout: 20}
          start_supervised!(Supervisor.child_spec(spec, id: name))
          name
        end

      results =
        refute_fallback(fn ->
          texts
          |> Enum.with_index()
          |> Enum.map(fn {text, i} ->
            name = Enum.at(names, rem(i, length(names)))
            Task.async(fn -> Nx.Serving.batched_run(name, text) end)
          end)
          |> Enum.map(&Task.await(&1, 60_000))
        end)

      assert_predictions(results, expected)
    end

    defp params_bytes(%Axon.ModelState{data: data}), do: params_bytes(data)

    defp params_bytes(%Nx.Tensor{} = t), do: Nx.byte_size(t)

    defp params_bytes(map) when is_map(map),
      do: map |> Map.values() |> Enum.map(&params_bytes/1) |> Enum.sum()
  end
else
  defmodule Emily.Conformance.ServingPatternsTest do
    use ExUnit.Case, async: true
    @moduletag :conformance
    require Emily.NxAbsent
    Emily.NxAbsent.placeholders()
  end
end
