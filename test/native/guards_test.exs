defmodule Emily.GuardsTest do
  # Inputs on which MLX's CPU kernels trap (SIGFPE, which would take the VM down) and the
  # guards that steer them away. Oracles: two's complement arithmetic by hand.
  use Emily.TestCase, async: true

  for {type, min} <- [{{:s, 32}, -2_147_483_648}, {{:s, 64}, -9_223_372_036_854_775_808}] do
    test "floor_divide and remainder of MIN by -1 wrap instead of trapping (#{inspect(type)})" do
      a = t([unquote(min), -7, 7, unquote(min), 9], unquote(Macro.escape(type)))
      b = t([-1, 2, -1, 3, -1], unquote(Macro.escape(type)))
      # MIN // -1 overflows: it wraps to MIN. floor(-7 / 2) = -4; floor(MIN / 3) rounds down.
      assert l(N.floor_divide(s(), a, b)) ==
               [unquote(min), -4, -7, Integer.floor_div(unquote(min), 3), -9]

      # MLX's remainder takes the divisor's sign: -7 mod 2 = 1; MIN mod 3 = 1 for both widths
      # (2^31 = 3 * 715827882 + 2 and 2^63 = 3 * 3074457345618258602 + 2).
      assert l(N.remainder(s(), a, b)) == [0, 1, 0, 1, 0]
    end
  end

  test "unsigned and float division are unchanged by the guard" do
    assert l(N.floor_divide(s(), t([7, 255], {:u, 8}), t([2, 255], {:u, 8}))) == [3, 1]
    assert l(N.floor_divide(s(), t([-7.0, 7.5]), t([2.0, -1.0]))) == [-4.0, -8.0]
    assert l(N.remainder(s(), t([-7.0]), t([-1.0]))) == [-0.0]
  end

  test "a zero slice stride is an Emily.Error, not a division by zero" do
    x = t([1.0, 2.0, 3.0])

    assert_raise Emily.Error, ~r/strides must be non-zero/, fn ->
      l(N.slice(s(), x, [0], [3], [0]))
    end

    assert l(N.slice(s(), x, [2], [-4], [-1])) == [3.0, 2.0, 1.0]

    # slice_update sizes its slice the same way (found by the fuzzer on a GPU build).
    assert_raise Emily.Error, ~r/strides must be non-zero/, fn ->
      l(
        N.slice_update(s(), t([1.0, 2.0, 3.0, 4.0], {:f, 32}, {2, 2}), t([9.0]), [0, 0], [1, 1], [
          1,
          0
        ])
      )
    end

    assert l(N.slice_update(s(), x, t([9.0, 8.0]), [0], [3], [2])) == [9.0, 2.0, 8.0]
    assert l(N.add(s(), x, x)) == [2.0, 4.0, 6.0]
  end

  test "ints arguments outside 32 bits are refused, not wrapped" do
    x = t([1.0, 2.0])

    assert_raise ArgumentError, ~r/does not fit in 32 bits/, fn ->
      N.sum(s(), x, [2 ** 32], false)
    end

    assert_raise ArgumentError, ~r/does not fit in 32 bits/, fn ->
      N.slice(s(), x, [0], [2 ** 40], [1])
    end

    assert l(N.sum(s(), x, [0], false)) == [3.0]
  end
end
