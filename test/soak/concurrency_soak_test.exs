defmodule Emily.Soak.ConcurrencyTest do
  # 64 processes over 8 streams, 1,000 ops each (EMILY_SOAK_SCALE multiplies the ops):
  # every reply arrives and is correct, and no scheduler runs one process for longer than
  # 10 ms (:erlang.system_monitor's long_schedule).
  #
  # long_schedule measures wall time, so on an oversubscribed host the OS taking a core
  # away from a scheduler thread shows up too: a pure-Elixir workload under CPU hogs
  # shows 13-25 ms events. Where Linux reports it, the time the scheduler threads spent
  # waiting for a CPU (run delay, /proc/self/task/*/schedstat) tells the two apart: a NIF
  # that blocks its scheduler (sleeping on a lock, or spinning) adds no run delay. So any
  # long schedule's excess over 10 ms must be covered by the schedulers' run delay over
  # the run; without schedstat, no long schedule at all is allowed.
  use Emily.TestCase, async: false
  @moduletag :soak
  @moduletag timeout: 600_000

  defp workload(streams, ops) do
    for p <- 1..64 do
      Task.async(fn ->
        st = Enum.at(streams, rem(p, 8))
        one = Emily.from_list([1.0], {:f, 32}, stream: st)
        start = Emily.from_list([p * 1.0], {:f, 32}, stream: st)

        # Every 100 ops the value is read back; between reads the chain stays lazy.
        {acc, seen} =
          Enum.reduce(1..ops, {start, []}, fn k, {acc, seen} ->
            acc = N.add(st, acc, one)

            if rem(k, 100) == 0 do
              [v] = Emily.to_list(acc)
              {Emily.from_list([v], {:f, 32}, stream: st), [{k, v} | seen]}
            else
              {acc, seen}
            end
          end)

        {p, Emily.to_list(acc), seen}
      end)
    end
  end

  defp run_once(streams, ops) do
    :erlang.system_monitor(self(), [{:long_schedule, 10}])
    tasks = workload(streams, ops)
    results = Task.await_many(tasks, 300_000)
    :erlang.system_monitor(:undefined)
    pids = MapSet.new([self() | Enum.map(tasks, & &1.pid)])

    for {p, [final], seen} <- results do
      assert final == p + ops
      assert length(seen) == div(ops, 100)
      for {k, v} <- seen, do: assert(v == p + k)
    end

    Stream.repeatedly(fn ->
      receive do
        {:monitor, pid, :long_schedule, info} -> {pid, info}
      after
        0 -> nil
      end
    end)
    |> Enum.take_while(&(&1 != nil))
    |> Enum.filter(fn {pid, _} -> MapSet.member?(pids, pid) end)
  end

  test "64 processes over 8 streams: all replies correct, no scheduler blocked > 10 ms" do
    streams = for _ <- 1..8, do: Emily.Stream.new(:cpu)
    ops = Emily.Soak.n(1_000)
    previous = :erlang.system_monitor()

    try do
      delay0 = scheduler_run_delay_ms()
      long = run_once(streams, ops)
      delay1 = scheduler_run_delay_ms()
      excess = long |> Enum.map(fn {_, info} -> info[:timeout] - 10 end) |> Enum.sum()

      case {delay0, delay1} do
        {d0, d1} when is_number(d0) and is_number(d1) ->
          assert excess <= d1 - d0,
                 "long schedules #{inspect(long)} exceed by #{excess} ms what the OS took " <>
                   "from the schedulers (#{Float.round(d1 - d0, 1)} ms of run delay)"

        _ ->
          assert long == [], "long schedules: #{inspect(long)}"
      end
    after
      case previous do
        {pid, opts} -> :erlang.system_monitor(pid, opts)
        :undefined -> :erlang.system_monitor(:undefined)
      end
    end
  end

  # Total time (ms) the normal scheduler threads have waited on a run queue, or nil.
  defp scheduler_run_delay_ms do
    with {:ok, tasks} <- File.ls("/proc/self/task") do
      delays =
        for t <- tasks,
            {:ok, "erts_sched_" <> _} <- [File.read("/proc/self/task/#{t}/comm")],
            {:ok, stat} <- [File.read("/proc/self/task/#{t}/schedstat")] do
          [_cpu, delay | _] = String.split(stat)
          String.to_integer(delay) / 1.0e6
        end

      if delays == [], do: nil, else: Enum.sum(delays)
    else
      _ -> nil
    end
  end
end
