if Code.ensure_loaded?(Nx) do
  defmodule Emily.Distributed.Serving do
    @moduledoc """
    `Nx.Serving` across BEAM nodes with Emily.

    `Nx.Serving` already spreads requests over a cluster: `Nx.Serving.batched_run/3`
    with `{:distributed, name}` (or a name with no local serving) sends the batch to a
    node that runs the serving, through `:pg`. An Emily tensor cannot make that trip as
    it is: it holds a native handle (an MLX array in this VM's memory), and a handle that
    reaches another node is a plain reference there, which Emily refuses with an
    `ArgumentError` saying so. So what crosses nodes must be values: `values/1` copies
    every Emily tensor of a request, a result or a stream of results to
    `Nx.BinaryBackend`, and the receiving node's Emily ops take those as inputs.

    On every node, with Emily as the default backend and compiler:

        Nx.global_default_backend(Emily.Backend)
        Nx.Defn.global_default_options(compiler: Emily.Compiler)

    On the node that serves:

        serving =
          Nx.Serving.jit(&MyModel.predict/1)
          |> Emily.Distributed.Serving.postprocessing()

        Nx.Serving.start_link(serving: serving, name: MyServing, batch_size: 8)

    From any node of the cluster:

        Nx.Serving.batched_run(
          {:distributed, MyServing},
          Nx.Batch.stack([input]),
          &Emily.Distributed.Serving.values/1
        )

    Results come back on `Nx.BinaryBackend` (`Nx.backend_transfer/2` them to
    `Emily.Backend` to go on computing here). Streaming servings (`Nx.Serving.streaming/2`)
    and `partitions: true` work the same way; `postprocessing/1` copies each streamed
    event.

    A node that goes down while it runs a batch ends the call with an exit
    (`{:noconnection, _}` or the serving's reason), the caller's monitor on the remote
    request sees to that: no caller waits for a dead node. `Nx.Serving` retries on
    another node only when the chosen one no longer runs the serving (`:noproc`).
    """

    @doc """
    `term` with every Emily tensor copied to `Nx.BinaryBackend`: tensors, containers
    (tuples, maps, `Nx.Container` structs), `Nx.Batch`es, lists, and streams of serving
    events (`{:batch, output, metadata}`, `{hook, value}`), copied as they are consumed.
    Anything else is returned as is. Tensors of other backends are left alone.
    """
    @spec values(term) :: term
    def values(%Nx.Tensor{data: %Emily.Backend{}} = t), do: Nx.backend_copy(t, Nx.BinaryBackend)
    def values(%Nx.Tensor{} = t), do: t

    def values(%Nx.Batch{stack: stack} = batch) do
      # An entry of a batch is {leaf_funs, size}: one zero-arity fun per leaf of its
      # template, returning that leaf's tensor (Nx.Batch's layout in Nx 0.12 and 0.13).
      stack =
        for {funs, size} <- stack do
          {Enum.map(funs, fn fun ->
             t = values(fun.())
             fn -> t end
           end), size}
        end

      %{batch | stack: stack}
    end

    def values(%Stream{} = stream), do: Stream.map(stream, &event/1)
    def values(fun) when is_function(fun, 2), do: Stream.map(fun, &event/1)
    def values(list) when is_list(list), do: Enum.map(list, &values/1)

    def values(tuple) when is_tuple(tuple),
      do: tuple |> Tuple.to_list() |> Enum.map(&values/1) |> List.to_tuple()

    def values(%{__struct__: _} = struct) do
      if Nx.Container.impl_for(struct),
        do: Nx.backend_copy(struct, Nx.BinaryBackend),
        else: struct
    end

    def values(%{} = map), do: Map.new(map, fn {k, v} -> {k, values(v)} end)
    def values(other), do: other

    defp event({:batch, output, metadata}), do: {:batch, values(output), metadata}
    defp event({name, value}), do: {name, values(value)}
    defp event(other), do: values(other)

    @doc """
    Sets `serving`'s `Nx.Serving.distributed_postprocessing/2` to `values/1` (after any
    postprocessing it had), so that results sent to another node are values.
    """
    @spec postprocessing(Nx.Serving.t()) :: Nx.Serving.t()
    def postprocessing(%Nx.Serving{distributed_postprocessing: previous} = serving) do
      Nx.Serving.distributed_postprocessing(serving, fn result -> values(previous.(result)) end)
    end
  end
end
