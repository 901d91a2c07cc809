# Collectives between OS processes on one machine, over MLX's ring backend (TCP on
# loopback).
#
#     mix run --no-deps-check bench/distributed.exs
#
# 1. all_sum bandwidth between two ranks, f32 buffers of 1 KiB .. 64 MiB: Emily
#    (Emily.Native.all_sum in two peer VMs joined with Emily.Distributed.init/1) beside
#    the same collective through Python's mlx.core.distributed (bench/distributed.py,
#    two Python processes) on the same libmlx. Both groups stay joined for the whole
#    run; each round measures every size on both sides, the order swapped from round to
#    round, and the figures are the medians over the rounds. Bandwidth is the buffer's
#    size over the time of one all_sum (what every rank gets, per second).
# 2. A data-parallel training step's throughput: an MLP (256-512-16, tanh, squared
#    error, backpropagation written out in Emily.Native ops) on a global batch of 512
#    rows, one rank on all of them (a group of one) against two ranks on 256 rows each,
#    the four gradients all-summed; one step per evaluation, as a training loop runs.
#
# A rank is a peer VM (OTP's :peer over its stdio: no distributed Erlang) with this
# VM's code path; this VM only drives them. Prints the load average before and after:
# on a machine of two cores, two ranks share them with everything else running.
#
# Options (env): BENCH_ROUNDS (default 5), BENCH_STEPS (default 30).
Code.require_file("support/bench.exs", __DIR__)

