# What bench/models.exs, bench/quantized.exs and bench/peak_memory.exs share: their
# command-line options, the checkpoints and the prompt, the process's memory, the tables'
# number formats, the comparison of token ids, and the per-token breakdown of a traced
# Bumblebee generation on Emily.
defmodule Bench.Decode do
  @moduledoc false

  def option(argv, name, default) do
    Enum.find_value(argv, default, fn arg ->
      case String.split(arg, "=", parts: 2) do
        ["--" <> ^name, value] -> value
        _ -> nil
      end
    end)
  end

  def list_option(argv, name, default),
    do: argv |> option(name, default) |> String.split(",", trim: true)

  # The folder of bench/make_models.py's checkpoints: `--dir`, by default
  # $EMILY_CACHE/bench-models.
  def models_dir(argv) do
    cache = System.get_env("EMILY_CACHE", Path.expand("~/.cache/emily"))
    option(argv, "dir", Path.join(cache, "bench-models"))
  end

  # A 128-character ASCII prompt: 128 tokens of bench/make_models.py's byte-level tokenizer.
  @prompt "Emily runs Nx on MLX through a Rust NIF; this prompt is exactly one hundred and " <>
            "twenty-eight bytes long, one token per byte. OK!"
  128 = byte_size(@prompt)
  def prompt, do: @prompt

  def load_average,
    do: File.read!("/proc/loadavg") |> String.split() |> Enum.take(3) |> Enum.join(" ")

  # Resets the process's peak RSS (VmHWM) to its current RSS.
  def reset_rss_peak, do: File.write("/proc/self/clear_refs", "5")

  def rss_peak_mb, do: status_mb("VmHWM")
  def rss_mb, do: status_mb("VmRSS")

  defp status_mb(field) do
    [_, kb] = Regex.run(~r/#{field}:\s+(\d+) kB/, File.read!("/proc/self/status"))
    String.to_integer(kb) / 1024
  end

  def f(nil, _), do: "—"
  def f(x, decimals), do: :erlang.float_to_binary(x * 1.0, decimals: decimals)

  def ratio(a, b) when is_number(a) and is_number(b) and b != 0, do: f(a / b, 2)
  def ratio(_, _), do: "—"

  def read_ids(path),
    do: path |> File.read!() |> String.split() |> Enum.map(&String.to_integer/1)

  # Where two token lists first differ (nil when equal).
  def parting(a, b) do
    Enum.zip(a, b) |> Enum.find_index(fn {x, y} -> x != y end) ||
      if length(a) == length(b), do: nil, else: min(length(a), length(b))
  end

  # How far two sides' token ids agree ("—" where a side is missing).
  def agreement(a, b) when is_list(a) and is_list(b) do
    case parting(a, b) do
      nil -> "all #{length(a)} equal"
      i -> "first #{i} of #{length(a)} equal, part at token #{i + 1}"
    end
  end

  def agreement(_, _), do: "—"

  # Starts a greedy `Bumblebee.Text.generation` serving of `new` tokens (no end token) on
  # Emily.Compiler for the model `info` loaded from `dir`, batch 1 and `prompt`'s length,
  # whose postprocessing returns the token ids: `{pid, name}`. The Python sides are given
  # the prompt's bytes as its ids, so the checkpoint's tokenizer must be
  # bench/make_models.py's byte-level one.
  def start_generation(info, dir, prompt, new, defn_options \\ []) do
    {:ok, tokenizer} = Bumblebee.load_tokenizer({:local, dir})
    tokens = Bumblebee.apply_tokenizer(tokenizer, prompt)["input_ids"] |> Nx.to_flat_list()

    if tokens != :binary.bin_to_list(prompt),
      do: raise("#{dir}: the tokenizer is not bench/make_models.py's byte-level one")

    {:ok, config} = Bumblebee.load_generation_config({:local, dir})

    config =
      Bumblebee.configure(config,
        max_new_tokens: new,
        eos_token_id: nil,
        pad_token_id: info.spec.pad_token_id || 151_643
      )

    serving =
      Bumblebee.Text.generation(info, tokenizer, config,
        compile: [batch_size: 1, sequence_length: byte_size(prompt)],
        defn_options: [compiler: Emily.Compiler] ++ defn_options
      )
      |> Nx.Serving.client_postprocessing(fn {%{token_ids: ids}, _meta}, _info ->
        Nx.to_flat_list(ids)
      end)

    name = :"bench_generation_#{System.unique_integer([:positive])}"
    {:ok, pid} = Nx.Serving.start_link(serving: serving, name: name, batch_size: 1)
    {pid, name}
  end

  # Stops a started serving and waits until it is down.
  def stop(pid) do
    Process.unlink(pid)
    ref = Process.monitor(pid)
    Process.exit(pid, :shutdown)

    receive do
      {:DOWN, ^ref, _, _, _} -> :ok
    end
  end

  # A loop pass's program calls (queued or evaluated) and condition reads, timed by call
  # tracing: the call messages carry arities only (no tensors), so the trace holds no
  # arrays. `{result, t0, t1, events}`.
  @traced [{Emily.Program, :eval, 3}, {Emily.Program, :run, 3}, {Emily, :to_list, 1}]

  def traced(fun) do
    me = self()
    tracer = spawn(fn -> collect(me, []) end)
    for mfa <- @traced, do: :erlang.trace_pattern(mfa, true, [:global])
    :erlang.trace(:all, true, [:call, :arity, :monotonic_timestamp, {:tracer, tracer}])
    t0 = System.monotonic_time()
    result = fun.()
    t1 = System.monotonic_time()
    :erlang.trace(:all, false, [:call])
    for mfa <- @traced, do: :erlang.trace_pattern(mfa, false, [:global])
    send(tracer, :done)

    receive do
      {:events, events} -> {result, t0, t1, events}
    end
  end

  defp collect(parent, acc) do
    receive do
      {:trace_ts, _pid, :call, {m, f, _a}, ts} -> collect(parent, [{{m, f}, ts} | acc])
      # (Messages the VM sent before the trace stopped are already in the mailbox.)
      :done -> send(parent, {:events, drain(acc) |> Enum.reverse()})
    end
  end

  defp drain(acc) do
    receive do
      {:trace_ts, _pid, :call, {m, f, _a}, ts} -> drain([{{m, f}, ts} | acc])
    after
      0 -> acc
    end
  end

  @doc """
  The per-token breakdown of a traced generation: each pass of the loop is a program
  call (`Emily.Program.run/3`, queued, where the loop overlaps; else
  `Emily.Program.eval/3`) and a read of a condition. Returns the prefill (from the call
  to the first condition read), the period between condition reads (a token's time),
  and the time from a pass's program call to the next read, in ms (medians): where the
  loop overlaps, the host's cost of building and queueing a pass, which the device's
  work on the pass before hides while it is the shorter; else the pass's whole
  evaluation.
  """
  def breakdown(t0, t1, events) do
    ms = fn native -> System.convert_time_unit(native, :native, :microsecond) / 1000 end
    reads = for {{Emily, :to_list}, ts} <- events, do: ts
    calls = for {{Emily.Program, f}, ts} <- events, f in [:run, :eval], do: {f, ts}
    pairs = Enum.chunk_every(reads, 2, 1, :discard)

    to_read =
      for [prev, read] <- pairs do
        {_, start} =
          calls |> Enum.filter(&(elem(&1, 1) > prev and elem(&1, 1) < read)) |> List.last()

        ms.(read - start)
      end

    periods = for [a, b] <- pairs, do: ms.(b - a)

    %{
      prefill_ms: ms.(hd(reads) - t0),
      passes: length(periods),
      calls: length(calls),
      overlapped: Enum.any?(calls, &(elem(&1, 0) == :run)),
      pass_ms: if(periods != [], do: Bench.median(periods)),
      call_to_read_ms: if(to_read != [], do: Bench.median(to_read)),
      after_ms: ms.(t1 - List.last(reads)),
      total_ms: ms.(t1 - t0)
    }
  end
end
