if Code.ensure_loaded?(Nx) do
  defmodule Emily.NxLazy do
    @moduledoc false
    # A lazy container (Nx.LazyContainer) whose `:b` raises when its value is asked for,
    # and the container it traverses to: a compiler must not ask for a value the graph
    # does not read. (Here, not in a test file, so that its implementation is part of
    # the consolidated protocol.)
    defstruct [:a, :b, :c]

    defmodule Wrapped do
      @moduledoc false
      @derive {Nx.Container, containers: [:a, :b, :c]}
      defstruct [:a, :b, :c]
    end

    defimpl Nx.LazyContainer do
      def traverse(%{a: a, b: b, c: c}, acc, fun) do
        {a, acc} = fun.(Nx.to_template(a), fn -> Nx.tensor(a) end, acc)
        {b, acc} = fun.(Nx.to_template(b), fn -> raise "the value of :b was asked for" end, acc)
        {c, acc} = fun.(Nx.to_template(c), fn -> Nx.tensor(c) end, acc)
        {%Emily.NxLazy.Wrapped{a: a, b: b, c: c}, acc}
      end
    end
  end
end
