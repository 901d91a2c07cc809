defmodule Emily.Program do
  @moduledoc """
  Programs: a list of `Emily.Native` ops replayed in one native call on one stream,
  optionally compiled with MLX's `mx::compile` (kernel fusion).

  A program replaces a chain of NIF calls (one queue push and one tensor handle per op)
  with one: it is what `Emily.Compiler` lowers an `Nx.Defn` expression to.

  ## Format

      program =
        Emily.Program.new(
          [
            {:multiply, [0, 1]},          # slot 2 = x * w
            {:add, [2, 0]},               # slot 3 = slot 2 + x
            {:sum, [3, [0], false]}       # slot 4 = sum over axis 0
          ],
          inputs: 2,
          outputs: [4],
          compile: true
        )

      [total] = Emily.Program.run(program, [x, w])

    * **Slots.** Slots `0..inputs-1` hold the inputs, in the order `run/3` gets them.
      Each instruction appends its outputs to the slots: one for most ops, `N` for an
      op whose table row says `-> N`, in order. An instruction may only name slots that
      exist before it, so a program is a graph in topological order.
    * **Instructions.** `{op, args}`: `op` is the name of a generated op of the op
      table (`Emily.Native`'s ops; `ops/0` lists them), and `args` are exactly that
      function's arguments after the stream, with a slot index in place of each tensor
      argument: an integer for `tensor`, a list of integers for `tensors`, `nil` or an
      integer for `tensor?`. Every other argument is written as for the NIF (`ints` a
      list, `shape` a tuple or list, `float` a number or `:nan`/`:infinity`/
      `:neg_infinity`, `dtype` an Nx type or `:bool`, ...). The arguments are decoded by
      the same generated code as the NIF's, so they cannot drift apart.
    * **Outputs.** `:outputs` lists the slots `run/3` returns, in order (any slot,
      inputs included, may appear, and more than once). The default is the outputs of
      the last instruction.

  `new/2` checks the whole program: an unknown op, a wrong number of arguments, a badly
  typed argument or a slot that does not exist yet raises `ArgumentError` there.
  Shape and dtype errors come from MLX when the program runs and surface, like any op's,
  as an `Emily.Error` at the next waiting call, naming the instruction
  (`"program_run: instruction 2 (sum): ..."`).

  ## Running and compiling

  `run/3` returns the outputs at once as lazy tensors of the stream it runs on; the
  stream's worker replays the instructions behind them. Inputs may come from any stream.
  A program is immutable and can be run on many streams, concurrently.

  `eval/3` returns the outputs evaluated. When every input is evaluated already, it
  builds and evaluates the whole graph inside one call, on the calling thread's own MLX
  stream of the stream's device, instead of queueing it on the stream's worker and
  waiting for the worker's reply: for a small graph these two thread hand-offs cost
  more than the graph itself. Errors raise there and then. The outputs are tensors of
  the given stream, like `run/3`'s. A lazy input is evaluated first (on its own
  stream).

  Which thread: a graph on the CPU device that MLX takes quickly, while MLX has no other
  evaluation in flight, is built on the caller's own (normal) scheduler, which then
  waits on MLX's evaluation for at most about a millisecond (two at worst); a longer
  evaluation goes on while the caller waits for its message, the scheduler free for
  other processes. Taken quickly means at most 40 MLX nodes (counted once for each set
  of input shapes and dtypes), or, for a larger graph, a hand-over to MLX (building
  the graph, and MLX's waits for its earlier work) of at most 500 us at its last run
  with those shapes (1 ms once it runs here, so that a graph near the bound keeps to
  one path); its first run takes the other path and is measured there, and a run whose
  hand-over takes longer than allowed (a busier machine) holds the scheduler that long
  once, then sends the graph back to the other path. Any other program runs on a dirty
  CPU scheduler, which it holds for as long as the graph takes (the VM has one per
  core): callers beyond that number wait their turn, and other libraries' dirty NIFs
  with them, so a long GPU graph from many processes at once is better served by
  `run/3` on a few streams. The first path exists because a dirty call leaves the
  caller's scheduler without work: it busy-waits, taking a core from MLX's and BLAS's
  threads, then sleeps and must be woken (on two cores, 10-20% of a 100 us graph;
  measured with `bench/program.exs`).

  With `compile: true`, the first run on each thread (a stream's worker for `run/3`, and
  for `eval/3` on a GPU; for `eval/3` on the CPU, the dirty scheduler that runs it:
  MLX's fused CUDA kernels are not safe to evaluate from several threads at once)
  traces the program and compiles it with `mx::compile` (fused elementwise kernels; on
  the CPU MLX builds them with the system C++ compiler, about half a second for each
  kernel not built before, kept in the system's temporary directory for later runs, and
  falls back to unfused code without a compiler). MLX's compile cache is thread-local:
  the compiled function is cached per thread and per input shapes and dtypes, and every
  thread's entry is dropped when the program is garbage. Once a CPU program is compiled
  for some input shapes, `eval/3` with inputs of those shapes may take the caller's own
  scheduler as above (if it has at most 256 instructions, so that tracing it there is
  short): MLX's fused kernels are then built, and that thread only traces the program.
  Its nodes are those of its compiled form (a fused kernel is one), counted on the dirty
  path, where its hand-over is timed too (the first such run includes the compiling).

  `mx::compile`'s tracing recurses along the graph, some 200 bytes of stack per level
  of its depth: a compiled program whose graph is too deep for the calling thread's
  stack (a dirty scheduler's holds a few hundred levels) runs on its stream's worker,
  whose stack is larger, and one too deep for that too (some 32,000 levels) runs there
  uncompiled.

  ## Later runs

  Without `compile: true`, the second run of a program on inputs of one kind on a
  thread records the MLX graph its instructions built (each node's primitive, its
  output shapes and where its inputs come from), and later runs on inputs of that kind
  rebuild the graph from that record, one array a node, without running the
  instructions' ops again: a decoding step's graph is then built in a fraction of the
  time. The record holds each chain of reshapes, added or removed unit axes and
  transposes that move only unit axes as one reshape (a chain back to its start's shape
  as nothing): each node costs the host as much to build and MLX as much to encode,
  whether it computes or not. Inputs are of one kind when their shapes and dtypes, which of them are the same
  tensor, and, for those already computed, their memory layouts are the same: all that
  decides the graph. A program keeps at most eight such records, and after 32
  stops recording (inputs that keep changing shape are replayed). `info/1` counts them.
  """

  @type t :: reference()
  @type instruction :: {atom, list}

  for file <- Emily.Native.Table.files(), do: @external_resource(file)

  # For each generated op, the positions of its tensor arguments and their kinds.
  @tensor_args Map.new(
                 for(row <- Emily.Native.Table.rows(), row.kind == :generated, do: row),
                 fn row ->
                   positions =
                     for {{_name, type}, i} <- Enum.with_index(row.args),
                         type in ~w(tensor tensor? tensors),
                         do: {i, type}

                   {row.name, positions}
                 end
               )

  @doc """
  Builds a program from `instructions`. Options: `:inputs` (required, the number of
  input slots), `:outputs` (slots to return; default the last instruction's outputs),
  `:compile` (default `false`).
  """
  @spec new([instruction], keyword) :: t
  def new(instructions, opts) when is_list(instructions) do
    inputs = Keyword.fetch!(opts, :inputs)
    outputs = Keyword.get_lazy(opts, :outputs, fn -> last_outputs(instructions, inputs) end)
    Emily.Native.program_new(inputs, instructions, outputs, Keyword.get(opts, :compile, false))
  end

  @doc """
  Runs `program` on `inputs` and returns its outputs (lazy tensors). Options: `:stream`
  (default `Emily.Stream.current/0`).
  """
  @spec run(t, [Emily.tensor()], keyword) :: [Emily.tensor()]
  def run(program, inputs, opts \\ []) when is_list(inputs) do
    Emily.Native.program_run(
      Keyword.get_lazy(opts, :stream, &Emily.Stream.current/0),
      program,
      inputs
    )
  end

  @doc """
  The host time the workers have spent building graphs for `run/3`, over every program
  and stream since Emily was loaded: `{runs, microseconds}`.

  Building is the replay of a program's instructions into MLX's lazy nodes; nothing is
  evaluated. Where a loop queues each pass with `run/3` and `Emily.async_eval/1` (as
  `Emily.Compiler`'s `overlap` does) and the host is the limit, a pass's period is this
  building plus MLX's encoding of the nodes for the device: the difference of two
  readings, divided by the runs between them, is a pass's share.
  """
  @spec build_time() :: {non_neg_integer, non_neg_integer}
  def build_time, do: Emily.Native.program_build_time()

  @doc """
  Runs `program` on `inputs` and returns its outputs evaluated (see "Running and
  compiling" above). Options: `:stream` (default `Emily.Stream.current/0`). Raises
  `Emily.Error` if MLX rejects an instruction.
  """
  @spec eval(t, [Emily.tensor()], keyword) :: [Emily.tensor()]
  def eval(program, inputs, opts \\ []) when is_list(inputs) do
    stream = Keyword.get_lazy(opts, :stream, &Emily.Stream.current/0)

    case eval_here(stream, program, inputs) do
      :pending ->
        Emily.evaluate(inputs)
        eval_here(stream, program, inputs)

      outputs ->
        outputs
    end
  end

  # Inputs evaluated: on the calling process's own scheduler when the program qualifies
  # (`program_eval_async`: on the CPU, taken quickly by MLX, compiled already if it is
  # compiled), on a dirty CPU scheduler otherwise; a compiled GPU program on the
  # stream's worker. `:pending` when an input is lazy.
  defp eval_here(stream, program, inputs) do
    ref = make_ref()

    case Emily.Native.program_eval_async(stream, program, inputs, ref) do
      :dirty ->
        dirty(stream, program, inputs)

      outputs when is_list(outputs) ->
        outputs

      pending ->
        :ok = Emily.await(ref)

        # (`:dirty` once for a program whose outputs it must copy: see the NIF.)
        case Emily.Native.program_eval_take(pending) do
          :dirty -> dirty(stream, program, inputs)
          outputs -> outputs
        end
    end
  end

  defp dirty(stream, program, inputs) do
    case Emily.Native.program_eval(stream, program, inputs) do
      :worker -> on_worker(stream, program, inputs)
      outputs -> outputs
    end
  end

  defp on_worker(stream, program, inputs) do
    outputs = Emily.Native.program_run(stream, program, inputs)
    Emily.evaluate(outputs)
    outputs
  end

  @doc """
  `%{inputs: n, instructions: n, outputs: n, compile: boolean, tapes: n}`: `tapes` is the
  number of graphs kept for later runs (see "Later runs").
  """
  @spec info(t) :: %{
          inputs: non_neg_integer,
          instructions: non_neg_integer,
          outputs: non_neg_integer,
          compile: boolean,
          tapes: non_neg_integer
        }
  def info(program), do: Emily.Native.program_info(program)

  @doc """
  The ops a program can use: `{name, id, outputs}` for each generated op of the op table,
  as the native build numbered them.
  """
  @spec ops() :: [{atom, pos_integer, pos_integer}]
  def ops, do: Emily.Native.op_table()

  @doc """
  The slots `instruction` reads, in the order of its arguments (an op's `tensor`,
  `tensor?` and `tensors` arguments, as the op table declares them).
  """
  @spec input_slots(instruction) :: [non_neg_integer]
  def input_slots({op, args}) do
    for {i, _type} <- Map.fetch!(@tensor_args, op),
        slot <- List.wrap(Enum.at(args, i)),
        do: slot
  end

  @doc """
  `instruction` with each slot it reads replaced by `fun.(slot)`.
  """
  @spec map_slots(instruction, (non_neg_integer -> non_neg_integer)) :: instruction
  def map_slots({op, args}, fun) do
    args =
      Enum.reduce(Map.fetch!(@tensor_args, op), args, fn
        {i, "tensors"}, args -> List.update_at(args, i, &Enum.map(&1, fun))
        {i, "tensor?"}, args -> List.update_at(args, i, &(&1 && fun.(&1)))
        {i, "tensor"}, args -> List.update_at(args, i, fun)
      end)

    {op, args}
  end

  defp last_outputs([], _inputs), do: []

  defp last_outputs(instructions, inputs) do
    outputs = Map.new(ops(), fn {name, _id, n} -> {name, n} end)

    {slots, last} =
      Enum.reduce(instructions, {inputs, 0}, fn instr, {slots, _} ->
        n =
          case instr do
            {op, _} when is_atom(op) -> Map.get(outputs, op, 1)
            _ -> 1
          end

        {slots + n, n}
      end)

    Enum.to_list((slots - last)..(slots - 1)//1)
  end
end
