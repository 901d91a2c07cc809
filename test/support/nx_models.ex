if Code.ensure_loaded?(Nx) do
  defmodule Emily.NxModels do
    @moduledoc false
    # Small models the defn compiler suites run through every path.
    import Nx.Defn

    defn softmax(x) do
      e = Nx.exp(x - Nx.reduce_max(x, axes: [-1], keep_axes: true))
      e / Nx.sum(e, axes: [-1], keep_axes: true)
    end

    defn mlp(x, {w1, b1, w2, b2}) do
      x |> Nx.dot(w1) |> Nx.add(b1) |> Nx.tanh() |> Nx.dot(w2) |> Nx.add(b2) |> softmax()
    end

    defn attention(q, k, v) do
      scores = Nx.dot(q, [2], [0], k, [2], [0]) / Nx.sqrt(Nx.axis_size(q, 2))
      Nx.dot(softmax(scores), [2], [0], v, [1], [0])
    end

    # A `while` loop of four passes.
    defn powers(x) do
      {_i, acc, _x} =
        while {i = 0, acc = x, x}, i < 4 do
          {i + 1, acc * x + 1, x}
        end

      acc
    end

    # A `while` whose condition reads the input: the native path runs it on the host.
    defn grow(x) do
      while acc = x, Nx.all(acc < 100) do
        acc * 2 + 1
      end
    end

    # The same loop in a branch: the native path runs the conditional on the host.
    defn grow_if_positive(x) do
      if Nx.sum(x) > 0, do: grow(x), else: x
    end

    # And in a branch in a counted loop: what the native path does not lower (the loop
    # is unrolled, and a branch not taken would run the inner loop too).
    defn grow_twice_if_positive(x) do
      {x, _i} = while({x, i = 0}, i < 2, do: {grow_if_positive(x), i + 1})
      x
    end

    # A function of `reduce` other than one Nx op: what the native path does not lower.
    defn(odd_fold(x), do: Nx.reduce(x, 0, fn a, b -> a + b * 2 end))
  end
end
