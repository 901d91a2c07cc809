defmodule Emily.Native.ElementwiseTest do
  use Emily.TestCase, async: true
  import Bitwise

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

    test "more f32 math against hand-computed values" do
      assert_close(l(N.log2(s(), t([8.0, 0.5]))), [3.0, -1.0])
      assert_close(l(N.log10(s(), t([1000.0, 0.01]))), [3.0, -2.0])
      assert_close(l(N.expm1(s(), t([1.0e-5, 0.0]))), [1.0000050000166668e-5, 0.0], 1.0e-6)
      assert_close(l(N.log1p(s(), t([1.0e-5]))), [9.999950000333332e-6], 1.0e-6)
      assert_close(l(N.reciprocal(s(), t([4.0, -0.5]))), [0.25, -2.0])
      assert_close(l(N.sin(s(), t([1.5707963267948966, 0.0]))), [1.0, 0.0])
      assert_close(l(N.cos(s(), t([0.0, 3.141592653589793]))), [1.0, -1.0])
      assert_close(l(N.tan(s(), t([0.7853981633974483]))), [1.0])
      assert_close(l(N.arcsin(s(), t([1.0, 0.0]))), [1.5707963267948966, 0.0])
      assert_close(l(N.arccos(s(), t([1.0, 0.0]))), [0.0, 1.5707963267948966])
      assert_close(l(N.arctan(s(), t([1.0]))), [0.7853981633974483])
      assert_close(l(N.sinh(s(), t([1.0]))), [1.1752011936438014])
      assert_close(l(N.cosh(s(), t([1.0]))), [1.5430806348152437])
      assert_close(l(N.arcsinh(s(), t([1.0]))), [0.881373587019543])
      assert_close(l(N.arccosh(s(), t([2.0]))), [1.3169578969248166])
      assert_close(l(N.arctanh(s(), t([0.5]))), [0.5493061443340548])
      assert_close(l(N.erfinv(s(), t([0.5, 0.0]))), [0.4769362762044699, 0.0])
      assert_close(l(N.degrees(s(), t([3.141592653589793, 1.0]))), [180.0, 57.29577951308232])
      assert_close(l(N.radians(s(), t([180.0]))), [3.141592653589793])
      assert l(N.arcsin(s(), t([2.0]))) == [:nan]
    end

    test "erfc is accurate in the tail and at the ends" do
      with_cpu(fn ->
        x = t([0.0, 0.5, 1.0, 3.0, 5.0, 9.0, -1.0, :infinity, :neg_infinity, :nan])

        expected = [
          1.0,
          0.4795001221869535,
          0.15729920705028513,
          2.2090496998585438e-5,
          1.5374597944280351e-12,
          4.13703174651381e-37,
          1.842700792949715,
          0.0,
          2.0,
          :nan
        ]

        # Relative tolerance: 1 - erf(x) would be 0.0 from x = 4 on in float32.
        assert_close(l(N.erfc(s(), x)), expected, 2.0e-6)

        assert_close(
          l(N.erfc(s(), t([1.0, 3.0], {:f, 64}))),
          [0.15729920705028513, 2.2090496998585438e-5],
          1.0e-6
        )

        assert Emily.dtype(N.erfc(s(), t([1.0], {:bf, 16}))) == {:bf, 16}
        assert Emily.dtype(N.erfc(s(), t([1], {:s, 32}))) == {:f, 32}
      end)
    end

    test "trunc, positive and round_half_away" do
      x = t([-2.7, -0.5, 0.5, 2.7])
      assert l(N.trunc(s(), x)) == [-2.0, -0.0, 0.0, 2.0]
      assert_close(l(N.positive(s(), x)), [-2.7, -0.5, 0.5, 2.7])

      y = t([2.5, -2.5, 0.5, -0.5, 1.5, 0.49999997, -0.3, 7.0, :nan, :infinity, :neg_infinity])

      assert l(N.round_half_away(s(), y)) ==
               [3.0, -3.0, 1.0, -1.0, 2.0, 0.0, -0.0, 7.0, :nan, :infinity, :neg_infinity]

      assert l(N.round_half_away(s(), t([2.5, -3.5], {:bf, 16}))) == [3.0, -4.0]
      assert l(N.round_half_away(s(), t([-3, 4], {:s, 16}))) == [-3, 4]
    end

    test "cbrt" do
      assert_close(l(N.cbrt(s(), t([27.0, -8.0, 0.0, 2.0, 1.0e-3]))), [
        3.0,
        -2.0,
        0.0,
        1.2599210498948732,
        0.1
      ])

      assert l(N.cbrt(s(), t([:infinity, :neg_infinity, :nan]))) == [
               :infinity,
               :neg_infinity,
               :nan
             ]

      assert_close(l(N.cbrt(s(), t([64], {:s, 32}))), [4.0])
      assert Emily.dtype(N.cbrt(s(), t([8.0], {:f, 16}))) == {:f, 16}
    end

    test "population_count and count_leading_zeros over two's complement bits" do
      assert l(N.population_count(s(), t([0, 1, 255, 170], {:u, 8}))) == [0, 1, 8, 4]
      assert l(N.population_count(s(), t([-1, -128, 127], {:s, 8}))) == [8, 1, 7]
      assert l(N.population_count(s(), t([-1, 0x5555], {:s, 16}))) == [16, 8]
      assert l(N.population_count(s(), t([-1, 7, 0x7FFFFFFF], {:s, 32}))) == [32, 3, 31]
      assert l(N.population_count(s(), t([-1, 3], {:s, 64}))) == [64, 2]

      assert l(N.population_count(s(), t([0xFFFFFFFFFFFFFFFF, 1 <<< 63], {:u, 64}))) ==
               [64, 1]

      assert l(N.count_leading_zeros(s(), t([0, 1, 128, 15], {:u, 8}))) == [8, 7, 0, 4]
      assert l(N.count_leading_zeros(s(), t([-1, 1, 0], {:s, 8}))) == [0, 7, 8]
      assert l(N.count_leading_zeros(s(), t([1, 0x100], {:u, 16}))) == [15, 7]
      assert l(N.count_leading_zeros(s(), t([0, 1, 255, -1, 7], {:s, 32}))) == [32, 31, 24, 0, 29]
      assert l(N.count_leading_zeros(s(), t([0, 1, -1, 1 <<< 40], {:s, 64}))) == [64, 63, 0, 23]
      assert Emily.dtype(N.population_count(s(), t([1], {:s, 16}))) == {:s, 16}
    end

    test "isposinf, isneginf and nan_to_num" do
      x = t([1.0, :nan, :infinity, :neg_infinity])
      assert l(N.isposinf(s(), x)) == [false, false, true, false]
      assert l(N.isneginf(s(), x)) == [false, false, false, true]
      assert l(N.nan_to_num(s(), x, 0.0, 9.0, -9.0)) == [1.0, 0.0, 9.0, -9.0]
      assert l(N.isnan(s(), t([1, 2], {:s, 32}))) == [false, false]
    end

    test "sign of NaN is 0 and abs of complex is real" do
      assert l(N.sign(s(), t([:nan, -0.0, -2.0, :infinity]))) == [0.0, 0.0, -1.0, 1.0]
      assert l(N.abs(s(), t([{3.0, 4.0}], {:c, 64}))) == [5.0]
      assert Emily.dtype(N.abs(s(), t([{3.0, 4.0}], {:c, 64}))) == {:f, 32}
      assert l(N.stop_gradient(s(), t([1.5]))) == [1.5]
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

    test "fmod: sign of the dividend (Nx remainder), integers" do
      with_cpu(fn ->
        a = t([7, -7, 7, -7, 6, -6, 5, -2_147_483_648, -2_147_483_648], {:s, 32})
        b = t([2, 2, -2, -2, 3, 3, 0, -1, 3], {:s, 32})
        assert l(N.fmod(s(), a, b)) == [1, -1, 1, -1, 0, 0, 5, 0, -2]
        assert l(N.fmod(s(), t([250, 7], {:u, 8}), t([7, 250], {:u, 8}))) == [5, 7]
        # s8 and u8 promote to s16, as in Nx.remainder's own example.
        assert l(N.fmod(s(), t([-11], {:s, 8}), t([10], {:u, 8}))) == [-1]
        assert Emily.dtype(N.fmod(s(), t([-11], {:s, 8}), t([10], {:u, 8}))) == {:s, 16}
      end)
    end

    test "fmod: floats follow C fmod, zero keeps the dividend's sign" do
      a = t([7.5, -7.5, 7.5, -6.0, 6.0, -0.0, 1.0, :infinity, 5.0, :nan])
      b = t([2.0, 2.0, -2.0, 3.0, -3.0, 3.0, 0.0, 1.0, :infinity, 1.0])
      assert l(N.fmod(s(), a, b)) == [1.5, -1.5, 1.5, -0.0, 0.0, -0.0, :nan, :nan, 5.0, :nan]
      # Exact where the floored remainder rounds: fmod(-1e-10, 1) = -1e-10, mod = 1.0.
      assert_close(l(N.fmod(s(), t([-1.0e-10]), t([1.0]))), [-1.0e-10], 1.0e-6)
      assert l(N.remainder(s(), t([-1.0e-10]), t([1.0]))) == [1.0]
      assert l(N.fmod(s(), t([5.5], {:f, 16}), t([-2.0], {:f, 16}))) == [1.5]
    end

    test "trunc_divide: rounds toward zero (Nx quotient)" do
      with_cpu(fn ->
        a = t([7, -7, 7, -7, 6, -6, 5, -2_147_483_648, 0], {:s, 32})
        b = t([2, 2, -2, -2, 3, -3, 0, -1, -5], {:s, 32})
        assert l(N.trunc_divide(s(), a, b)) == [3, -3, -3, 3, 2, 2, 0, -2_147_483_648, 0]
        assert l(N.trunc_divide(s(), t([255, 7], {:u, 8}), t([2, 0], {:u, 8}))) == [127, 0]
        assert l(N.trunc_divide(s(), t([-7.5, 7.5]), t([2.0, 2.0]))) == [-3.0, 3.0]

        big = -9_223_372_036_854_775_808

        assert l(N.trunc_divide(s(), t([big, big], {:s, 64}), t([-1, 2], {:s, 64}))) == [
                 big,
                 div(big, 2)
               ]
      end)
    end

    test "floor_divide/remainder: signed MIN / -1 and division by zero do not trap" do
      with_cpu(fn ->
        for {type, min} <- [{{:s, 32}, -2_147_483_648}, {{:s, 64}, -9_223_372_036_854_775_808}] do
          a = t([min, min, 7, -7], type)
          b = t([-1, 1, 0, 0], type)
          assert l(N.floor_divide(s(), a, b)) == [min, min, 0, 0]
          assert l(N.remainder(s(), a, b)) == [0, 0, 7, -7]
        end

        assert l(N.floor_divide(s(), t([-7.0, 7.0]), t([2.0, 0.0]))) == [-4.0, :infinity]
        assert l(N.remainder(s(), t([-7.5, 7.5]), t([2.0, -2.0]))) == [0.5, -0.5]
      end)
    end

    test "shifts by counts outside [0, bit width)" do
      a = t([1, 1, 1, -1, 3], {:s, 32})
      b = t([31, 32, -1, 40, 1], {:s, 32})
      assert l(N.left_shift(s(), a, b)) == [-2_147_483_648, 0, 0, 0, 6]
      c = t([-16, 16, -1, 255, 1], {:s, 32})
      d = t([2, 40, 33, 100, -3], {:s, 32})
      assert l(N.right_shift(s(), c, d)) == [-4, 0, -1, 0, 0]
      assert l(N.left_shift(s(), t([1, 1], {:u, 8}), t([7, 8], {:u, 8}))) == [128, 0]
      assert l(N.right_shift(s(), t([128, 128], {:u, 8}), t([7, 8], {:u, 8}))) == [1, 0]
      assert l(N.right_shift(s(), t([-128], {:s, 8}), t([9], {:s, 8}))) == [-1]

      assert l(N.left_shift(s(), t([1], {:s, 64}), t([63], {:s, 64}))) == [
               -9_223_372_036_854_775_808
             ]
    end

    test "NaN in maximum/minimum, integer power" do
      a = t([1.0, :nan, 2.0])
      b = t([:nan, 1.0, 3.0])
      assert l(N.maximum(s(), a, b)) == [:nan, :nan, 3.0]
      assert l(N.minimum(s(), a, b)) == [:nan, :nan, 2.0]

      assert l(N.power(s(), t([2, 3, -2, 2], {:s, 32}), t([10, 0, 3, -1], {:s, 32}))) == [
               1024,
               1,
               -8,
               0
             ]

      assert l(N.power(s(), t([4.0, -8.0]), t([0.5, 0.5]))) == [2.0, :nan]
    end

    test "logical_xor, isclose, allclose, clip" do
      assert l(N.logical_xor(s(), t([1, 1, 0, 0], {:s, 32}), t([2.0, 0.0, 1.0, 0.0]))) ==
               [false, true, true, false]

      a = t([1.0, 1.0, :nan, :infinity])
      b = t([1.000001, 1.1, :nan, :infinity])
      assert l(N.isclose(s(), a, b, 1.0e-5, 1.0e-8, false)) == [true, false, false, true]
      assert l(N.isclose(s(), a, b, 1.0e-5, 1.0e-8, true)) == [true, false, true, true]
      assert l(N.allclose(s(), a, b, 0.2, 0.0, true)) == [true]
      assert Emily.shape(N.allclose(s(), a, b, 0.2, 0.0, true)) == {}
      assert l(N.allclose(s(), a, b, 1.0e-5, 1.0e-8, true)) == [false]

      x = t([-5, 0, 5, 10], {:s, 32})
      assert l(N.clip(s(), x, t([0], {:s, 32}), t([6], {:s, 32}))) == [0, 0, 5, 6]
      assert l(N.clip(s(), x, nil, t([1], {:s, 32}))) == [-5, 0, 1, 1]
      assert l(N.clip(s(), x, t([1, 1, 7, 7], {:s, 32}), nil)) == [1, 1, 7, 10]
    end

    test "shape mismatch raises Emily.Error naming op, shapes and dtypes" do
      e = assert_raise Emily.Error, fn -> l(N.add(s(), t([1.0, 2.0]), t([1, 2, 3], {:s, 32}))) end
      assert e.message =~ "add:"
      assert e.message =~ "f32[2], s32[3]"
      assert e.message =~ "broadcast"
    end
  end

  describe "error paths" do
    test "every unary and binary op raises ArgumentError on a non-tensor argument" do
      for row <- family_rows(["unary", "binary"]) do
        assert_raise ArgumentError, fn -> apply(N, row.name, [s() | bad_args(row)]) end
      end

      assert l(N.add(s(), t([1.0]), t([2.0]))) == [3.0]
    end

    test "every binary op raises Emily.Error on shapes that do not broadcast" do
      for row <- family_rows(["binary"]) do
        args =
          Enum.map(row.args, fn
            {:cond, "tensor"} -> t([true, false], :bool)
            {:a, "tensor"} -> t([1, 2], {:s, 32})
            {_, "tensor"} -> t([1, 2, 3], {:s, 32})
            {_, "tensor?"} -> t([1, 2, 3], {:s, 32})
            {_, "float"} -> 1.0e-5
            {_, "bool"} -> false
          end)

        e = assert_raise Emily.Error, fn -> l(apply(N, row.name, [s() | args])) end
        assert e.message =~ "#{row.name}:", "#{row.name}: #{e.message}"
        assert e.message =~ "s32[2]", "#{row.name}: #{e.message}"
      end

      assert l(N.add(s(), t([1.0]), t([2.0]))) == [3.0]
    end

    test "unary ops raise Emily.Error on a dtype they do not take" do
      z = t([{1.0, 1.0}], {:c, 64})
      f = t([1.5])

      cases = [
        negative: t([true], :bool),
        floor: z,
        ceil: z,
        trunc: z,
        # (expm1, sigmoid and cbrt are composed for complex: bad_input_test.exs.)
        erf: z,
        erfinv: z,
        erfc: z,
        bitwise_invert: f,
        population_count: f,
        count_leading_zeros: t([true], :bool)
      ]

      for {op, x} <- cases do
        e = assert_raise Emily.Error, fn -> l(apply(N, op, [s(), x])) end
        assert e.message =~ "#{op}:", "#{op}: #{e.message}"
      end

      assert_raise ArgumentError, fn -> N.astype(s(), f, {:f, 8}) end
      assert_raise ArgumentError, fn -> N.round(s(), f, 1.5) end
      assert_raise ArgumentError, fn -> N.nan_to_num(s(), f, :zero, 1.0, 1.0) end
      assert l(N.exp(s(), t([0.0]))) == [1.0]
    end

    test "binary ops raise Emily.Error on a dtype they do not take" do
      f = t([1.5])
      z = t([{1.0, 1.0}], {:c, 64})

      for op <- [:bitwise_and, :bitwise_or, :bitwise_xor, :left_shift, :right_shift] do
        e = assert_raise Emily.Error, fn -> l(apply(N, op, [s(), f, f])) end
        assert e.message =~ "#{op}:"
      end

      # (arctan2 is composed for complex: bad_input_test.exs.)
      for op <- [:fmod, :remainder, :trunc_divide] do
        e = assert_raise Emily.Error, fn -> l(apply(N, op, [s(), z, z])) end
        assert e.message =~ "#{op}:"
      end

      assert l(N.add(s(), t([1.0]), t([2.0]))) == [3.0]
    end
  end
end
