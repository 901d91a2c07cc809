defmodule EmilyTest do
  use Emily.TestCase, async: true
  doctest Emily

  @dtypes [:bool, {:u, 8}, {:u, 16}, {:u, 32}, {:u, 64}, {:s, 8}, {:s, 16}, {:s, 32}, {:s, 64}] ++
            [{:f, 16}, {:bf, 16}, {:f, 32}, {:f, 64}, {:c, 64}]

  describe "dtypes" do
    test "every MLX dtype round-trips through from_binary/to_binary with its Nx name" do
      for dtype <- @dtypes do
        values =
          case dtype do
            :bool -> [true, false, true]
            {:c, _} -> [{1.0, -2.0}, {0.5, 0.25}, {0.0, 0.0}]
            {:f, _} -> [1.5, -2.25, :infinity]
            {:bf, _} -> [1.5, -2.25, :neg_infinity]
            {:s, n} -> [-(2 ** (n - 1)), 0, 2 ** (n - 1) - 1]
            {:u, n} -> [0, 1, 2 ** n - 1]
          end

        bin = Emily.Codec.pack(values, dtype)
        tensor = Emily.from_binary(bin, {3}, dtype, device: :cpu)
        assert Emily.dtype(tensor) == dtype
        assert Emily.shape(tensor) == {3}
        assert Emily.nbytes(tensor) == byte_size(bin)
        assert Emily.to_binary(tensor) == bin
        assert Emily.to_list(tensor) == values
      end
    end

    test "NaN survives the round trip" do
      for dtype <- [{:f, 16}, {:bf, 16}, {:f, 32}, {:f, 64}] do
        assert l(t([:nan, 1.0], dtype)) == [:nan, 1.0]
      end
    end

    test "unknown dtypes are an ArgumentError" do
      for bad <- [{:f, 8}, {:c, 128}, {:u, 4}, :float, "f32", {:f}] do
        assert_raise ArgumentError, ~r/unknown dtype/, fn ->
          Emily.from_binary(<<0>>, {1}, bad)
        end
      end
    end
  end

  describe "from_binary" do
    test "shapes: scalars, empty, tuples and lists" do
      assert Emily.shape(Emily.from_binary(<<1.0::float-32-native>>, {}, {:f, 32})) == {}
      assert Emily.shape(Emily.from_binary(<<>>, {0, 3}, {:f, 32})) == {0, 3}
      assert Emily.to_binary(Emily.from_binary(<<>>, {0}, {:s, 32})) == <<>>
      assert Emily.shape(Emily.from_binary(<<0::64>>, [2, 1], {:s, 32})) == {2, 1}
    end

    test "the byte size must match shape and dtype" do
      assert_raise ArgumentError, ~r/7 bytes do not hold a f32 tensor/, fn ->
        Emily.from_binary(<<0::56>>, {2}, {:f, 32})
      end
    end

    test "bad shapes are an ArgumentError" do
      for bad <- [{-1}, {2, -3}, [1.5], :shape, {:a}, {2 ** 40}] do
        assert_raise ArgumentError, fn -> Emily.from_binary(<<>>, bad, {:f, 32}) end
      end
    end

    test "the binary is copied: later changes to the source do not leak in" do
      src = :binary.copy(<<1::32-native, 2::32-native>>)
      tensor = Emily.from_binary(src, {2}, {:s, 32})
      assert Emily.to_list(tensor) == [1, 2]
    end
  end

  describe "to_binary" do
    test "reads back a non-contiguous (transposed) result in row-major order" do
      x = t([1, 2, 3, 4, 5, 6], {:s, 32}, {2, 3})
      assert l(N.transpose(s(), x, [1, 0])) == [1, 4, 2, 5, 3, 6]
    end

    test "is a view: the same binary can be read after the tensor is dropped" do
      bin = Emily.to_binary(N.full(s(), {1024}, 2.5, {:f, 32}))
      :erlang.garbage_collect()
      assert byte_size(bin) == 4096
      assert bin == :binary.copy(<<2.5::float-32-native>>, 1024)
    end
  end

  test "eval/1 evaluates one tensor or a list" do
    a = N.add(s(), t([1.0]), t([2.0]))
    assert Emily.eval(a) == :ok
    assert Emily.eval([a, N.exp(s(), a)]) == :ok
    assert Emily.eval([]) == :ok
    assert l(a) == [3.0]
  end

  test "device selection" do
    assert :cpu in Emily.devices()
    assert Emily.default_device() in Emily.devices()
    cpu = Emily.from_list([1.0], {:f, 32}, device: :cpu)
    assert N.tensor_on_stream(cpu, Emily.Stream.default(:cpu))

    unless :gpu in Emily.devices() do
      assert_raise ArgumentError, ~r/not available/, fn ->
        Emily.from_list([1.0], {:f, 32}, device: :gpu)
      end
    end
  end

  test "mlx_version" do
    assert Emily.mlx_version() =~ ~r/^\d+\.\d+\.\d+/
  end
end
