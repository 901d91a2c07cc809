# The training canary: Axon models trained with Axon.Loop on synthetic data made with a
# fixed seed, on Emily alone (no fallback), to a stated accuracy, with the same loss curve
# eager (Nx.Defn.Evaluator over Emily.Backend) and under Emily.Compiler.
# Run with `mix test --only training` where Axon is available.
if Code.ensure_loaded?(Axon) do
  defmodule Emily.Training.AxonTest do
    use ExUnit.Case, async: false
    @moduletag :training
    @moduletag :nx

    setup do
      Nx.default_backend(Emily.Backend)
      :ok
    end

    # Four classes of points in [-1, 1]², split by the two diagonals: not linearly
    # separable in the inputs, so the hidden layer has to learn.
    defp points(n, seed) do
      key = Nx.Random.key(seed)
      {x, _} = Nx.Random.uniform(key, -1.0, 1.0, shape: {n, 2}, type: :f32)
      a = Nx.greater(x[[.., 0]], x[[.., 1]])
      b = Nx.greater(Nx.add(x[[.., 0]], x[[.., 1]]), 0)
      labels = Nx.add(Nx.multiply(a, 2), b)
      {x, Nx.equal(Nx.new_axis(labels, 1), Nx.iota({1, 4})) |> Nx.as_type(:f32)}
    end

    # 8x8 one-channel images holding one bright bar, horizontal or vertical, at a random
    # row or column, under uniform noise: the class is the bar's orientation.
    defp bars(n, seed) do
      key = Nx.Random.key(seed)
      {noise, key} = Nx.Random.uniform(key, 0.0, 0.3, shape: {n, 8, 8, 1}, type: :f32)
      {pos, key} = Nx.Random.randint(key, 0, 8, shape: {n}, type: :s32)
      {cls, _} = Nx.Random.randint(key, 0, 2, shape: {n}, type: :s32)
      iota = Nx.iota({1, 8})
      on = Nx.equal(iota, Nx.new_axis(pos, 1))
      rows = Nx.new_axis(on, 2) |> Nx.broadcast({n, 8, 8})
      cols = Nx.new_axis(on, 1) |> Nx.broadcast({n, 8, 8})
      vertical = cls |> Nx.reshape({n, 1, 1}) |> Nx.broadcast({n, 8, 8})
      bar = Nx.select(vertical, cols, rows) |> Nx.new_axis(3)
      images = Nx.add(noise, Nx.as_type(bar, :f32))
      {images, Nx.equal(Nx.new_axis(cls, 1), Nx.iota({1, 2})) |> Nx.as_type(:f32)}
    end

    defp batches({x, y}, batch_size) do
      Stream.zip(Nx.to_batched(x, batch_size), Nx.to_batched(y, batch_size))
    end

    defp mlp do
      Axon.input("x", shape: {nil, 2})
      |> Axon.dense(32, activation: :tanh)
      |> Axon.dense(4, activation: :softmax)
    end

    defp cnn do
      Axon.input("x", shape: {nil, 8, 8, 1})
      |> Axon.conv(8, kernel_size: 3, activation: :relu)
      |> Axon.max_pool(kernel_size: 2)
      |> Axon.flatten()
      |> Axon.dense(2, activation: :softmax)
    end

    # Trains `model` for `epochs` with the given defn compiler; returns the trained model
    # state and the loss after every iteration.
    defp train(model, data, epochs, compiler) do
      parent = self()

      state =
        model
        |> Axon.Loop.trainer(
          :categorical_cross_entropy,
          Polaris.Optimizers.adam(learning_rate: 0.01),
          log: 0,
          seed: 0
        )
        |> Axon.Loop.handle_event(:iteration_completed, fn state ->
          send(parent, {:loss, Nx.to_number(state.step_state.loss)})
          {:continue, state}
        end)
        |> Axon.Loop.run(data, Axon.ModelState.empty(), epochs: epochs, compiler: compiler)

      {state, collect_losses([])}
    end

    defp collect_losses(acc) do
      receive do
        {:loss, l} -> collect_losses([l | acc])
      after
        0 -> Enum.reverse(acc)
      end
    end

    defp accuracy(model, state, {x, y}) do
      pred = Axon.predict(model, state, x, compiler: Emily.Compiler)
      Nx.equal(Nx.argmax(pred, axis: 1), Nx.argmax(y, axis: 1)) |> Nx.mean() |> Nx.to_number()
    end

    # Fails the test if any op ran off MLX while `fun` ran.
    defp without_fallback(fun) do
      id = {__MODULE__, make_ref()}
      parent = self()

      :telemetry.attach(id, [:emily, :fallback, :start], &__MODULE__.forward_fallback/4, parent)

      try do
        result = fun.()
        refute_received {:fallback, _}
        result
      after
        :telemetry.detach(id)
      end
    end

    def forward_fallback(_event, _measurements, meta, pid), do: send(pid, {:fallback, meta})

    defp assert_same_curve(eager, compiled) do
      assert length(eager) == length(compiled)

      for {a, b} <- Enum.zip(eager, compiled) do
        assert_in_delta a, b, 1.0e-4 * max(1.0, abs(a))
      end
    end

    @tag timeout: 300_000
    test "an MLP learns the diagonal quadrants to 95% accuracy, the same curve eager and compiled" do
      train_set = points(2048, 1)
      test_set = points(512, 2)

      without_fallback(fn ->
        {state, compiled} = train(mlp(), batches(train_set, 64), 8, Emily.Compiler)
        {_state, eager} = train(mlp(), batches(train_set, 64), 8, Nx.Defn.Evaluator)

        assert length(compiled) == 8 * 32
        assert_same_curve(eager, compiled)
        assert List.last(compiled) < List.first(compiled) / 4
        assert accuracy(mlp(), state, test_set) >= 0.95
      end)
    end

    @tag timeout: 300_000
    test "a CNN tells horizontal from vertical bars to 98% accuracy, the same curve eager and compiled" do
      train_set = bars(512, 3)
      test_set = bars(256, 4)

      without_fallback(fn ->
        {state, compiled} = train(cnn(), batches(train_set, 32), 3, Emily.Compiler)
        {_state, eager} = train(cnn(), batches(train_set, 32), 3, Nx.Defn.Evaluator)

        assert_same_curve(eager, compiled)
        assert accuracy(cnn(), state, test_set) >= 0.98
      end)
    end
  end
else
  defmodule Emily.Training.AxonTest do
    use ExUnit.Case, async: true
    @moduletag :training
    require Emily.NxAbsent
    Emily.NxAbsent.placeholders()
  end
end
