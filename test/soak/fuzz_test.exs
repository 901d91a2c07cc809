defmodule Emily.Soak.FuzzTest do
  # Every Emily.Native function (from Emily.Native.__info__(:functions)) called with
  # random and malformed terms: wrong term types, negative and huge shapes, mismatched
  # dtypes, released streams, resources of the wrong kind; and elementwise ops built on
  # lazy results that are then released, so that MLX reuses their buffers (where a result
  # that misstates its size writes past its end). 10,000 calls (100,000 with
  # EMILY_SOAK_SCALE=10): the VM survives, every failure is an ArgumentError or an
  # Emily.Error raised in the calling process, and every reply is well-formed.
  use Emily.TestCase, async: false
  @moduletag :fuzz
  @moduletag timeout: 600_000

  test "random and malformed calls to every Emily.Native function" do
    n = Emily.Soak.n(10_000)
    seed = ExUnit.configuration()[:seed] || 0
    stats = Emily.Fuzz.run(n, seed)

    assert stats.calls == n
    assert stats.functions == length(Emily.Fuzz.functions())
    assert stats.functions >= 100
    # Every function was called.
    assert MapSet.new(Emily.Fuzz.functions(), &elem(&1, 0)) == stats.called
    # Not vacuous: calls went through, were refused, and reached MLX and failed there.
    assert stats.ok > 0
    assert stats.raised[ArgumentError] > 0
    assert stats.read_raised[Emily.Error] > 0
    assert stats.replies > 0
    # Everything still works.
    assert l(N.add(s(), t([1.0]), t([2.0]))) == [3.0]
    assert is_map(Emily.Memory.stats())
  end
end
