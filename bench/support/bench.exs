# Shared by the benchmarks: timing, and running the Python reference of a figure.
defmodule Bench do
  @moduledoc false

  @doc """
  Best mean time per call of `fun`, in microseconds, over `rounds` rounds of `reps`
  calls (after a warm-up), in a process of its own (`isolated/1`).
  """
  def best(fun, reps, rounds \\ 5) do
    isolated(fn ->
      fun.()

      for _ <- 1..rounds do
        {us, _} = :timer.tc(fn -> Enum.each(1..reps, fn _ -> fun.() end) end)
        us / reps
      end
      |> Enum.min()
    end)
  end

  @doc """
  Runs `fun` in a fresh process and returns its result. A call allocates on its
  process's heap, and a process holding much (the bench's own, with every graph's dump
  and results) has a young heap of tens of MB: each call's garbage then lands on cold
  memory, which made the same `Nx.Defn.jit` call on bench/defn.exs's MLP 20% slower
  (bench/README.md). Timed calls run in a process that holds only what they use; `fun`
  should capture no more than that.
  """
  def isolated(fun), do: fun |> Task.async() |> Task.await(:infinity)

  @doc """
  Runs a Python reference script with the `mlx` package that sits on Emily's own libmlx
  (`EMILY_PYTHONPATH`, default `$EMILY_CACHE/current`) and returns its `name value` lines
  as a map.
  """
  def python(script, args \\ [], env \\ []) do
    {out, 0} = System.cmd("python3", [script | args], env: python_env(env))

    for line <- String.split(out, "\n", trim: true),
        [k, v] <- [String.split(line)],
        {x, ""} <- [Float.parse(v)],
        into: %{},
        do: {k, x}
  end

  # The reference runs on its own libraries: a library preloaded into Emily's VM (a BLAS
  # under test, say) is not preloaded into Python unless `env` names one (nil unsets).
  defp python_env(env) do
    path =
      System.get_env("EMILY_PYTHONPATH") ||
        Path.join(System.get_env("EMILY_CACHE", Path.expand("~/.cache/emily")), "current")

    Map.merge(%{"LD_PRELOAD" => nil}, Map.new([{"PYTHONPATH", path} | env])) |> Enum.to_list()
  end

  @doc """
  Emily's time against Python's, window by window: `pairs` pairs of one window of `reps`
  calls of `fun` and one of `reps` runs of `name` in a Python server (`python_server/3`),
  the order swapped from pair to pair. The host's load moves both sides' times by tens
  of percent over seconds; two windows of one pair, a fraction of a second apart, see
  the same load, so the ratio within each pair is what is compared.

  Each Emily window runs in a process of its own (`isolated/1`), and first runs its calls
  untimed for `warm` ms: a process's OpenBLAS threads
  spin for about 0.1 s after its last call before they sleep, and on a small machine the
  spinning of the side that just finished would slow the other side's window. (Leaving
  the machine idle between windows instead puts the next window in a slower state of
  the host's, for both sides.)

  Returns the medians of each side's time per call and of the pairs' ratios (Emily /
  Python), the ratios' quartiles and the share of pairs where Emily was the faster. A
  median of an even count is the upper of its two middle values.
  """
  def paired(fun, server, name, reps, pairs, warm \\ 150) do
    window = fn ->
      isolated(fn ->
        until = System.monotonic_time(:millisecond) + warm
        warm_up(fun, until)
        elem(:timer.tc(fn -> Enum.each(1..reps, fn _ -> fun.() end) end), 0) / reps
      end)
    end

    times =
      for i <- 1..pairs//1 do
        if rem(i, 2) == 0 do
          e = window.()
          {e, python_window(server, name, reps, warm)}
        else
          p = python_window(server, name, reps, warm)
          {window.(), p}
        end
      end

    ratios = for {e, p} <- times, do: e / p

    %{
      emily: median(Enum.map(times, &elem(&1, 0))),
      python: median(Enum.map(times, &elem(&1, 1))),
      ratio: median(ratios),
      q1: quantile(ratios, 0.25),
      q3: quantile(ratios, 0.75),
      faster: Enum.count(ratios, &(&1 < 1.0)) / pairs
    }
  end

  defp warm_up(fun, until) do
    fun.()
    if System.monotonic_time(:millisecond) < until, do: warm_up(fun, until)
  end

  @doc """
  The `f` quantile of the numbers `xs` (0.5: the median; of an even count, the upper of
  the two middle values).
  """
  def quantile(xs, f) do
    sorted = Enum.sort(xs)
    Enum.at(sorted, min(length(sorted) - 1, trunc(f * length(sorted))))
  end

  @doc "The median of `xs` (`quantile/2`)."
  def median(xs), do: quantile(xs, 0.5)

  @doc "The `--pairs=N` option among a bench's arguments (default 30), and the others."
  def pairs_option(argv), do: int_option(argv, "pairs", 30)

  @doc "The last `--NAME=N` option among a bench's arguments (else `default`), and the others."
  def int_option(argv, name, default) do
    {flags, rest} = Enum.split_with(argv, &String.starts_with?(&1, "--#{name}="))

    case List.last(flags) do
      nil -> {default, rest}
      flag -> {flag |> String.split("=", parts: 2) |> List.last() |> String.to_integer(), rest}
    end
  end

  @doc """
  Runs and prints a table of `paired/6` comparisons against bench/defn.py's server on
  `dump` (its graphs file), with `blas` preloaded on the Python side. Each row is
  `{cells, fun, name, reps}`: the row's first cells, Emily's call, the server's graph
  and the calls per window.
  """
  def paired_table(dump, blas, pairs, rows) do
    server = python_server(Path.expand("../defn.py", __DIR__), [dump], [{"LD_PRELOAD", blas}])

    IO.puts("""

    Paired windows: #{pairs} pairs per row, each one window of Emily's calls and one of
    Python's runs of the same graph (four times the reps above), in alternating order.
    Medians of each side's mean time per run and of the pairs' ratios (Emily / Python),
    the ratios' quartiles, and the share of pairs in which Emily was the faster.
    | graph | Emily | Python | Emily per run | Python per run | ratio (q1-q3) | Emily faster |
    |---|---|---|---|---|---|---|\
    """)

    ratio = fn x -> :erlang.float_to_binary(x, decimals: 2) end
    us = fn x -> :erlang.float_to_binary(x * 1.0, decimals: 1) <> " us" end

    for {cells, fun, name, reps} <- rows do
      r = paired(fun, server, name, reps, pairs)

      IO.puts(
        "| #{Enum.join(cells, " | ")} | #{us.(r.emily)} | #{us.(r.python)} | " <>
          "**#{ratio.(r.ratio)}** (#{ratio.(r.q1)}-#{ratio.(r.q3)}) | #{round(r.faster * 100)}% |"
      )
    end

    Port.close(server)
  end

  @doc "Starts `script --serve` (bench/defn.py's server of timed windows) on `args`."
  def python_server(script, args, env) do
    python = System.find_executable("python3") || raise "python3 not found"

    port =
      Port.open({:spawn_executable, python}, [
        :binary,
        :exit_status,
        {:line, 1024},
        args: [script | args] ++ ["--serve"],
        env:
          Enum.map(python_env(env), fn {k, v} -> {~c"#{k}", if(v, do: ~c"#{v}", else: false)} end)
      ])

    receive do
      {^port, {:data, {:eol, "ready"}}} -> port
      {^port, {:exit_status, status}} -> raise "the Python server exited (#{status})"
    end
  end

  @doc """
  Asks the server (`python_server/3`) for one window: the mean microseconds per run of
  `reps` runs of graph `name`, after untimed runs for `warm` ms.
  """
  def python_window(port, name, reps, warm) do
    Port.command(port, "#{name} #{reps} #{warm}\n")

    receive do
      {^port, {:data, {:eol, us}}} -> String.to_float(us)
      {^port, {:exit_status, status}} -> raise "the Python server exited (#{status})"
    end
  end

  @doc """
  Sends the server (`python_server/3`) one request line and reads its answer, one line
  of `name=value` pairs: a map of atom names to floats (other lines the server printed
  are passed over).
  """
  def python_request(port, request) do
    Port.command(port, request <> "\n")
    answer(port)
  end

  defp answer(port) do
    receive do
      {^port, {:data, {:eol, line}}} ->
        figures =
          for pair <- String.split(line),
              [k, v] <- [String.split(pair, "=", parts: 2)],
              {x, ""} <- [Float.parse(v)],
              into: %{},
              do: {String.to_atom(k), x}

        if figures == %{}, do: answer(port), else: figures

      {^port, {:exit_status, status}} ->
        raise "the Python server exited (#{status})"
    end
  end
end
