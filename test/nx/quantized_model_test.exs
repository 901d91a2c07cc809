# Emily.Quantization.quantize_model/3: an Axon model and its state quantized in one call,
# packed (MLX's quantized kernels) or dequantized at load (the CPU rule), with layers
# kept in float by name or because the group size does not divide them.
if Code.ensure_loaded?(Axon) do
  defmodule Emily.Nx.QuantizedModelTest do
    use ExUnit.Case, async: false
    @moduletag :training
    @moduletag :nx

    import Emily.NxCompiler
    alias Emily.Quantization, as: Q
    alias Emily.QuantizedWeight, as: QW

    setup do
      Nx.default_backend(Emily.Backend)
      :ok
    end

    defp model do
      Axon.input("ids", shape: {nil, 4})
      |> Axon.embedding(50, 64, name: "embed")
      |> Axon.dense(128, activation: :relu, name: "up")
      |> Axon.dense(96, use_bias: false, name: "mid")
      # 96 inputs: no group size of 64 divides them
      |> Axon.dense(32, name: "head")
    end

    defp init do
      {init_fn, _} = Axon.build(model(), seed: 0)
      init_fn.(Nx.template({2, 4}, :s64), Axon.ModelState.empty())
    end

    defp ids, do: Nx.tensor([[1, 7, 49, 0], [3, 3, 12, 30]])

    defp predict(model, state, opts \\ []),
      do: Axon.predict(model, state, %{"ids" => ids()}, opts)

    defp max_abs(t), do: t |> Nx.abs() |> Nx.reduce_max() |> Nx.to_number()
    defp rel(a, b), do: max_abs(Nx.subtract(a, b)) / max_abs(b)

    test "packed: quantized kernels, rewritten layers, the same outputs as the dequantized weights" do
      state = init()
      {qm, qs} = Q.quantize_model(model(), state, bits: 8, embeddings: true, packed: true)

      assert %QW{bits: 8, shape: {128, 64}} = qs.data["up"]["kernel"]
      assert %QW{shape: {50, 64}} = qs.data["embed"]["kernel"]
      assert %QW{shape: {96, 128}} = qs.data["mid"]["kernel"]
      # 96 is not a multiple of the group size 64: float
      assert %Nx.Tensor{shape: {96, 32}} = qs.data["head"]["kernel"]
      # biases stay float
      assert %Nx.Tensor{shape: {128}} = qs.data["up"]["bias"]

      float_model = model()
      {dm, ds} = Q.quantize_model(float_model, state, bits: 8, embeddings: true, packed: false)
      assert dm == float_model

      for layer <- ["up", "mid", "embed"],
          do: assert(%Nx.Tensor{type: {:f, 32}} = ds.data[layer]["kernel"])

      assert ds.data["up"]["kernel"].shape == {64, 128}

      assert Nx.to_flat_list(ds.data["up"]["kernel"]) ==
               Nx.to_flat_list(Nx.transpose(Q.dequantize(qs.data["up"]["kernel"])))

      float = predict(model(), state)
      packed = predict(qm, qs)
      dequantized = predict(dm, ds)
      assert packed.shape == {2, 4, 32}
      # the same weights' values: MLX's kernel against BLAS, f32 rounding apart
      assert rel(packed, dequantized) <= 1.0e-5
      # 8-bit against the float weights (the module documentation's table: 0.007)
      assert rel(packed, float) <= 0.03
    end

    test "Emily.Compiler runs the packed model on its native path" do
      {qm, qs} = Q.quantize_model(model(), init(), packed: true, bits: 4, embeddings: true)
      eager = predict(qm, qs)
      {out, fallbacks} = with_fallbacks(fn -> predict(qm, qs, compiler: Emily.Compiler) end)
      assert debug_fallbacks?(fallbacks), inspect(fallbacks)
      assert Nx.to_flat_list(out) == Nx.to_flat_list(eager)
    end

    test "except keeps named layers in float; the default on the CPU dequantizes at load" do
      state = init()
      {qm, qs} = Q.quantize_model(model(), state, packed: true, except: ["up"], mode: :mxfp4)
      assert %Nx.Tensor{} = qs.data["up"]["kernel"]
      assert %QW{mode: :mxfp4} = qs.data["mid"]["kernel"]
      # embeddings only on request
      assert %Nx.Tensor{} = qs.data["embed"]["kernel"]
      assert predict(qm, qs).shape == {2, 4, 32}

      float_model = model()
      {dm, ds} = Q.quantize_model(float_model, state)

      if Emily.default_device() == :cpu do
        assert dm == float_model
        assert %Nx.Tensor{shape: {64, 128}} = ds.data["up"]["kernel"]
      else
        assert %QW{} = ds.data["up"]["kernel"]
      end
    end

    test "bad options raise ArgumentError before any layer is touched" do
      assert_raise ArgumentError, ~r/takes bits/, fn ->
        Q.quantize_model(model(), init(), bits: 7)
      end

      assert_raise ArgumentError, ~r/unknown keys \[:layers\]/, fn ->
        Q.quantize_model(model(), init(), layers: [])
      end

      assert_raise ArgumentError, ~r/expected an Axon.ModelState/, fn ->
        Q.quantize_model(model(), %{})
      end
    end
  end
else
  defmodule Emily.Nx.QuantizedModelTest do
    use ExUnit.Case, async: true
    @moduletag :training
    require Emily.NxAbsent
    Emily.NxAbsent.placeholders()
  end
end
