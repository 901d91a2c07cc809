defmodule Emily.ReleaseTest do
  # Not async: it reads MLX's process-wide active memory.
  use Emily.TestCase, async: false

  alias Emily.Native, as: N

  describe "Emily.release/1" do
    test "frees the array at once; later uses raise, derived tensors live on" do
      x = t([1.0, 2.0, 3.0], {:f, 32})
      y = N.multiply(s(), x, x)
      assert Emily.release(x) == :ok
      assert Emily.release(x) == :already_released
      assert_raise Emily.Error, ~r/add: .*has been released/, fn -> l(N.add(s(), x, x)) end
      assert_raise Emily.Error, ~r/has been released/, fn -> Emily.to_binary(x) end
      assert l(y) == [1.0, 4.0, 9.0]
      # The stream is fine afterwards.
      assert l(N.add(s(), y, y)) == [2.0, 8.0, 18.0]
    end

    test "a released tensor fails as an input on another stream too" do
      other = Emily.Stream.new(:cpu)
      x = t([1.0, 2.0], {:f, 32})
      Emily.eval(x)
      Emily.release(x)
      assert_raise Emily.Error, ~r/has been released/, fn -> l(N.negative(other, x)) end
      lazy = N.add(s(), t([1.0], {:f, 32}), t([2.0], {:f, 32}))
      Emily.release(lazy)
      assert_raise Emily.Error, ~r/has been released/, fn -> l(N.negative(other, lazy)) end
      assert l(N.negative(other, t([5.0], {:f, 32}))) == [-5.0]
    end

    test "binaries already read stay valid" do
      x = N.full(s(), {4}, 2.5, {:f, 32})
      bin = Emily.to_binary(x)
      Emily.release(x)
      :erlang.garbage_collect()

      assert bin ==
               <<2.5::float-32-native, 2.5::float-32-native, 2.5::float-32-native,
                 2.5::float-32-native>>
    end

    test "MLX's active memory drops by the array's size" do
      n = 16 * 1024 * 1024
      big = N.full(s(), {n}, 1.0, {:f, 32})
      Emily.eval(big)
      before = Emily.Memory.stats().active
      assert before >= 4 * n
      Emily.release(big)
      # The release is queued on the stream's worker: any later waiting call runs after it.
      Emily.eval(N.full(s(), {}, 0.0, {:f, 32}))
      # (the scalar just made is still held)
      assert Emily.Memory.stats().active < before - 4 * n + 1024
    end
  end

  describe "Emily.Stream.set_spin/1" do
    test "sets the polling time, returns the previous one, and ops still work" do
      # At boot: config :emily, spin_us (:auto by default, which depends on the cores).
      before = Emily.Stream.spin_us()
      assert before == Emily.Stream.auto_spin_us()
      assert Emily.Stream.set_spin(75) == before
      assert Emily.Stream.spin_us() == 75

      try do
        x = t([1.0, 2.0], {:f, 32})
        for _ <- 1..20, do: assert(l(N.add(s(), x, x)) == [2.0, 4.0])

        assert Emily.to_binary(N.negative(s(), x)) ==
                 <<-1.0::float-32-native, -2.0::float-32-native>>
      after
        assert Emily.Stream.set_spin(before) == 75
      end
    end

    test ":auto polls 50 us with 8 or more cores, and not below" do
      assert Emily.Stream.auto_spin_us(2) == 0
      assert Emily.Stream.auto_spin_us(7) == 0
      assert Emily.Stream.auto_spin_us(8) == 50
      assert Emily.Stream.auto_spin_us(128) == 50
      assert Emily.Stream.auto_spin_us() in [0, 50]
    end

    test "refuses times outside 0..1_000_000 microseconds" do
      assert_raise FunctionClauseError, fn -> Emily.Stream.set_spin(-1) end
      assert_raise ArgumentError, ~r/stream_set_spin/, fn -> N.stream_set_spin(2_000_000) end
      assert_raise ArgumentError, fn -> N.stream_set_spin(:fast) end
    end
  end
end
