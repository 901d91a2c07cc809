defmodule Emily.Backend.Storage do
  @moduledoc false
  # How each Nx type is held in an MLX array.
  #
  # MLX has no sub-byte integers, no f8 dtypes and no complex128. Tensors of those types
  # still live in MLX (so they can be created, moved between streams, sliced out of
  # batches and read back like any other), but in a *storage* dtype:
  #
  #   * u2/u4/s2/s4 are unpacked at the boundary, one element per byte (u8/s8), so the
  #     array has the tensor's own shape;
  #   * f8 (E5M2), f8_e4m3fn and c128 are kept as their raw bytes (u8), with a trailing
  #     axis of the element's byte size where that is more than one.
  #
  # Sub-byte types are packed and unpacked on the device (Emily.Backend's to_binary and
  # from_binary). Ops on all of these types go through the Nx.BinaryBackend fallback.

  @native [
    {:u, 8},
    {:u, 16},
    {:u, 32},
    {:u, 64},
    {:s, 8},
    {:s, 16},
    {:s, 32},
    {:s, 64},
    {:f, 16},
    {:bf, 16},
    {:f, 32},
    {:f, 64},
    {:c, 64}
  ]

  @doc "The Nx types MLX computes with directly."
  def native_types, do: @native

  @doc "Whether MLX computes with `type` directly."
  def native?(type), do: type in @native

  @doc "The MLX dtype that holds a tensor of Nx `type`."
  def dtype(type) when type in @native, do: type
  def dtype({:u, bits}) when bits < 8, do: {:u, 8}
  def dtype({:s, bits}) when bits < 8, do: {:s, 8}
  def dtype({:f, 8}), do: {:u, 8}
  def dtype({:f8_e4m3fn, 8}), do: {:u, 8}
  def dtype({:c, 128}), do: {:u, 8}

  def dtype(type) do
    raise ArgumentError, "Emily.Backend does not support the Nx type #{inspect(type)}"
  end

  @doc "The shape of the MLX array that holds a tensor of `type` and `shape`."
  def shape({:c, 128}, shape), do: Tuple.insert_at(shape, tuple_size(shape), 16)
  def shape(_type, shape), do: shape

  @doc "The storage layout to Nx's layout of `type`, keeping the first `limit` elements."
  def to_nx_binary(bin, {_, bits}, limit) do
    binary_part(bin, 0, min(limit * div(bits, 8), byte_size(bin)))
  end
end
