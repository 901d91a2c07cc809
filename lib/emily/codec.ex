defmodule Emily.Codec do
  @moduledoc false
  # Packs Elixir numbers into the native byte layout of each dtype and back.

  @doc "Native-endian bytes of `numbers` as `dtype`."
  def pack(numbers, dtype), do: for(x <- numbers, into: <<>>, do: pack1(x, dtype))

  @doc "Numbers from native-endian bytes of `dtype`."
  def unpack(bin, :bool), do: for(<<x <- bin>>, do: x != 0)
  def unpack(bin, {:u, n}), do: for(<<x::unsigned-native-size(n) <- bin>>, do: x)
  def unpack(bin, {:s, n}), do: for(<<x::signed-native-size(n) <- bin>>, do: x)
  def unpack(bin, {:f, n}), do: for(<<x::bits-size(n) <- bin>>, do: read_float(x, n))

  def unpack(bin, {:bf, 16}),
    do: for(<<x::native-16 <- bin>>, do: read_float(<<Bitwise.bsl(x, 16)::native-32>>, 32))

  def unpack(bin, {:c, 64}),
    do: for(<<re::bits-32, im::bits-32 <- bin>>, do: {read_float(re, 32), read_float(im, 32)})

  defp pack1(x, :bool), do: <<if(x in [0, false] or x == 0.0, do: 0, else: 1)>>
  defp pack1(x, {:u, n}), do: <<x::unsigned-native-size(n)>>
  defp pack1(x, {:s, n}), do: <<x::signed-native-size(n)>>
  defp pack1(x, {:f, n}), do: float(x, n)

  defp pack1(x, {:bf, 16}) do
    <<hi::16, _::16>> = float_be(x, 32)
    <<hi::native-16>>
  end

  defp pack1(%{re: re, im: im}, {:c, 64}), do: float(re, 32) <> float(im, 32)
  defp pack1({re, im}, {:c, 64}), do: float(re, 32) <> float(im, 32)
  defp pack1(x, {:c, 64}), do: float(x, 32) <> float(0, 32)

  defp float(x, n) do
    case float_be(x, n) do
      <<v::size(n)>> -> <<v::native-size(n)>>
    end
  end

  defp float_be(:nan, 16), do: <<0x7E00::16>>
  defp float_be(:nan, 32), do: <<0x7FC00000::32>>
  defp float_be(:nan, 64), do: <<0x7FF8000000000000::64>>
  defp float_be(:infinity, 16), do: <<0x7C00::16>>
  defp float_be(:infinity, 32), do: <<0x7F800000::32>>
  defp float_be(:infinity, 64), do: <<0x7FF0000000000000::64>>
  defp float_be(:neg_infinity, 16), do: <<0xFC00::16>>
  defp float_be(:neg_infinity, 32), do: <<0xFF800000::32>>
  defp float_be(:neg_infinity, 64), do: <<0xFFF0000000000000::64>>
  defp float_be(x, n), do: <<x::float-size(n)>>

  defp read_float(native_bits, n) do
    <<v::native-size(n)>> = native_bits

    case <<v::size(n)>> do
      <<f::float-size(n)>> -> f
      bits -> special(bits, n)
    end
  end

  defp special(bits, n) do
    <<sign::1, _::bits>> = bits
    <<v::size(n)>> = bits
    mantissa_bits = %{16 => 10, 32 => 23, 64 => 52}[n]
    mantissa = Bitwise.band(v, Bitwise.bsl(1, mantissa_bits) - 1)

    cond do
      mantissa != 0 -> :nan
      sign == 1 -> :neg_infinity
      true -> :infinity
    end
  end
end
