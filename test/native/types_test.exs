defmodule Emily.Native.TypesTest do
  use Emily.TestCase, async: true

  defp alive!, do: assert(l(N.add(s(), t([1.0]), t([2.0]))) == [3.0])

  describe "view (bitcast)" do
    test "same width" do
      # 1.0f32 = 0x3F800000; -2.0f32 = 0xC0000000.
      assert l(N.view(s(), t([1.0, -2.0]), {:u, 32})) == [0x3F800000, 0xC0000000]
      assert l(N.view(s(), t([0x3F800000], {:u, 32}), {:f, 32})) == [1.0]
      assert l(N.view(s(), t([-1], {:s, 16}), {:u, 16})) == [0xFFFF]
      assert l(N.view(s(), t([0x3F80], {:u, 16}), {:bf, 16})) == [1.0]
    end

    test "other widths resize the last axis" do
      y = N.view(s(), t([1.0]), {:u, 8})
      assert Emily.shape(y) == {4}
      # Little-endian bytes of 0x3F800000.
      assert l(y) == [0, 0, 128, 63]
      assert l(N.view(s(), t([0, 0, 128, 63], {:u, 8}), {:f, 32})) == [1.0]
    end

    test "errors" do
      assert_raise Emily.Error, ~r/view/, fn ->
        l(N.view(s(), t([1, 2, 3], {:u, 8}), {:u, 16}))
      end

      assert_raise ArgumentError, fn -> N.view(s(), t([1.0]), {:u, 3}) end
      alive!()
    end
  end

  describe "sub-byte integers, packed like Nx's bitstrings" do
    test "unpack: most significant bits first" do
      # <<1::4, 2::4, -3::4, 5::4>> = <<0x12, 0xD5>>
      packed = t([0x12, 0xD5], {:u, 8})
      u = N.unpack_bits(s(), packed, 4, false, 4)
      assert Emily.dtype(u) == {:u, 8}
      assert l(u) == [1, 2, 13, 5]
      i = N.unpack_bits(s(), packed, 4, true, 3)
      assert Emily.dtype(i) == {:s, 8}
      assert l(i) == [1, 2, -3]
      # 0x6F = 0b01_10_11_11
      assert l(N.unpack_bits(s(), t([0x6F], {:u, 8}), 2, false, 4)) == [1, 2, 3, 3]
      assert l(N.unpack_bits(s(), t([0x6F], {:u, 8}), 2, true, 4)) == [1, -2, -1, -1]
      # 0xA5 = 0b10100101
      assert l(N.unpack_bits(s(), t([0xA5], {:u, 8}), 1, false, 8)) == [1, 0, 1, 0, 0, 1, 0, 1]
      # Signed 1-bit values are 0 and -1.
      assert l(N.unpack_bits(s(), t([0xA5], {:u, 8}), 1, true, 3)) == [-1, 0, -1]
      assert l(N.unpack_bits(s(), packed, 4, false, 0)) == []
    end

    test "pack: row-major, low bits kept, trailing bits zero" do
      assert l(N.pack_bits(s(), t([1, 2, -3], {:s, 8}), 4)) == [0x12, 0xD0]
      assert l(N.pack_bits(s(), t([1, 2, 3, 4], {:s, 32}, {2, 2}), 4)) == [0x12, 0x34]
      assert l(N.pack_bits(s(), t([1, 2, 3], {:u, 8}), 2)) == [0x6C]
      assert l(N.pack_bits(s(), t([1, -2, -1, -1], {:s, 64}), 2)) == [0x6F]
      assert l(N.pack_bits(s(), t([true, false, true], :bool), 1)) == [0xA0]
      # 17 does not fit in 4 bits: its low bits (1) are kept.
      assert l(N.pack_bits(s(), t([17, 15], {:u, 16}), 4)) == [0x1F]
    end

    test "pack and unpack agree with Elixir's bitstrings" do
      values = [-8, -1, 0, 7, 3, -5, 6]
      bits = for v <- values, into: <<>>, do: <<v::4-signed>>
      padded = <<bits::bitstring, 0::size(8 - rem(bit_size(bits), 8))>>
      packed = N.pack_bits(s(), t(values, {:s, 8}), 4)
      assert Emily.to_binary(packed) == padded
      bytes = Emily.from_binary(padded, {byte_size(padded)}, {:u, 8})
      assert l(N.unpack_bits(s(), bytes, 4, true, length(values))) == values
    end

    test "errors" do
      packed = t([0x12], {:u, 8})

      assert_raise Emily.Error, ~r/unpack_bits: bits must be 1, 2 or 4, got 3/, fn ->
        l(N.unpack_bits(s(), packed, 3, false, 1))
      end

      assert_raise Emily.Error, ~r/1 bytes do not hold 3 values of 4 bits/, fn ->
        l(N.unpack_bits(s(), packed, 4, false, 3))
      end

      assert_raise Emily.Error, ~r/packed bytes must be a u8 tensor/, fn ->
        l(N.unpack_bits(s(), t([1], {:s, 8}), 4, false, 1))
      end

      assert_raise Emily.Error, ~r/pack_bits: expected an integer or bool tensor/, fn ->
        l(N.pack_bits(s(), t([1.0]), 4))
      end

      assert_raise Emily.Error, ~r/bits must be 1, 2 or 4, got 8/, fn ->
        l(N.pack_bits(s(), t([1], {:u, 8}), 8))
      end

      alive!()
    end
  end
end
