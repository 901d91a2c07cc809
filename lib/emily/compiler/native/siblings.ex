if Code.ensure_loaded?(Nx) do
  defmodule Emily.Compiler.Native.Siblings do
    @moduledoc false
    # The products of one input by several weights, as one instruction: a layer's query,
    # key and value projections (`Nx.dot(x, [-1], w, [0])` of the same x, each weight a
    # parameter), a gated unit's gate and up. In a decoding step each is a row times a
    # matrix through Emily's kernels, and the host's cost is per node: one node computes
    # all of them (`dots2`/`dots3`, cpp/linalg.h), where a GPU launches one kernel for
    # the three projections and a CPU wakes its helpers once. Other rows run the products
    # the `dot`s would, so the rewrite holds for any shape; each product's values are the
    # same bits as alone.
    #
    # A pass over the lowered program (after folding and pruning, one slot per
    # instruction): `dot`s of the same operand and contraction axis, no batch axes, each
    # contracting axis 0 of a program input (a weight: present before any instruction
    # runs, so the group can run where its first member was), in groups of up to three.

    @max 3

    @doc false
    # `lowered` with its sibling products grouped, and the rewrites made (for
    # Native.Fusion's report); `lowered` as it is where `fuse?` is false. Its `:dots`
    # maps a `dot`'s slot to its result's `{shape, type}`.
    def group(lowered, false), do: {lowered, []}

    def group(%{instrs: instrs, inputs: n, dots: shapes} = lowered, true) do
      indexed = Enum.with_index(instrs, n)

      groups =
        indexed
        |> Enum.filter(fn {instr, _slot} -> sibling_key(instr, n) end)
        |> Enum.group_by(fn {instr, _slot} -> sibling_key(instr, n) end, &elem(&1, 1))
        |> Map.values()
        |> Enum.flat_map(&chunks/1)

      case groups do
        [] -> {lowered, []}
        groups -> {regrouped(lowered, indexed, groups), Enum.map(groups, &report(&1, shapes))}
      end
    end

    defp sibling_key({:dot, [x, [c], [], w, [0], []]}, n) when w < n, do: {x, c}
    defp sibling_key(_instr, _n), do: nil

    # Groups of two or three (four as two and two); a lone product stays as it is.
    defp chunks(slots) when length(slots) < 2, do: []
    defp chunks([a, b, c, d | rest]) when rest == [], do: [[a, b], [c, d]]
    defp chunks(slots) when length(slots) <= @max, do: [slots]

    defp chunks(slots) do
      {group, rest} = Enum.split(slots, @max)
      [group | chunks(rest)]
    end

    # The program with each group's first `dot` replaced by the group's instruction and
    # the others left out, every slot renumbered (a group's instruction holds one slot
    # per product, in the group's order).
    defp regrouped(%{inputs: n, outputs: outputs} = lowered, indexed, groups) do
      weights = Map.new(indexed, fn {instr, slot} -> {slot, instr} end)
      first = Map.new(groups, fn [slot | _] = group -> {slot, group} end)
      later = MapSet.new(Enum.flat_map(groups, &tl/1))

      {instrs, index, _next} =
        Enum.reduce(indexed, {[], %{}, n}, fn {instr, slot}, {acc, index, next} ->
          renumber = fn s -> if s < n, do: s, else: Map.fetch!(index, s) end

          cond do
            MapSet.member?(later, slot) ->
              {acc, index, next}

            group = first[slot] ->
              {:dot, [x, [c], [], _, [0], []]} = instr
              ws = Enum.map(group, fn s -> weights |> Map.fetch!(s) |> elem(1) |> Enum.at(3) end)
              index = group |> Enum.with_index(next) |> Enum.into(index)

              {[{:"dots#{length(group)}", [renumber.(x), c | ws]} | acc], index,
               next + length(group)}

            true ->
              {[Emily.Program.map_slots(instr, renumber) | acc], Map.put(index, slot, next),
               next + 1}
          end
        end)

      renumber = fn s -> if s < n, do: s, else: Map.fetch!(index, s) end
      %{lowered | instrs: Enum.reverse(instrs), outputs: Enum.map(outputs, renumber)}
    end

    defp report(group, shapes) do
      {shapes, [type | _]} = group |> Enum.map(&Map.fetch!(shapes, &1)) |> Enum.unzip()
      %{rewrite: :dots, products: length(group), shapes: shapes, type: type}
    end
  end
end
