# Nx.Serving on Emily.Compiler: inline runs, batched runs with a batch size, one stream
# per partition, and streaming (with hooks: Emily.NxHooks).
if Code.ensure_loaded?(Nx) do
  defmodule Emily.Nx.ServingTest do
    use ExUnit.Case, async: true
    @moduletag :nx

    import Nx.Defn

    defn(scaled(x), do: x |> Nx.multiply(2) |> Nx.add(1))

    defn staged(batch) do
      batch
      |> Nx.multiply(2)
      |> Emily.NxHooks.named(:double)
      |> Nx.add(10)
      |> Emily.NxHooks.named(:plus_ten)
      |> Nx.divide(2)
    end

    # A serving whose batches wait for the test's go-ahead, so the test can see which
    # partition runs each one, and when.
    defmodule Gated do
      @behaviour Nx.Serving

      @impl true
      def init(_type, pid, partitions) do
        funs = Enum.map(partitions, &Nx.Defn.jit(fn x -> Nx.multiply(x, 3) end, &1))
        {:ok, {funs, pid}}
      end

      @impl true
      def handle_batch(batch, partition, {funs, pid} = state) do
        fun = fn ->
          send(pid, {:batch, partition, self()})

          receive do
            :go -> {Enum.fetch!(funs, partition).(batch), :done}
          end
        end

        {:execute, fun, state}
      end
    end

    defp serving, do: Nx.Serving.jit(&scaled/1, compiler: Emily.Compiler)

    test "run inline" do
      batch = Nx.Batch.stack([Nx.tensor([1, 2]), Nx.tensor([3, 4])])
      out = Nx.Serving.run(serving(), batch)
      assert %Emily.Backend{} = out.data
      assert Nx.to_flat_list(out) == [3, 5, 7, 9]
    end

    test "batched_run with a batch size", config do
      start_supervised!(
        {Nx.Serving, name: config.test, serving: serving(), batch_size: 4, batch_timeout: 50}
      )

      tasks =
        for i <- 1..6 do
          Task.async(fn ->
            out = Nx.Serving.batched_run(config.test, Nx.Batch.stack([Nx.tensor([i, -i])]))
            {i, Nx.to_flat_list(out)}
          end)
        end

      for {i, result} <- Task.await_many(tasks) do
        assert result == [[2 * i + 1, -2 * i + 1]] |> List.flatten()
      end
    end

    test "partitions: true runs each partition on its own stream", config do
      serving = Nx.Serving.new(Gated, self(), compiler: Emily.Compiler, max_concurrency: 2)

      start_supervised!(
        {Nx.Serving,
         name: config.test, serving: serving, batch_size: 2, partitions: true, batch_timeout: 10}
      )

      run = fn values ->
        Task.async(fn ->
          Nx.Serving.batched_run(config.test, Nx.Batch.concatenate([Nx.tensor(values)]))
        end)
      end

      t1 = run.([1, 2])
      assert_receive {:batch, p1, executor1}, 5000
      t2 = run.([3, 4])
      assert_receive {:batch, p2, executor2}, 5000
      assert Enum.sort([p1, p2]) == [0, 1]

      # Both batches are in flight at once, on two partitions.
      send(executor1, :go)
      send(executor2, :go)
      out1 = Task.await(t1)
      out2 = Task.await(t2)
      assert Nx.to_flat_list(out1) == [3, 6]
      assert Nx.to_flat_list(out2) == [9, 12]
      assert out1.data.stream != out2.data.stream
    end

    test "streaming with hooks, on the evaluator path and on the native path" do
      for native <- [false, true] do
        serving =
          Nx.Serving.jit(&staged/1, compiler: Emily.Compiler, native: native)
          |> Nx.Serving.streaming(hooks: [:double, :plus_ten])

        batch = Nx.Batch.stack([Nx.tensor([1, 2, 3]), Nx.tensor([4, 5, 6])])

        assert [{:double, d}, {:plus_ten, p}, {:batch, b, :server_info}] =
                 serving |> Nx.Serving.run(batch) |> Enum.to_list()

        assert Nx.to_flat_list(d) == [2, 4, 6, 8, 10, 12]
        assert Nx.to_flat_list(p) == [12, 14, 16, 18, 20, 22]
        assert Nx.to_flat_list(b) == [6.0, 7.0, 8.0, 9.0, 10.0, 11.0]
      end
    end

    test "batched_run streaming", config do
      serving =
        Nx.Serving.jit(&staged/1, compiler: Emily.Compiler)
        |> Nx.Serving.streaming(hooks: [:double])

      start_supervised!({Nx.Serving, name: config.test, serving: serving, batch_size: 2})
      stream = Nx.Serving.batched_run(config.test, Nx.Batch.stack([Nx.tensor([1, 2])]))

      assert [{:double, d}, {:batch, b, :server_info}] = Enum.to_list(stream)
      assert Nx.to_flat_list(d) == [2, 4]
      assert Nx.to_flat_list(b) == [6.0, 7.0]
    end
  end
else
  defmodule Emily.Nx.ServingTest do
    use ExUnit.Case, async: true
    @moduletag :nx
    require Emily.NxAbsent
    Emily.NxAbsent.placeholders()
  end
end
