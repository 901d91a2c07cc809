defmodule Emily.Native.ElementwiseTest do
  use Emily.TestCase, async: true

  describe "unary" do
    test "f32 math against hand-computed values" do
      x = t([0.0, 1.0, 4.0])
      assert_close(l(N.sqrt(s(), x)), [0.0, 1.0, 2.0])
      assert_close(l(N.exp(s(), x)), [1.0, 2.718281828, 54.59815003])
      assert_close(l(N.log1p(s(), x)), [0.0, 0.693147181, 1.609437912])
      assert_close(l(N.square(s(), x)), [0.0, 1.0, 16.0])
      assert_close(l(N.sigmoid(s(), t([0.0]))), [0.5])
      assert_close(l(N.tanh(s(), t([0.5]))), [0.462117157])
      assert_close(l(N.erf(s(), t([1.0]))), [0.842700793])
      assert_close(l(N.rsqrt(s(), t([4.0]))), [0.5])
      assert l(N.log(s(), t([0.0, -1.0]))) == [:neg_infinity, :nan]
    end

    test "rounding follows half-to-even" do
      x = t([-1.5, -0.5, 0.5, 1.5, 2.5])
      assert l(N.round(s(), x, 0)) == [-2.0, -0.0, 0.0, 2.0, 2.0]
      assert l(N.floor(s(), x)) == [-2.0, -1.0, 0.0, 1.0, 2.0]
      assert l(N.ceil(s(), x)) == [-1.0, -0.0, 1.0, 2.0, 3.0]
    end

    test "integer and bool inputs" do
      assert l(N.abs(s(), t([-3, 0, 5], {:s, 32}))) == [3, 0, 5]
      assert l(N.negative(s(), t([1, -2], {:s, 8}))) == [-1, 2]
      assert l(N.sign(s(), t([-7, 0, 9], {:s, 64}))) == [-1, 0, 1]
      assert l(N.bitwise_invert(s(), t([0, 255], {:u, 8}))) == [255, 0]
      assert l(N.logical_not(s(), t([true, false], :bool))) == [false, true]
    end

    test "predicates return bool" do
      x = t([1.0, :nan, :infinity, :neg_infinity])
      assert l(N.isnan(s(), x)) == [false, true, false, false]
      assert l(N.isinf(s(), x)) == [false, false, true, true]
      assert l(N.isfinite(s(), x)) == [true, false, false, false]
    end

    test "complex parts" do
      z = t([{1.0, 2.0}, {-3.0, 0.5}], {:c, 64})
      assert l(N.real(s(), z)) == [1.0, -3.0]
      assert l(N.imag(s(), z)) == [2.0, 0.5]
      assert l(N.conjugate(s(), z)) == [{1.0, -2.0}, {-3.0, -0.5}]
    end

    test "f16 and bf16 keep their dtype" do
      for dt <- [{:f, 16}, {:bf, 16}] do
        y = N.exp(s(), t([0.0, 1.0], dt))
        assert Emily.dtype(y) == dt
        assert_close(l(y), [1.0, 2.718281828], 1.0e-2)
      end
    end

    test "astype" do
      assert l(N.astype(s(), t([1.7, -1.7, 300.0]), {:s, 32})) == [1, -1, 300]
      assert l(N.astype(s(), t([0, 2], {:s, 32}), :bool)) == [false, true]
      assert l(N.astype(s(), t([1, 2], {:u, 8}), {:f, 16})) == [1.0, 2.0]
      assert l(N.astype(s(), t([1.5]), {:c, 64})) == [{1.5, 0.0}]
      # f64 lives on the CPU device only.
      x = Emily.from_list([1.0], {:f, 32}, device: :cpu)
      assert l(N.astype(cpu(), x, {:f, 64})) == [1.0]
    end
  end

  describe "binary" do
    test "arithmetic with broadcasting" do
      a = t([1.0, 2.0, 3.0, 4.0], {:f, 32}, {2, 2})
      b = t([10.0, 20.0])
      assert l(N.add(s(), a, b)) == [11.0, 22.0, 13.0, 24.0]
      assert l(N.subtract(s(), a, b)) == [-9.0, -18.0, -7.0, -16.0]
      assert l(N.multiply(s(), a, b)) == [10.0, 40.0, 30.0, 80.0]
      assert_close(l(N.divide(s(), a, b)), [0.1, 0.1, 0.3, 0.2])
      assert l(N.power(s(), a, t([2.0]))) == [1.0, 4.0, 9.0, 16.0]
      assert l(N.maximum(s(), a, t([2.5]))) == [2.5, 2.5, 3.0, 4.0]
      assert l(N.minimum(s(), a, t([2.5]))) == [1.0, 2.0, 2.5, 2.5]
    end

    test "integer division and remainder follow the sign of the divisor (Python)" do
      a = t([7, -7, 7, -7], {:s, 32})
      b = t([2, 2, -2, -2], {:s, 32})
      assert l(N.floor_divide(s(), a, b)) == [3, -4, -4, 3]
      assert l(N.remainder(s(), a, b)) == [1, 1, -1, -1]
    end

    test "type promotion" do
      assert Emily.dtype(N.add(s(), t([1], {:s, 32}), t([1.0], {:f, 16}))) == {:f, 16}
      assert Emily.dtype(N.add(s(), t([1], {:u, 8}), t([1], {:s, 8}))) == {:s, 16}
      assert Emily.dtype(N.divide(s(), t([1], {:s, 32}), t([2], {:s, 32}))) == {:f, 32}
    end

    test "arctan2 and logaddexp" do
      assert_close(l(N.arctan2(s(), t([1.0, -1.0]), t([1.0, -1.0]))), [0.785398163, -2.356194490])

      assert_close(l(N.logaddexp(s(), t([0.0, 1000.0]), t([0.0, 1000.0]))), [
        0.693147181,
        1000.693147181
      ])
    end

    test "comparisons return bool" do
      a = t([1, 2, 3], {:s, 32})
      b = t([2, 2, 2], {:s, 32})
      assert l(N.equal(s(), a, b)) == [false, true, false]
      assert l(N.not_equal(s(), a, b)) == [true, false, true]
      assert l(N.less(s(), a, b)) == [true, false, false]
      assert l(N.less_equal(s(), a, b)) == [true, true, false]
      assert l(N.greater(s(), a, b)) == [false, false, true]
      assert l(N.greater_equal(s(), a, b)) == [false, true, true]
      assert l(N.equal(s(), t([:nan]), t([:nan]))) == [false]
    end

    test "logical and bitwise" do
      p = t([true, true, false, false], :bool)
      q = t([true, false, true, false], :bool)
      assert l(N.logical_and(s(), p, q)) == [true, false, false, false]
      assert l(N.logical_or(s(), p, q)) == [true, true, true, false]
      a = t([0b1100, 0b1010], {:u, 8})
      b = t([0b1010, 0b0110], {:u, 8})
      assert l(N.bitwise_and(s(), a, b)) == [0b1000, 0b0010]
      assert l(N.bitwise_or(s(), a, b)) == [0b1110, 0b1110]
      assert l(N.bitwise_xor(s(), a, b)) == [0b0110, 0b1100]
      assert l(N.left_shift(s(), t([1, 3], {:s, 32}), t([3, 1], {:s, 32}))) == [8, 6]
      assert l(N.right_shift(s(), t([16, -16], {:s, 32}), t([2, 2], {:s, 32}))) == [4, -4]
    end

    test "where" do
      c = t([true, false, true], :bool)
      assert l(N.where(s(), c, t([1.0, 2.0, 3.0]), t([-1.0]))) == [1.0, -1.0, 3.0]
    end

    test "shape mismatch raises Emily.Error naming op, shapes and dtypes" do
      e = assert_raise Emily.Error, fn -> l(N.add(s(), t([1.0, 2.0]), t([1, 2, 3], {:s, 32}))) end
      assert e.message =~ "add:"
      assert e.message =~ "f32[2], s32[3]"
      assert e.message =~ "broadcast"
    end
  end
end
