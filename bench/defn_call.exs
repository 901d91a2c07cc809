# Where a `Nx.Defn.jit` call's time goes beyond its program's run: bench/defn.exs's MLP
# (16x512-256-256-10) and tiny MLP (1x8-8-8-8), each call a whole run (the graph
# evaluated, its result read back to the host), so that each call's Elixir work runs in
# the caches the graph's own computation left behind, as it does in use. Needs Nx (see
# bench/defn.exs):
#
#     MIX_ENV=dev mix run path/to/emily/bench/defn_call.exs [rounds]
#
# Rows, each adding one layer to the one above:
#
#   * the lowered program through `Emily.Program.eval/3`, its result read with
#     `Emily.Native.to_binary/2` (no telemetry);
#   * read with `Emily.to_binary/1` instead: its `[:emily, :to_binary]` span, where
#     `:telemetry` is loaded;
#   * read with `Nx.to_binary/1` (of an `Emily.Backend` tensor), which calls the above;
#   * plus a `Nx.Defn.jit` call of a compiler that answers at once: Nx's own part of a
#     jit call (its arguments made lazy parameters, its options merged);
#   * `Nx.Defn.compile/3`'s function on Emily.Compiler (the program lowered ahead);
#   * `Nx.Defn.jit/2` on Emily.Compiler (the program found per call).
#
# Each row's windows (of `reps` calls, after a warm-up) run in fresh processes
# (Bench.isolated/1), alternated with the other rows' `rounds` times (default 15);
# printed: the median and best window, and the median's difference from the first row.
unless Code.ensure_loaded?(Nx) do
  raise "bench/defn_call.exs needs Nx (see the comment at the top)"
end

Code.require_file("support/defn_models.exs", __DIR__)

defmodule Bench.DefnCall do
  alias Bench.Defn.Models

  defmodule Instant do
    @moduledoc false
    # A compiler that answers at once: what Nx.Defn.jit costs before a compiler runs.
    @behaviour Nx.Defn.Compiler
    @impl true
    def __jit__(_key, _vars, _fun, args_list, _opts), do: Enum.map(args_list, fn _ -> :ok end)
    @impl true
    def __compile__(_key, _vars, _fun, _opts), do: raise("jit only")
    @impl true
    def __partitions_options__(opts), do: [opts]
    @impl true
    def __to_backend__(_opts), do: {Emily.Backend, []}
  end

  # The rows for `args` (Emily tensors): `{label, fun}`.
  def rows(args) do
    {instrs, n, outputs, extras, _template} =
      Emily.Compiler.Native.instructions_of(&Models.mlp/2, args)

    program = Emily.Program.new(instrs, inputs: n, outputs: outputs)
    inputs = Enum.map(Nx.Defn.Composite.flatten_list(args), & &1.data.ref) ++ extras
    s = Emily.Stream.current()
    [x, params] = args
    instant = Nx.Defn.jit(&Models.mlp/2, compiler: Instant)
    compiled = Nx.Defn.compile(&Models.mlp/2, args, compiler: Emily.Compiler)
    jit = Nx.Defn.jit(&Models.mlp/2, compiler: Emily.Compiler)

    raw = fn ->
      [out] = Emily.Program.eval(program, inputs, stream: s)
      ref = make_ref()

      case Emily.Native.to_binary(ref, out) do
        {:ok, bin} -> bin
        ^ref -> Emily.await(ref)
      end
    end

    eval = fn ->
      [out] = Emily.Program.eval(program, inputs, stream: s)
      Emily.to_binary(out)
    end

    template = Nx.to_template(jit.(x, params))

    nx_read = fn ->
      [out] = Emily.Program.eval(program, inputs, stream: s)
      Nx.to_binary(%{template | data: %Emily.Backend{ref: out, stream: s}})
    end

    [
      {"Program.eval, Native.to_binary", raw},
      {"Program.eval, Emily.to_binary", eval},
      {"Program.eval, Nx.to_binary", nx_read},
      {"the same, plus Nx.Defn.jit's own part",
       fn ->
         instant.(x, params)
         nx_read.()
       end},
      {"Nx.Defn.compile, Nx.to_binary", fn -> Nx.to_binary(compiled.(x, params)) end},
      {"Nx.Defn.jit, Nx.to_binary", fn -> Nx.to_binary(jit.(x, params)) end}
    ]
  end

  def window(fun, reps) do
    Bench.isolated(fn ->
      Enum.each(1..div(reps, 4), fn _ -> fun.() end)
      {us, _} = :timer.tc(fn -> Enum.each(1..reps, fn _ -> fun.() end) end)
      us / reps
    end)
  end

  def fmt(us), do: :erlang.float_to_binary(us * 1.0, decimals: 1) <> " us"
end

Code.require_file("support/bench.exs", __DIR__)

rounds =
  case System.argv() do
    [n] -> String.to_integer(n)
    [] -> 15
  end

IO.puts(
  "MLX #{Emily.mlx_version()} on the CPU; Nx #{Application.spec(:nx, :vsn)}; " <>
    "telemetry #{if Emily.Telemetry.enabled?(), do: "loaded", else: "absent"}; " <>
    "load average #{File.read!("/proc/loadavg") |> String.split() |> Enum.take(3) |> Enum.join(" ")}; " <>
    "#{rounds} rounds"
)

Nx.default_backend({Emily.Backend, device: :cpu})
key = Nx.Random.key(42)

for {label, {batch, din, hidden, dout}, reps} <- [
      {"MLP", {16, 512, 256, 10}, 200},
      {"tiny MLP", {1, 8, 8, 8}, 500}
    ] do
  shapes = [{din, hidden}, {hidden}, {hidden, hidden}, {hidden}, {hidden, dout}, {dout}]

  {params, key} =
    Enum.map_reduce(shapes, key, fn shape, key ->
      Nx.Random.normal(key, 0.0, 0.05, shape: shape, type: :f32)
    end)

  {x, _key} = Nx.Random.normal(key, 0.0, 1.0, shape: {batch, din}, type: :f32)
  rows = Bench.DefnCall.rows([x, List.to_tuple(params)])

  times =
    for _ <- 1..rounds, {name, fun} <- rows, reduce: %{} do
      acc ->
        t = Bench.DefnCall.window(fun, reps)
        Map.update(acc, name, [t], &[t | &1])
    end

  [{first, _} | _] = rows
  base = Bench.median(times[first])

  IO.puts("\n#{label} #{batch}x#{din}-#{hidden}-#{hidden}-#{dout}, #{reps} calls a window")
  IO.puts("| call | median | best | median - first row's |")
  IO.puts("|---|---|---|---|")

  for {name, _} <- rows do
    m = Bench.median(times[name])

    IO.puts(
      "| #{name} | #{Bench.DefnCall.fmt(m)} | #{Bench.DefnCall.fmt(Enum.min(times[name]))} | " <>
        "#{Bench.DefnCall.fmt(m - base)} |"
    )
  end
end
