# Nx.Serving across BEAM nodes: peers on loopback serve a defn model on Emily (default
# backend and compiler on every node); this VM runs it with {:distributed, name}.
if Code.ensure_loaded?(Nx) do
  defmodule Emily.Distributed.ServingTest do
    use ExUnit.Case, async: false
    @moduletag :nx
    @moduletag :distributed
    @moduletag timeout: 180_000

    alias Emily.Distributed.Serving, as: DS
    alias Emily.Peer.NxRemote

    setup_all do
      peer = Emily.Peer.start!(:serving)
      {:ok, _} = Emily.Peer.call(peer, NxRemote, :start_serving, [:jit, :emily_mlp])
      {:ok, _} = Emily.Peer.call(peer, NxRemote, :start_serving, [:streaming, :emily_stream])
      on_exit(fn -> Emily.Peer.stop(peer) end)
      {:ok, peer: peer}
    end

    # Emily as this process's backend (the peers make it their nodes' global default).
    setup do
      Nx.default_backend(Emily.Backend)
      :ok
    end

    # The model's values on Nx.BinaryBackend through the evaluator: the oracle.
    defp expected(x) do
      x = Nx.backend_copy(x, Nx.BinaryBackend)
      Nx.Defn.jit(&NxRemote.mlp/1, compiler: Nx.Defn.Evaluator).(x)
    end

    defp input(i),
      do: Nx.tensor([[i / 4, -i / 3, 1.0, i * 0.1]], type: :f32, backend: Emily.Backend)

    defp assert_close(got, want) do
      assert Nx.shape(got) == Nx.shape(want)
      assert Nx.to_number(Nx.all_close(got, want, atol: 1.0e-5, rtol: 1.0e-5)) == 1
    end

    test "batched_run({:distributed, name}) runs on the other node and returns values" do
      tasks =
        for i <- 1..6 do
          Task.async(fn ->
            x = input(i)
            assert %Emily.Backend{} = x.data
            batch = Nx.Batch.concatenate([x])
            {x, Nx.Serving.batched_run({:distributed, :emily_mlp}, batch, &DS.values/1)}
          end)
        end

      for {x, out} <- Task.await_many(tasks, 60_000) do
        assert %Nx.BinaryBackend{} = out.data
        assert_close(out, expected(x))
        # Back on Emily, the value computes on here.
        local = Nx.backend_transfer(out, Emily.Backend)
        assert_close(Nx.multiply(local, 2), Nx.multiply(expected(x), 2))
      end
    end

    test "streaming a serving across nodes, hooks included" do
      x = Nx.concatenate([input(1), input(2)])
      batch = Nx.Batch.concatenate([x])
      stream = Nx.Serving.batched_run({:distributed, :emily_stream}, batch, &DS.values/1)

      assert [{:hidden, hidden}, {:batch, out, _}] = Enum.to_list(stream)
      assert %Nx.BinaryBackend{} = hidden.data
      assert %Nx.BinaryBackend{} = out.data
      assert_close(hidden, expected(x))
      assert_close(out, Nx.multiply(expected(x), 2))
    end

    test "partitions: true: two batches in flight on two partitions of the other node" do
      peer = Emily.Peer.start!(:partitions)
      {:ok, _} = Emily.Peer.call(peer, NxRemote, :start_serving, [:gated, :emily_gated, self()])

      run = fn batch ->
        Task.async(fn ->
          Nx.Serving.batched_run({:distributed, :emily_gated}, batch, &DS.values/1)
        end)
      end

      t1 = run.(Nx.Batch.concatenate([input(1)]))
      assert_receive {:batch, node, p1, executor1}, 30_000
      t2 = run.(Nx.Batch.concatenate([input(2)]))
      assert_receive {:batch, ^node, p2, executor2}, 30_000
      assert node == elem(peer, 1)
      assert Enum.sort([p1, p2]) == [0, 1]

      send(executor1, :go)
      send(executor2, :go)
      assert_close(Task.await(t1, 30_000), expected(input(1)))
      assert_close(Task.await(t2, 30_000), expected(input(2)))
      Emily.Peer.stop(peer)
    end

    test "an Emily tensor sent without values/1 fails the call with the named error" do
      batch = Nx.Batch.concatenate([input(1)])
      {reason, _} = catch_exit(Nx.Serving.batched_run({:distributed, :emily_mlp}, batch))
      assert {%ArgumentError{message: msg}, _stack} = reason
      assert msg =~ "not an Emily tensor or stream of this VM"

      # The serving survives (a failed batch does not take it down) and serves values.
      out = Nx.Serving.batched_run({:distributed, :emily_mlp}, batch, &DS.values/1)
      assert_close(out, expected(input(1)))
    end

    test "a node killed mid-batch ends the call with an exit; a live node serves on" do
      # Two nodes serve :emily_kill; a batch waits on one of them, which is then killed.
      a = Emily.Peer.start!(:kill_a)
      b = Emily.Peer.start!(:kill_b)

      for peer <- [a, b] do
        {:ok, _} = Emily.Peer.call(peer, NxRemote, :start_serving, [:gated, :emily_kill, self()])
      end

      wait_members(:emily_kill, 2)

      caller =
        Task.async(fn ->
          catch_exit(
            Nx.Serving.batched_run(
              {:distributed, :emily_kill},
              Nx.Batch.concatenate([input(3)]),
              &DS.values/1
            )
          )
        end)

      assert_receive {:batch, victim, _partition, _executor}, 30_000
      {victim_peer, survivor} = if victim == elem(a, 1), do: {a, b}, else: {b, a}
      started = System.monotonic_time(:millisecond)
      Emily.Peer.kill!(elem(victim_peer, 1))

      # The caller's monitor on the remote request fires with the node's loss.
      assert {reason, {Nx.Serving, :distributed_batched_run, _}} = Task.await(caller, 15_000)
      assert reason == :noconnection
      assert System.monotonic_time(:millisecond) - started < 15_000

      # The dead node left :pg; the survivor takes the next request.
      wait_members(:emily_kill, 1)

      again =
        Task.async(fn ->
          Nx.Serving.batched_run(
            {:distributed, :emily_kill},
            Nx.Batch.concatenate([input(4)]),
            &DS.values/1
          )
        end)

      assert_receive {:batch, node, _, executor}, 30_000
      assert node == elem(survivor, 1)
      send(executor, :go)
      assert_close(Task.await(again, 30_000), expected(input(4)))
      Emily.Peer.stop(survivor)
    end

    defp wait_members(name, n, tries \\ 200) do
      # One member per partition: count the nodes.
      members = :pg.get_members(Nx.Serving.PG, name)
      nodes = members |> Enum.map(&node/1) |> Enum.uniq()

      cond do
        length(nodes) == n -> :ok
        tries == 0 -> flunk("expected #{n} members of #{name}, got #{inspect(members)}")
        true -> Process.sleep(50) && wait_members(name, n, tries - 1)
      end
    end
  end
end
