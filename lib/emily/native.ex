defmodule Emily.Native do
  @moduledoc """
  The NIF: one function per MLX op, no policy.

  Every function here is defined from the op table in `native/emily/optable/*.ops`, the
  same table the Rust build turns into NIFs, so the two sides cannot drift apart.

  ## Calling conventions

    * **Ops** take a stream first (`Emily.Stream`'s handle), then their arguments, and
      return tensor handles at once. The stream's worker thread builds the MLX graph
      node behind them, in order. An MLX error in a lazy op is kept in its output and
      raised (as `Emily.Error`, naming the op, shapes and dtypes) by the next call that
      waits for a value: `eval/2`, `to_binary/2`, `describe/2`.
    * **Waiting calls** (`eval`, `to_binary`, `describe`) take a reference first and
      return it; the worker replies `{ref, {:ok, value} | {:error, %Emily.Error{}}}` to
      the caller. `Emily` wraps them in a `receive`. `to_binary` of a tensor already
      evaluated returns `{:ok, binary}` at once instead (no worker involved).
    * Bad Elixir arguments (wrong term types, an unknown dtype, a negative dimension)
      raise `ArgumentError` before any native work.

  ## Beyond ops

    * **Streams** (`stream_*`): see `Emily.Stream`. An op's tensor inputs may belong to
      any stream; a lazy one is evaluated on its own stream first.
    * **Graphs**: `eval/2` takes tensors of any streams; `async_eval/1` starts
      evaluations and returns; `program_new/4` and `program_run/3` replay a list of ops
      in one call, optionally compiled (`Emily.Program` documents the format);
      `program_eval/3` runs and evaluates one on the calling dirty scheduler when its
      inputs are evaluated (`:pending` otherwise, which `tensor_evaluated/1` tells
      without that dirty call; `:worker` for a compiled GPU program, which runs on its
      stream's worker); `program_eval_async/4` and `program_eval_take/1` do the
      same for a CPU program that MLX takes quickly, without the dirty scheduler
      (`:dirty` when it does not qualify, and once for a program whose outputs come out
      strided, which `program_eval/3` then copies; see `Emily.Program.eval/3`);
      `program_compiled/1` tells whether a program was built with `compile: true`;
      `op_table/0` lists the ops programs can use.
    * **Memory** (`memory_stats/2`, `set_memory_limit/3`, ...): see `Emily.Memory`. Any op
      result larger than MLX's memory limit fails with `Emily.Error`.
    * **Debug** (`debug_*`): counts read back by `Emily.Debug`.

  List arguments must be proper lists. Integers in `int` and `ints` arguments must fit in
  32 bits (MLX's axes, sizes, counts, starts and strides are 32-bit); `int64` arguments
  (seeds, byte counts, element offsets, `randint` bounds) take any signed 64-bit integer.
  Anything else raises `ArgumentError`, naming the op.

  Dtypes are Nx type names: `{:u, 8}` … `{:s, 64}`, `{:f, 16 | 32 | 64}`, `{:bf, 16}`,
  `{:c, 64}`, and `:bool`. Scalars (`:float` arguments) accept integers, floats, `:nan`,
  `:infinity` and `:neg_infinity`.

  ## Ops
  #{for row <- Emily.Native.Table.rows(), row.kind == :generated, into: "" do
    "  * `#{row.name}` (#{row.family})\n"
  end}

  ## MLX ops not exposed, and why
  #{for {family, text} <- Emily.Native.Table.not_exposed(), into: "" do
    "  * #{family}: #{text}\n"
  end}
  """

  @on_load :__load_nif__

  for file <- Emily.Native.Table.files(), do: @external_resource(file)

  # The folder too: adding a family file changes its mtime. (A `__mix_recompile__?/0`
  # would have Mix load this module, and its NIF, before recompiling it; the NIF cannot
  # be upgraded in place.)
  @external_resource Emily.Native.Table.dir()

  @doc false
  def __load_nif__ do
    path = :filename.join(:code.priv_dir(:emily), ~c"native/libemily")

    case :erlang.load_nif(path, 0) do
      :ok -> :ok
      {:error, {:reload, _}} -> :ok
      {:error, reason} -> {:error, reason}
    end
  end

  for row <- Emily.Native.Table.rows() do
    names = Enum.map(row.args, &elem(&1, 0))
    names = if row.kind == :generated, do: [:stream | names], else: names
    vars = Enum.map(names, &Macro.var(:"_#{&1}", __MODULE__))
    signature = Enum.map_join(names, ", ", &Atom.to_string/1)

    types =
      Enum.map_join(row.args, ", ", fn {n, t} -> "`#{n}` #{t}" end)

    returns =
      cond do
        row.kind == :custom -> ""
        row.outputs == 1 -> " Returns a tensor."
        is_atom(row.outputs) -> " Returns a list of tensors, as many as `#{row.outputs}` says."
        true -> " Returns a list of #{row.outputs} tensors."
      end

    @doc """
    `#{row.name}(#{signature})`#{if types != "", do: ": " <> types}.#{returns}

    #{if row.expr, do: "MLX: `#{row.expr}`", else: "Hand-written (`native/emily/src`)."}
    """
    def unquote(row.name)(unquote_splicing(vars)), do: :erlang.nif_error(:nif_not_loaded)
  end
end
