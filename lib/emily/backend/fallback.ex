if Code.ensure_loaded?(Nx) do
  defmodule Emily.Backend.Fallback do
    @moduledoc false
    # Runs an Nx.Backend callback on Nx.BinaryBackend for Emily.Backend, for the ops (and
    # types) MLX has no path for: the tensors are read out of MLX, the callback runs with
    # the default backend pinned to Nx.BinaryBackend (BinaryBackend builds tensors on the
    # *default* backend inside window_reduce, conv and window_scatter_*), and the result
    # goes back into MLX on the op's stream.
    #
    # What a fallback does besides running (warn, raise) and its telemetry span are
    # Emily.Fallback's: `config :emily, :fallback`.

    alias Nx.Tensor, as: T

    @doc """
    Applies `Nx.BinaryBackend.op(out, args...)`, with the Emily tensors in `args` (also
    inside lists and tuples) read into BinaryBackend tensors, and converts the result
    back with `back.(binary_backend_tensor)`. `out` is the output template and is passed
    as it is.
    """
    def run(op, [out | args], back) do
      inputs = for t <- tensors(args), do: {t.shape, t.type}

      Emily.Fallback.span(op, inputs, fn ->
        args = Enum.map(args, &to_binary_backend/1)

        result =
          Nx.with_default_backend(Nx.BinaryBackend, fn ->
            apply(Nx.BinaryBackend, op, [out | args])
          end)

        from_binary_backend(result, back)
      end)
    end

    defp to_binary_backend(%T{data: %Emily.Backend{}} = t) do
      Nx.BinaryBackend.from_binary(t, Emily.Backend.to_binary(t, Nx.size(t)), [])
    end

    defp to_binary_backend(%T{} = t), do: t
    defp to_binary_backend(list) when is_list(list), do: Enum.map(list, &to_binary_backend/1)

    defp to_binary_backend(tuple) when is_tuple(tuple) and tuple_size(tuple) > 0 do
      if Enum.any?(Tuple.to_list(tuple), &match?(%T{}, &1)) do
        tuple |> Tuple.to_list() |> Enum.map(&to_binary_backend/1) |> List.to_tuple()
      else
        tuple
      end
    end

    defp to_binary_backend(other), do: other

    defp from_binary_backend(%T{} = t, back), do: back.(t)

    defp from_binary_backend(tuple, back) when is_tuple(tuple) do
      tuple |> Tuple.to_list() |> Enum.map(&from_binary_backend(&1, back)) |> List.to_tuple()
    end

    defp tensors([%T{} = t | rest]), do: [t | tensors(rest)]
    defp tensors([list | rest]) when is_list(list), do: tensors(list) ++ tensors(rest)
    defp tensors([_ | rest]), do: tensors(rest)
    defp tensors([]), do: []
  end
end