{:module, rank_mod, rank_bin, _} =
  defmodule Bench.DistributedRank do
    @moduledoc false
    # What a rank runs, loaded into each peer VM (a closure of a script does not travel:
    # its code lives only in this VM). The group joined is kept in the peer's
    # persistent_term.
    alias Emily.Native, as: N

    @key {__MODULE__, :group}

    def join(rank, hosts) do
      group = Emily.Distributed.init(rank: rank, hosts: hosts)
      :persistent_term.put(@key, group)
      group.rank
    end

    @doc "Mean time of one all_sum of a `bytes`-long f32 buffer over `iters`, in us."
    def all_sum(bytes, iters) do
      group = :persistent_term.get(@key)
      s = Emily.Distributed.stream(group)
      x = N.full(s, {div(bytes, 4)}, 1.0, {:f, 32})
      :ok = Emily.eval(x)
      # One untimed collective: a warm-up, and a barrier that lines the ranks up.
      :ok = Emily.eval(N.all_sum(s, x, group.id))

      {us, _} =
        :timer.tc(fn ->
          for _ <- 1..iters//1, do: :ok = Emily.eval(N.all_sum(s, x, group.id))
        end)

      us / iters
    end

    @doc """
    Mean time of a data-parallel MLP step, in us, over `steps` steps: this rank's shard
    of `rows` rows of a global batch of `batch`, the gradients all-summed over the joined
    group (`:group`) or the group of one (`0`).
    """
    def dp(rows, group, {batch, d_in, d_hidden, d_out}, steps) do
      s = Emily.Stream.current()

      {gid, cs} =
        if group == :group,
          do:
            {:persistent_term.get(@key).id,
             Emily.Distributed.stream(:persistent_term.get(@key), s)},
          else: {0, s}

      :rand.seed(:exsss, {1, 2, 3})

      make = fn {r, c}, scale ->
        Emily.from_list(for(_ <- 1..(r * c), do: (:rand.uniform() - 0.5) * scale), {:f, 32},
          shape: {r, c}
        )
      end

      x = make.({rows, d_in}, 2.0)
      y = make.({rows, d_out}, 2.0)

      params = [
        make.({d_in, d_hidden}, 0.1),
        make.({1, d_hidden}, 0.1),
        make.({d_hidden, d_out}, 0.1),
        make.({1, d_out}, 0.1)
      ]

      lr = N.full(s, {}, 0.01 / batch, {:f, 32})
      one = N.full(s, {}, 1.0, {:f, 32})
      t = fn a -> N.transpose(s, a, [1, 0]) end

      step = fn [w1, b1, w2, b2] = ps ->
        h = N.tanh(s, N.add(s, N.matmul(s, x, w1), b1))
        out = N.add(s, N.matmul(s, h, w2), b2)
        # loss = sum((out - y)^2) / 2: d loss / d out = out - y.
        d_out = N.subtract(s, out, y)
        g2 = N.matmul(s, t.(h), d_out)
        c2 = N.sum(s, d_out, [0], true)
        d_h = N.multiply(s, N.matmul(s, d_out, t.(w2)), N.subtract(s, one, N.multiply(s, h, h)))
        g1 = N.matmul(s, t.(x), d_h)
        c1 = N.sum(s, d_h, [0], true)
        grads = for g <- [g1, c1, g2, c2], do: N.all_sum(cs, g, gid)
        new = for {p, g} <- Enum.zip(ps, grads), do: N.subtract(s, p, N.multiply(s, g, lr))
        # One step per evaluation, as a training loop runs.
        :ok = Emily.eval(new)
        new
      end

      params = Enum.reduce(1..3, params, fn _, p -> step.(p) end)
      {us, _} = :timer.tc(fn -> Enum.reduce(1..steps//1, params, fn _, p -> step.(p) end) end)
      us / steps
    end
  end

rounds = String.to_integer(System.get_env("BENCH_ROUNDS", "5"))
steps = String.to_integer(System.get_env("BENCH_STEPS", "30"))
load = fn -> File.read!("/proc/loadavg") |> String.split() |> Enum.take(3) |> Enum.join(" ") end
IO.puts("load average (1, 5, 15 min) before: #{load.()}")

start_rank = fn ->
  paths =
    for path <- :code.get_path(),
        Path.basename(to_string(path)) == "ebin",
        arg <- [~c"-pa", path],
        do: arg

  {:ok, pid, _} = :peer.start(%{args: paths, connection: :standard_io, wait_boot: 60_000})
  {:ok, _} = :peer.call(pid, Application, :ensure_all_started, [:emily], 60_000)
  {:module, _} = :peer.call(pid, :code, :load_binary, [rank_mod, ~c"bench", rank_bin])
  pid
end

on = fn pid, f, args, timeout -> :peer.call(pid, rank_mod, f, args, timeout) end

free_port = fn ->
  {:ok, sock} = :gen_tcp.listen(0, ip: {127, 0, 0, 1})
  {:ok, port} = :inet.port(sock)
  :gen_tcp.close(sock)
  port
end

hosts = fn n -> for _ <- 1..n, do: "127.0.0.1:#{free_port.()}" end

# --- the ranks -------------------------------------------------------------------------

ranks = [start_rank.(), start_rank.()]
emily_hosts = hosts.(2)

ranks
|> Enum.with_index()
|> Enum.map(fn {pid, rank} ->
  Task.async(fn -> on.(pid, :join, [rank, emily_hosts], 90_000) end)
end)
|> Task.await_many(90_000)

py_hosts = hosts.(2)

hostfile =
  Path.join(System.tmp_dir!(), "emily-bench-hosts-#{System.unique_integer([:positive])}.json")

File.write!(hostfile, "[" <> Enum.map_join(py_hosts, ",", &~s(["#{&1}"])) <> "]")
python = System.find_executable("python3")
pythonpath = System.get_env("EMILY_PYTHONPATH") || Path.expand("~/.cache/emily/current")

py_ranks =
  for rank <- 0..1 do
    Port.open({:spawn_executable, python}, [
      :binary,
      {:line, 1024},
      args: [Path.join(__DIR__, "distributed.py")],
      env: [
        {~c"PYTHONPATH", to_charlist(pythonpath)},
        {~c"MLX_RANK", to_charlist(Integer.to_string(rank))},
        {~c"MLX_HOSTFILE", to_charlist(hostfile)}
      ]
    ])
  end

py_line = fn port ->
  receive do
    {^port, {:data, {:eol, line}}} -> line
  after
    120_000 -> raise "no answer from a Python rank"
  end
end

for port <- py_ranks, do: "ready " <> _ = py_line.(port)
File.rm(hostfile)

# --- 1. all_sum bandwidth --------------------------------------------------------------

emily_all_sum = fn bytes, iters ->
  ranks
  |> Enum.map(fn pid -> Task.async(fn -> on.(pid, :all_sum, [bytes, iters], 120_000) end) end)
  |> Task.await_many(120_000)
  |> hd()
end

python_all_sum = fn bytes, iters ->
  for port <- py_ranks, do: Port.command(port, "bw #{bytes} #{iters}\n")
  [t | _] = for port <- py_ranks, do: py_line.(port)
  "us " <> us = t
  String.to_float(us)
end

sizes = for e <- 0..8, do: 1024 * Integer.pow(4, e)
iters_for = fn bytes -> bytes |> then(&div(128 * 1024 * 1024, &1)) |> min(1000) |> max(3) end

times =
  for round <- 1..rounds, bytes <- sizes, reduce: %{} do
    acc ->
      iters = iters_for.(bytes)

      {e, p} =
        if rem(round, 2) == 1 do
          e = emily_all_sum.(bytes, iters)
          {e, python_all_sum.(bytes, iters)}
        else
          p = python_all_sum.(bytes, iters)
          {emily_all_sum.(bytes, iters), p}
        end

      acc
      |> Map.update({:emily, bytes}, [e], &[e | &1])
      |> Map.update({:python, bytes}, [p], &[p | &1])
  end

for port <- py_ranks, do: Port.command(port, "quit\n")

size_name = fn
  b when b >= 1024 * 1024 -> "#{div(b, 1024 * 1024)} MiB"
  b -> "#{div(b, 1024)} KiB"
end

# bytes / us = MB/s; / 1000: GB/s.
gbps = fn bytes, us -> bytes / us / 1000 end

IO.puts("\n## all_sum over the ring backend, 2 ranks on loopback (f32; median of #{rounds})\n")
IO.puts("| buffer | Emily us | Emily GB/s | Python MLX us | Python MLX GB/s | ratio (time) |")
IO.puts("|---|---|---|---|---|---|")

for bytes <- sizes do
  e = Bench.median(times[{:emily, bytes}])
  p = Bench.median(times[{:python, bytes}])

  IO.puts(
    "| #{size_name.(bytes)} | #{Float.round(e, 1)} | #{Float.round(gbps.(bytes, e), 3)} | " <>
      "#{Float.round(p, 1)} | #{Float.round(gbps.(bytes, p), 3)} | #{Float.round(e / p, 2)} |"
  )
end

# --- 2. data-parallel step -------------------------------------------------------------

{batch, d_in, d_hidden, d_out} = {512, 256, 512, 16}

dims = {batch, d_in, d_hidden, d_out}
dp = fn pid, rows, group -> on.(pid, :dp, [rows, group, dims, steps], 300_000) end

dp_times =
  for round <- 1..rounds, reduce: %{1 => [], 2 => []} do
    acc ->
      one = fn -> dp.(hd(ranks), batch, 0) end

      two = fn ->
        ranks
        |> Enum.map(fn pid -> Task.async(fn -> dp.(pid, div(batch, 2), :group) end) end)
        |> Task.await_many(300_000)
        |> Enum.max()
      end

      {a, b} =
        if rem(round, 2) == 1 do
          a = one.()
          {a, two.()}
        else
          b = two.()
          {one.(), b}
        end

      %{1 => [a | acc[1]], 2 => [b | acc[2]]}
  end

IO.puts(
  "\n## data-parallel MLP step (#{d_in}-#{d_hidden}-#{d_out}, global batch #{batch}; median of #{rounds})\n"
)

IO.puts("| ranks | ms / step | samples / s |")
IO.puts("|---|---|---|")

for n <- [1, 2] do
  us = Bench.median(dp_times[n])
  IO.puts("| #{n} | #{Float.round(us / 1000, 2)} | #{round(batch / us * 1_000_000)} |")
end

IO.puts("\nload average (1, 5, 15 min) after: #{load.()}")
for pid <- ranks, do: :peer.stop(pid)
