defmodule Emily.Soak.ChurnTest do
  # 1,000 streams created and dropped (EMILY_SOAK_SCALE multiplies), 8 at a time: the OS
  # thread count returns to its baseline. MLX never reclaims a stream, nor on the CPU the
  # thread that runs its kernels; Emily reuses its worker threads (and their MLX streams),
  # so after a warm-up no thread is started at all.
  use Emily.TestCase, async: false
  @moduletag :soak
  @moduletag timeout: 600_000

  defp batch do
    for i <- 1..8 do
      Task.async(fn ->
        st = Emily.Stream.new(:cpu)
        x = Emily.from_list([i * 1.0], {:f, 32}, stream: st)
        [y] = Emily.to_list(N.add(st, x, x))
        if rem(i, 2) == 0, do: Emily.Stream.release(st)
        y
      end)
    end
    |> Task.await_many(30_000)
  end

  defp busy do
    %{started: started, idle: idle} = Emily.Stream.thread_stats(:cpu)
    started - idle
  end

  # Until no more threads are busy than before the test (the batch's streams are
  # garbage). Before: the default CPU stream's, and those of streams that other suites
  # left alive (the compiler's cache, say, keeps the tensors jitted functions capture).
  defp await_idle(before, tries \\ 500) do
    cond do
      busy() <= before -> :ok
      tries == 0 -> flunk("threads still busy: #{busy()}, #{before} before the test")
      true -> Process.sleep(1) && await_idle(before, tries - 1)
    end
  end

  defp os_threads, do: length(File.ls!("/proc/self/task"))

  test "stream churn: no thread is started after warm-up; the OS thread count is back to baseline" do
    before = busy()
    # Warm-up: 8 streams alive at once, so that the pool has a thread for each of a
    # batch's streams (a batch whose first tasks end early needs fewer).
    for(_ <- 1..8, do: Emily.Stream.new(:cpu)) |> Enum.each(&Emily.Stream.release/1)
    batch()
    await_idle(before)
    baseline = os_threads()
    %{started: started} = Emily.Stream.thread_stats(:cpu)

    for _ <- 1..div(Emily.Soak.n(1_000), 8) do
      assert batch() == Enum.map(1..8, &(&1 * 2.0))
      await_idle(before)
    end

    assert Emily.Stream.thread_stats(:cpu).started == started
    # BEAM threads come and go only with the VM's own work (none here).
    assert os_threads() <= baseline
  end
end
