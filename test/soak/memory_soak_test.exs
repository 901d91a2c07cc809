defmodule Emily.Soak.MemoryTest do
  # 10,000 iterations (EMILY_SOAK_SCALE multiplies) of an op chain plus to_binary: MLX's
  # active memory and the BEAM's memory stay flat. Bounds: MLX active memory over the
  # run's samples varies by at most 1 MiB (it should not vary at all: every array of an
  # iteration is garbage after it); BEAM total memory ends within 16 MiB of its start.
  use Emily.TestCase, async: false
  @moduletag :soak
  @moduletag timeout: 600_000

  @mlx_bound 1024 * 1024
  @beam_bound 16 * 1024 * 1024

  defp iteration(st, i) do
    x = Emily.from_list(Enum.map(1..256, &(&1 * 1.0e-3 + i * 1.0e-6)), {:f, 32}, stream: st)
    y = N.add(st, N.multiply(st, N.exp(st, x), N.full(st, {}, 2.0, {:f, 32})), x)
    z = N.sum(st, N.reshape(st, y, {16, 16}), [1], false)
    bin = Emily.to_binary(z)
    64 = byte_size(bin)
    bin
  end

  # GC here, then a round trip through the stream: its queue (where dropped tensors
  # free their arrays) is drained.
  defp settle(st) do
    :erlang.garbage_collect()

    [2.0] =
      Emily.to_list(
        N.add(
          st,
          Emily.from_list([1.0], {:f, 32}, stream: st),
          Emily.from_list([1.0], {:f, 32}, stream: st)
        )
      )

    :erlang.garbage_collect()
    {Emily.Memory.stats().active, :erlang.memory(:total)}
  end

  test "an op chain plus to_binary, many times: MLX and BEAM memory stay flat" do
    st = Emily.Stream.new(:cpu)
    n = Emily.Soak.n(10_000)
    for i <- 1..500, do: iteration(st, i)
    {mlx0, beam0} = settle(st)

    samples =
      for chunk <- 1..10 do
        for i <- 1..div(n, 10), do: iteration(st, chunk * n + i)
        settle(st)
      end

    mlx = Enum.map(samples, &elem(&1, 0))
    {_, beam_end} = List.last(samples)

    assert Enum.max([mlx0 | mlx]) - Enum.min([mlx0 | mlx]) <= @mlx_bound,
           "MLX active memory over #{n} iterations: #{inspect([mlx0 | mlx])}"

    assert beam_end - beam0 <= @beam_bound,
           "BEAM memory grew from #{beam0} to #{beam_end} over #{n} iterations"
  end

  test "refused allocations (above the memory limit) leak nothing" do
    st = Emily.Stream.new(:cpu)
    limit = Emily.Memory.set_memory_limit(32 * 1024 * 1024)

    try do
      refuse = fn ->
        big = N.full(st, {16 * 1024 * 1024}, 1.0, {:f, 32})

        {:error, %Emily.Error{}} =
          try do
            Emily.eval(big)
          rescue
            e in Emily.Error -> {:error, e}
          end
      end

      for _ <- 1..50, do: refuse.()
      {mlx0, _} = settle(st)
      for _ <- 1..Emily.Soak.n(1_000), do: refuse.()
      {mlx1, _} = settle(st)
      assert abs(mlx1 - mlx0) <= @mlx_bound
    after
      Emily.Memory.set_memory_limit(limit)
    end
  end
end
