# Emily.MixedPrecision: an Axon model trained in bf16 with an f32 master copy reaches the
# accuracy of its f32 run on a synthetic MNIST-shaped problem (fixed seed), and dynamic
# loss scaling skips overflowing steps, halves the scale after them and doubles it after
# a period of good ones.
if Code.ensure_loaded?(Axon) do
  defmodule Emily.Training.MixedPrecisionTest do
    use ExUnit.Case, async: false
    @moduletag :training
    @moduletag :nx

    alias Emily.MixedPrecision, as: MP

    setup do
      Nx.default_backend(Emily.Backend)
      :ok
    end

    # 28x28 one-channel images of 10 classes: each class a fixed random stroke pattern,
    # each image its class's pattern at a random intensity under Gaussian noise strong
    # enough that 3 epochs reach about 90% (not 100%: a gap would show).
    defp digits(n, seed) do
      {patterns, _} = Nx.Random.uniform(Nx.Random.key(99), shape: {10, 784}, type: :f32)
      patterns = Nx.greater(patterns, 0.8) |> Nx.as_type(:f32)
      key = Nx.Random.key(seed)
      {labels, key} = Nx.Random.randint(key, 0, 10, shape: {n}, type: :s32)
      {gain, key} = Nx.Random.uniform(key, 0.3, 1.0, shape: {n, 1}, type: :f32)
      {noise, _} = Nx.Random.normal(key, 0.0, 1.2, shape: {n, 784}, type: :f32)
      images = Nx.take(patterns, labels, axis: 0) |> Nx.multiply(gain) |> Nx.add(noise)
      one_hot = Nx.equal(Nx.new_axis(labels, 1), Nx.iota({1, 10})) |> Nx.as_type(:f32)
      {Nx.reshape(images, {n, 28, 28, 1}), one_hot}
    end

    defp batches({x, y}, size), do: Stream.zip(Nx.to_batched(x, size), Nx.to_batched(y, size))

    defp model do
      Axon.input("x", shape: {nil, 28, 28, 1})
      |> Axon.flatten()
      |> Axon.dense(64, activation: :relu)
      |> Axon.dense(10, activation: :softmax)
    end

    defp accuracy(model, state, {x, y}) do
      {_, predict} = Axon.build(model, compiler: Emily.Compiler)
      pred = predict.(state, x)
      Nx.equal(Nx.argmax(pred, axis: 1), Nx.argmax(y, axis: 1)) |> Nx.mean() |> Nx.to_number()
    end

    # Runs `loop` over `data`, sending each iteration's step state to the test.
    defp run(loop, data, epochs) do
      parent = self()

      loop
      |> Axon.Loop.handle_event(:iteration_completed, fn state ->
        send(parent, {:step, state.step_state})
        {:continue, state}
      end)
      |> Axon.Loop.run(data, Axon.ModelState.empty(), epochs: epochs, compiler: Emily.Compiler)
    end

    defp steps(acc \\ []) do
      receive do
        {:step, s} -> steps([s | acc])
      after
        0 -> Enum.reverse(acc)
      end
    end

    defp params(%{model_state: %{data: data}}), do: data

    defp flat_params(state) do
      [params(state)] |> Nx.Defn.Composite.flatten_list() |> Enum.map(&Nx.to_flat_list/1)
    end

    @tag timeout: 300_000
    test "bf16 with an f32 master copy reaches the f32 run's accuracy in the same epochs" do
      train = digits(2048, 1)
      test_set = digits(512, 2)
      opt = Polaris.Optimizers.adam(learning_rate: 1.0e-3)

      f32 =
        model()
        |> Axon.Loop.trainer(:categorical_cross_entropy, opt, log: 0, seed: 0)
        |> run(batches(train, 64), 3)

      _ = steps()

      mixed =
        model()
        |> MP.trainer(:categorical_cross_entropy, opt, log: 0, seed: 0)
        |> run(batches(train, 64), 3)

      mixed_steps = steps()

      # The master copy stays f32; the forward pass computes in bf16 (the layers' policy).
      for t <- Nx.Defn.Composite.flatten_list([mixed.data]), do: assert(t.type == {:f, 32})
      mp_model = MP.apply_policy(model())
      {_, predict} = Axon.build(mp_model)
      assert predict.(mixed, elem(test_set, 0)).type == {:f, 32}

      f32_acc = accuracy(model(), f32, test_set)
      mixed_acc = accuracy(mp_model, mixed, test_set)
      # (measured: 0.898 both)
      assert f32_acc >= 0.85, "f32 accuracy #{f32_acc}"
      assert mixed_acc >= f32_acc - 0.02, "mixed #{mixed_acc} against f32 #{f32_acc}"

      # No step overflowed at the default scale: it never shrank.
      scales = Enum.map(mixed_steps, &Nx.to_number(&1.loss_scale_state.loss_scale))
      assert length(scales) == 3 * 32
      assert Enum.all?(scales, &(&1 == 2.0 ** 15))
    end

    test "an overflowing step is skipped and halves the scale; good steps double it" do
      {x, y} = digits(64, 3)
      opt = Polaris.Optimizers.adam(learning_rate: 1.0e-2)
      # batch 2 holds an infinity: its gradients are NaN
      poisoned = Nx.put_slice(x, [16, 0, 0, 0], Nx.broadcast(:infinity, {1, 1, 1, 1}))
      data = Stream.zip(Nx.to_batched(poisoned, 8), Nx.to_batched(y, 8))

      model()
      |> MP.trainer(:categorical_cross_entropy, opt,
        log: 0,
        seed: 0,
        loss_scale: [init_scale: 1024, period: 3]
      )
      |> run(data, 1)

      [s0, s1, s2, s3, s4, s5, s6, s7] = steps()
      scale = &Nx.to_number(&1.loss_scale_state.loss_scale)
      counter = &Nx.to_number(&1.loss_scale_state.counter)

      # step 1 good, step 2 poisoned: skipped (parameters and optimizer state kept),
      # the scale halved and the good-step count reset
      assert {scale.(s0), counter.(s0)} == {1024.0, 1}
      assert {scale.(s1), counter.(s1)} == {1024.0, 2}
      assert {scale.(s2), counter.(s2)} == {512.0, 0}
      assert flat_params(s2) == flat_params(s1)

      opt_state =
        &Enum.map(Nx.Defn.Composite.flatten_list([&1.optimizer_state]), fn t ->
          Nx.to_flat_list(t)
        end)

      assert opt_state.(s2) == opt_state.(s1)

      # three good steps in a row double it
      assert {scale.(s3), counter.(s3)} == {512.0, 1}
      assert {scale.(s4), counter.(s4)} == {512.0, 2}
      assert {scale.(s5), counter.(s5)} == {1024.0, 0}
      assert flat_params(s3) != flat_params(s2)
      assert {scale.(s6), scale.(s7)} == {1024.0, 1024.0}
    end

    test "a scale so large the loss overflows: skipped and halved until it fits" do
      {x, y} = digits(32, 4)
      data = batches({x, y}, 8)

      state =
        model()
        |> MP.trainer(:categorical_cross_entropy, Polaris.Optimizers.sgd(learning_rate: 0.1),
          log: 0,
          seed: 0,
          loss_scale: [init_scale: 3.0e38, max_scale: 3.0e38]
        )
        |> run(data, 1)

      [s0, s1 | _] = steps = steps()
      scales = Enum.map(steps, &Nx.to_number(&1.loss_scale_state.loss_scale))
      # 3e38 times a loss of about 2 overflows f32: the first two steps are skipped
      assert_in_delta Enum.at(scales, 0), 1.5e38, 1.0e32
      assert_in_delta Enum.at(scales, 1), 7.5e37, 1.0e31
      assert flat_params(s1) == flat_params(s0)
      assert Enum.all?(Enum.zip(scales, tl(scales)), fn {a, b} -> b <= a end)

      for t <- Nx.Defn.Composite.flatten_list([state.data]),
          do: assert(Nx.to_number(Nx.all(Nx.is_nan(t) |> Nx.logical_not())) == 1)
    end

    test "bad options raise ArgumentError" do
      assert_raise ArgumentError, ~r/:compute must be/, fn -> MP.policy(compute: {:s, 8}) end

      assert_raise ArgumentError, ~r/:period must be a positive integer/, fn ->
        MP.loss_scale(period: 0)
      end

      assert_raise ArgumentError, ~r/:init_scale must be a positive number/, fn ->
        MP.loss_scale(init_scale: -1)
      end

      assert_raise ArgumentError, ~r/expected a Polaris optimizer/, fn -> MP.optimizer(:nope?) end
    end
  end
else
  defmodule Emily.Training.MixedPrecisionTest do
    use ExUnit.Case, async: true
    @moduletag :training
    require Emily.NxAbsent
    Emily.NxAbsent.placeholders()
  end
end
