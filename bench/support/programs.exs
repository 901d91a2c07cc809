# The programs bench/defn.exs lowered and kept (`--keep=DIR`), loaded without Nx: shared by
# bench/program.exs and bench/overhead.exs.
defmodule Bench.Programs do
  @moduledoc false

  @doc """
  Each graph of `DIR/graphs.etf` (name, instructions, outputs, reps, inputs' files), with
  its inputs evaluated on the CPU's default stream (`tensors`, `stream`) and its program
  built plain and compiled with mx::compile (`plain`, `compiled`).
  """
  def load(dir) do
    for g <- :erlang.binary_to_term(File.read!(Path.join(dir, "graphs.etf"))) do
      s = Emily.Stream.default(:cpu)

      inputs =
        for {path, shape, type} <- g.inputs do
          Emily.from_binary(File.read!(Path.join(dir, Path.basename(path))), shape, type,
            stream: s
          )
        end

      Emily.eval(inputs)

      program = fn compile ->
        Emily.Program.new(g.instrs, inputs: length(inputs), outputs: g.outputs, compile: compile)
      end

      Map.merge(g, %{tensors: inputs, plain: program.(false), compiled: program.(true), stream: s})
    end
  end
end
