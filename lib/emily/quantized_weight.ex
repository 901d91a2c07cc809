if Code.ensure_loaded?(Nx) do
  defmodule Emily.QuantizedWeight do
    @moduledoc """
    A weight quantized along its last axis, as MLX stores it: `Emily.Quantization.quantize/2`
    makes one, `Emily.Quantization.dequantize/1` and `Emily.Quantization.quantized_matmul/3`
    use it (see `Emily.Quantization` for the modes and their accuracy).

    Fields:

      * `:value` - the packed codes, a `u32` tensor: each row of the weight's last axis
        is one little-endian bit stream, element `i` in bits `i * bits ..
        (i + 1) * bits - 1`, so the last axis is `size * bits / 32` words.
      * `:scales` - one scale per group of `group_size` consecutive elements of the
        last axis: in the weight's type (`:affine`), or `u8` codes (E8M0 powers of two
        for `:mxfp4` and `:mxfp8`, E4M3 for `:nvfp4`).
      * `:biases` - one bias per group (`:affine`), `nil` in the other modes.
      * `:global_scale` - `:nvfp4` only, optional: an f32 scalar (the weight's largest
        magnitude when quantized) that spreads the E4M3 scales over their range.
      * `:mode` - `:affine`, `:mxfp4`, `:nvfp4` or `:mxfp8`.
      * `:bits`, `:group_size` - bits per element and elements per scale.
      * `:shape`, `:type` - the logical weight: the shape and type `dequantize/1` gives.

    It is an `Nx.Container` of its tensors (`value`, `scales` and, where present,
    `biases` and `global_scale`); the other fields travel with it unchanged. So it is a
    valid argument and result of `defn` functions, `Nx.Defn.jit/2`, `Nx.Serving` and
    `Nx.backend_transfer/2` (moving the packed tensors, never dequantizing them), and
    can sit in an Axon model state in place of a kernel.

        iex> w = Nx.iota({4, 64}, type: :f32)
        iex> Emily.Quantization.quantize(w, bits: 4, group_size: 32) |> inspect()
        "#Emily.QuantizedWeight<affine 4-bit group 32 f32[4][64] packed u32[4][8]>"
    """

    @enforce_keys [:value, :scales, :mode, :bits, :group_size, :shape, :type]
    defstruct [
      :value,
      :scales,
      :mode,
      :bits,
      :group_size,
      :shape,
      :type,
      biases: nil,
      global_scale: nil
    ]

    @type mode :: :affine | :mxfp4 | :nvfp4 | :mxfp8

    @type t :: %__MODULE__{
            value: Nx.Tensor.t(),
            scales: Nx.Tensor.t(),
            biases: Nx.Tensor.t() | nil,
            global_scale: Nx.Tensor.t() | nil,
            mode: mode,
            bits: pos_integer,
            group_size: pos_integer,
            shape: tuple,
            type: Nx.Type.t()
          }

    @doc """
    The bytes the quantized weight holds (packed codes, scales, biases), against
    `Nx.byte_size/1` of the float weight it stands for.
    """
    @spec byte_size(t) :: non_neg_integer
    def byte_size(%__MODULE__{} = qw) do
      [qw.value, qw.scales, qw.biases, qw.global_scale]
      |> Enum.reject(&is_nil/1)
      |> Enum.map(&Nx.byte_size/1)
      |> Enum.sum()
    end

    defimpl Nx.Container do
      def traverse(qw, acc, fun) do
        {value, acc} = fun.(qw.value, acc)
        {scales, acc} = fun.(qw.scales, acc)
        {biases, acc} = optional(qw.biases, acc, fun)
        {global_scale, acc} = optional(qw.global_scale, acc, fun)

        {%{qw | value: value, scales: scales, biases: biases, global_scale: global_scale}, acc}
      end

      def reduce(qw, acc, fun) do
        [qw.value, qw.scales, qw.biases, qw.global_scale]
        |> Enum.reject(&is_nil/1)
        |> Enum.reduce(acc, fun)
      end

      # Nx.serialize/2: the tensors present, by field, and the other fields as metadata.
      def serialize(qw) do
        tensors =
          for field <- [:value, :scales, :biases, :global_scale],
              Map.fetch!(qw, field) != nil,
              do: {field, Map.fetch!(qw, field)}

        meta = Map.take(qw, [:mode, :bits, :group_size, :shape, :type])
        {__MODULE__, tensors, meta}
      end

      def deserialize(tensors, meta),
        do: struct!(Emily.QuantizedWeight, Map.to_list(meta) ++ tensors)

      defp optional(nil, acc, _fun), do: {nil, acc}
      defp optional(t, acc, fun), do: fun.(t, acc)
    end

    defimpl Inspect do
      def inspect(qw, _opts) do
        "#Emily.QuantizedWeight<#{qw.mode} #{qw.bits}-bit group #{qw.group_size} " <>
          "#{shape(qw.type, qw.shape)} packed #{packed(qw.value)}" <>
          if(qw.global_scale != nil, do: " global_scale", else: "") <> ">"
      end

      defp packed(%Nx.Tensor{type: type, shape: shape}), do: shape(type, shape)
      defp packed(other), do: Kernel.inspect(other)

      defp shape(type, shape) do
        dims = shape |> Tuple.to_list() |> Enum.map_join(&"[#{&1}]")
        Nx.Type.to_string(type) <> dims
      end
    end
  end
end
