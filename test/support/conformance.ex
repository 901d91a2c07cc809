if Code.ensure_loaded?(Bumblebee) do
  defmodule Emily.Conformance do
    @moduledoc false
    # Shared by the conformance suites (test/conformance): the tiny checkpoints and
    # Transformers' outputs that scripts/conformance_models.py wrote, the inputs it used,
    # the two ways of running a model on Emily, tolerances, servings and the no-fallback
    # check.
    import ExUnit.Assertions

    @root Path.expand("../conformance", __DIR__)

    @doc "A committed tiny checkpoint, as a Bumblebee repository."
    def repo(name), do: {:local, Path.join([@root, "models", name])}

    @doc "Transformers' reference outputs for `name`."
    def fixture(name) do
      Path.join([@root, "fixtures", name <> ".json"]) |> File.read!() |> Jason.decode!()
    end

    @doc "A pinned tensor (`%{\"shape\" => ..., \"data\" => ...}`) on the binary backend."
    def tensor(%{"shape" => shape, "data" => data}) do
      data
      |> Nx.tensor(type: :f64, backend: Nx.BinaryBackend)
      |> Nx.reshape(List.to_tuple(shape))
    end

    @doc """
    The defn options of each way the suites run a model: eager (`Nx.Defn.Evaluator`, one
    op at a time on `Emily.Backend`) and compiled (`Emily.Compiler`).
    """
    def modes, do: [eager: [compiler: Nx.Defn.Evaluator], compiled: [compiler: Emily.Compiler]]

    @doc """
    Tolerance against Transformers' f32 outputs, per parameter and compute type: the
    bound on the absolute difference of every element, scaled by the compared tensor's
    largest magnitude where that exceeds one (see `assert_close/4`). bf16 keeps 8
    significant bits (a relative step of 2^-8) and f16 11; the bounds allow a few steps of
    each after a model's layers.
    """
    def tolerance(:f32), do: 1.0e-4
    def tolerance(:f16), do: 1.0e-2
    def tolerance(:bf16), do: 6.0e-2

    @doc "The dtypes every suite runs."
    def types, do: [:f32, :bf16, :f16]

    @doc """
    Loads `name` with Bumblebee (`opts` as `Bumblebee.load_model/2` takes them), failing
    if a parameter was missing from the checkpoint or unused: Bumblebee only logs those,
    and initialises a missing one at random. `strict: false` skips the check, for an
    architecture other than the checkpoint's (its head unused, a pooler it lacks).
    """
    def load(name, opts \\ []) do
      {strict, opts} = Keyword.pop(opts, :strict, true)

      {{:ok, info}, log} =
        ExUnit.CaptureLog.with_log([level: :debug], fn ->
          Bumblebee.load_model(repo(name), opts)
        end)

      if strict do
        refute log =~ "parameters were missing", "#{name}: #{log}"
        refute log =~ "were unused", "#{name}: #{log}"
      end

      info
    end

    @doc "Runs the model's forward pass in `mode` (see `modes/0`)."
    def predict(%{model: model, params: params}, inputs, mode, opts \\ []) do
      Axon.predict(model, params, inputs, Keyword.merge(modes()[mode], opts))
    end

    @doc """
    Asserts every element of `actual` is within `tol * max(1, max|expected|)` of the
    pinned `expected`; returns the largest difference.
    """
    def assert_close(actual, expected, tol, label \\ "") do
      expected =
        if is_map(expected) and not is_struct(expected), do: tensor(expected), else: expected

      actual = actual |> Nx.backend_transfer(Nx.BinaryBackend) |> Nx.as_type(:f64)

      assert Nx.shape(actual) == Nx.shape(expected),
             "#{label}: shape #{inspect(Nx.shape(actual))}, expected #{inspect(Nx.shape(expected))}"

      diff = Nx.subtract(actual, expected) |> Nx.abs() |> Nx.reduce_max() |> Nx.to_number()
      atol = tol * max(1.0, expected |> Nx.abs() |> Nx.reduce_max() |> Nx.to_number())

      assert diff <= atol,
             "#{label}: max abs difference #{diff} from Transformers exceeds #{atol}"

      diff
    end

    @doc "Image `k` of the suite: the formula of scripts/conformance_models.py, `{size, size, 3}` u8."
    def image(k, size \\ 32) do
      y = Nx.iota({size, size, 3}, axis: 0)
      x = Nx.iota({size, size, 3}, axis: 1)
      c = Nx.iota({size, size, 3}, axis: 2)

      x
      |> Nx.multiply(7)
      |> Nx.add(Nx.multiply(y, 13))
      |> Nx.add(Nx.multiply(c, 51))
      |> Nx.add(k * 37)
      |> Nx.add(Nx.remainder(Nx.multiply(x, y), 17))
      |> Nx.remainder(256)
      |> Nx.as_type(:u8)
      |> Nx.backend_transfer(Nx.BinaryBackend)
    end

    @doc "Waveform `k`: the formula of scripts/conformance_models.py, `{n}` f32 at 16 kHz."
    def audio(k, n \\ 16_000) do
      t = Nx.iota({n}, type: :f32, backend: Nx.BinaryBackend) |> Nx.divide(16_000)
      two_pi = Nx.tensor(2 * :math.pi(), type: :f32, backend: Nx.BinaryBackend)
      f1 = Nx.tensor(220.0 * (k + 1), type: :f32, backend: Nx.BinaryBackend)
      f2 = Nx.tensor(1250.0 + 100.0 * k, type: :f32, backend: Nx.BinaryBackend)
      a = Nx.sin(Nx.multiply(Nx.multiply(two_pi, f1), t)) |> Nx.multiply(0.5)
      b = Nx.sin(Nx.multiply(Nx.multiply(two_pi, f2), t)) |> Nx.multiply(0.25)
      a |> Nx.add(b) |> Nx.backend_transfer(Nx.BinaryBackend)
    end

    @doc """
    Asserts that greedy generation from each prompt (its token ids) gives Transformers'
    token ids, with nothing leaving MLX's native paths.
    """
    def assert_greedy(info, config, prompt_ids, expected_ids, mode) do
      for {ids, expected} <- Enum.zip(prompt_ids, expected_ids) do
        inputs = %{
          "input_ids" => Nx.tensor([ids]),
          "attention_mask" => Nx.broadcast(1, {1, length(ids)})
        }

        assert refute_fallback(fn -> generate(info, config, inputs, mode) end) == [expected]
      end
    end

    @doc """
    Runs Bumblebee's text-generation serving (batch size 4, `sequence_length`) inline,
    batched and partitioned (`serve/3`) on `texts` and the first two of them again, and
    asserts the generated texts.
    """
    def assert_generation_serving(info, tokenizer, config, texts, expected, sequence_length) do
      build =
        &Bumblebee.Text.generation(info, tokenizer, config,
          compile: [batch_size: 4, sequence_length: sequence_length],
          defn_options: &1
        )

      inputs = texts ++ Enum.take(texts, 2)
      expected = expected ++ Enum.take(expected, 2)

      for {how, results} <- refute_fallback(fn -> serve(build, inputs) end) do
        texts = for %{results: [%{text: text}]} <- List.wrap(results), do: text
        assert texts == expected, "#{how}: #{inspect(texts)}"
      end
    end

    @doc """
    Runs `fun` and asserts that nothing left MLX's native paths meanwhile, in any process
    (servings run the model in their own): no op fell back to `Nx.BinaryBackend`
    (`[:emily, :fallback, :start]`) and no compiled function fell back from
    `Emily.Compiler`'s native lowering to the evaluator
    (`[:emily, :compiler, :evaluator_fallback]`, which a generation loop's hooks would
    cause if the lowering did not know them).
    """
    def refute_fallback(fun) do
      parent = self()
      ref = make_ref()
      id = {__MODULE__, ref}
      events = [[:emily, :fallback, :start], [:emily, :compiler, :evaluator_fallback]]

      :ok = :telemetry.attach_many(id, events, &__MODULE__.forward/4, {parent, ref})

      try do
        result = fun.()
        refute_received {^ref, _meta}, "a computation left MLX's native paths"
        result
      after
        :telemetry.detach(id)
      end
    end

    @doc false
    def forward(event, _measurements, meta, {pid, ref}), do: send(pid, {ref, {event, meta}})

    @doc """
    The results of `serving` on `inputs` (a list) run three ways: inline
    (`Nx.Serving.run/2` on the whole list), through a started serving with
    `batch_size: 4`, and through one with `partitions: true` (two partitions, each on its
    own `Emily.Stream`); the last two are sent one input per concurrent caller.
    `inline: :each` runs the inline serving on one input at a time (for a serving that
    reads a list as a stream, such as speech-to-text).
    """
    def serve(build, inputs, opts \\ []) do
      serving = build.(compiler: Emily.Compiler)

      inline =
        if opts[:inline] == :each,
          do: Enum.map(inputs, &Nx.Serving.run(serving, &1)),
          else: Nx.Serving.run(serving, inputs)

      started =
        for {label, partitions, defn} <- [
              {:batched, false, [compiler: Emily.Compiler]},
              {:partitioned, true, [compiler: Emily.Compiler, max_concurrency: 2]}
            ] do
          name = :"conformance_#{System.unique_integer([:positive])}"

          {:ok, pid} =
            Nx.Serving.start_link(
              serving: build.(defn),
              name: name,
              batch_size: 4,
              batch_timeout: 20,
              partitions: partitions
            )

          results =
            inputs
            |> Task.async_stream(&Nx.Serving.batched_run(name, &1), timeout: 120_000)
            |> Enum.map(fn {:ok, result} -> result end)

          Process.unlink(pid)
          ref = Process.monitor(pid)
          Process.exit(pid, :shutdown)
          assert_receive {:DOWN, ^ref, _, _, _}, 10_000
          {label, results}
        end

      [{:inline, inline} | started]
    end

    @doc """
    Greedy generation through Bumblebee's own loop (`Bumblebee.Text.Generation`), in
    `mode`: the generated token ids of each prompt, as lists.
    """
    def generate(%{model: model, params: params, spec: spec}, config, inputs, mode) do
      fun = Bumblebee.Text.Generation.build_generate(model, spec, config)
      batch = inputs |> Map.values() |> hd() |> Nx.axis_size(0)
      inputs = Map.put(inputs, "seed", Nx.broadcast(Nx.tensor(0, type: :s64), {batch}))
      %{token_ids: ids} = Nx.Defn.jit(fun, modes()[mode]).(params, inputs)
      Nx.to_list(ids)
    end

    @doc """
    A full-size checkpoint's directory: `$EMILY_CONFORMANCE_MODELS/<owner>--<name>`, else
    the Hugging Face cache's snapshot; nil when neither holds its config.json.
    """
    def local_checkpoint(hub_id) do
      dashed = String.replace(hub_id, "/", "--")
      hf_home = System.get_env("HF_HOME", Path.expand("~/.cache/huggingface"))

      candidates =
        List.wrap(
          System.get_env("EMILY_CONFORMANCE_MODELS") &&
            Path.join(System.get_env("EMILY_CONFORMANCE_MODELS"), dashed)
        ) ++
          Path.wildcard(Path.join([hf_home, "hub", "models--" <> dashed, "snapshots", "*"]))

      Enum.find(candidates, &File.exists?(Path.join(&1, "config.json")))
    end

    @doc "Uses `Emily.Backend` by default, in this process and in the servings' processes."
    def use_emily do
      Nx.global_default_backend(Emily.Backend)
      Nx.default_backend(Emily.Backend)
      :ok
    end
  end
end
