# Emily.Distributed's Nx-level collectives: Nx.blocks that work eagerly and inside defn
# (Emily.Compiler), the identity for a group of one on any backend, and a data-parallel
# training step of a defn MLP across ranks (peer VMs over their stdio, on loopback).
if Code.ensure_loaded?(Nx) do
  defmodule Emily.Distributed.NxCollectivesTest do
    use ExUnit.Case, async: false
    @moduletag :nx
    @moduletag :distributed
    @moduletag timeout: 240_000

    alias Emily.Distributed, as: D
    alias Emily.Peer.NxRemote

    defp hosts(n) do
      socks =
        for _ <- 1..n do
          {:ok, sock} = :gen_tcp.listen(0, ip: {127, 0, 0, 1}, reuseaddr: true)
          sock
        end

      hosts = for sock <- socks, do: "127.0.0.1:#{elem(:inet.port(sock), 1)}"
      Enum.each(socks, &:gen_tcp.close/1)
      hosts
    end

    test "a group of one: every collective is the identity, on every backend and compiler" do
      group = D.init(rank: 0, size: 1)
      x = Nx.tensor([[1.5, -2.0], [3.0, 4.0]])

      for backend <- [Emily.Backend, Nx.BinaryBackend] do
        t = Nx.backend_copy(x, backend)
        assert Nx.to_list(D.all_sum(t, group)) == Nx.to_list(x)
        assert Nx.to_list(D.all_max(t, group)) == Nx.to_list(x)
        assert Nx.shape(D.all_gather(t, group)) == {2, 2}
      end

      fun = fn t -> t |> Nx.multiply(2) |> D.all_sum(group) |> Nx.add(1) end

      for compiler <- [Emily.Compiler, Nx.Defn.Evaluator], native <- [true, false] do
        t =
          Nx.backend_copy(
            x,
            if(compiler == Emily.Compiler, do: Emily.Backend, else: Nx.BinaryBackend)
          )

        got = Nx.Defn.jit(fun, compiler: compiler, native: native).(t)
        assert Nx.to_list(got) == [[4.0, -3.0], [7.0, 9.0]]
      end

      assert_raise ArgumentError, ~r/another rank/, fn -> D.send(x, 0, group) end
    end

    test "traced by Nx.Defn.Expr, a collective keeps the output's shape and type" do
      group = %D.Group{id: 123, rank: 0, size: 2}
      x = Nx.tensor([1.0, 2.0])
      expr = Nx.Defn.debug_expr(fn t -> {D.all_sum(t, group), D.all_gather(t, group)} end).(x)
      assert {%Nx.Tensor{shape: {2}}, %Nx.Tensor{shape: {4}}} = expr
    end

    test "2 ranks: from another current stream (a GPU machine's default stream where there is one), eagerly and in defn" do
      :rand.seed(:exsss, {2, 4, 6})
      rows = for _ <- 1..4, do: for(_ <- 1..3, do: :rand.uniform() - 0.5)
      targets = for [a, b, c] <- rows, do: [a + c, b - 0.1]
      {:ok, whole} = NxRemote.dp_train(rows, targets, 4, 3, 0.5, D.init(rank: 0, size: 1))

      ranks = for _ <- 1..2, do: Emily.Peer.start!(:nx_rank, connection: :standard_io)
      hosts = hosts(2)

      joined =
        ranks
        |> Enum.with_index()
        |> Enum.map(fn {peer, r} ->
          Task.async(fn ->
            Emily.Peer.call(peer, Emily.Peer.Rank, :join, [[rank: r, hosts: hosts]])
          end)
        end)
        |> Task.await_many(90_000)

      assert joined == [{:ok, 0}, {:ok, 1}]
      streams = if :gpu in Emily.devices(), do: [:own, :gpu], else: [:own]

      jits = [
        [compiler: Emily.Compiler],
        [compiler: Emily.Compiler, native: false],
        [compiler: Nx.Defn.Evaluator]
      ]

      for stream <- streams, jit <- jits do
        results =
          ranks
          |> Enum.with_index()
          |> Enum.map(fn {peer, r} ->
            args = [Enum.slice(rows, r * 2, 2), Enum.slice(targets, r * 2, 2), 4, 3, 0.5, :group]
            opts = [stream: stream, jit: jit]

            Task.async(fn ->
              Emily.Peer.call(peer, NxRemote, :dp_train, args ++ [opts], 120_000)
            end)
          end)
          |> Task.await_many(120_000)

        for result <- results do
          assert {:ok, params} = result, "#{inspect(stream)} #{inspect(jit)}: #{inspect(result)}"

          for {got, want} <- Enum.zip(params, whole), {g, w} <- Enum.zip(got, want) do
            assert abs(g - w) <= 1.0e-5 + 1.0e-5 * abs(w), "#{inspect(jit)}: #{g} vs #{w}"
          end
        end
      end
    end

    for n <- [2, 4] do
      test "#{n} ranks: a data-parallel defn step gives the whole batch's parameters" do
        n = unquote(n)
        :rand.seed(:exsss, {3, 5, 8})
        rows = for _ <- 1..8, do: for(_ <- 1..3, do: :rand.uniform() - 0.5)
        targets = for [a, b, c] <- rows, do: [a - b + 0.2, c * 1.5]

        {:ok, whole} = NxRemote.dp_train(rows, targets, 8, 4, 0.5, D.init(rank: 0, size: 1))

        ranks = for _ <- 1..n, do: Emily.Peer.start!(:nx_rank, connection: :standard_io)
        hosts = hosts(n)

        joined =
          ranks
          |> Enum.with_index()
          |> Enum.map(fn {peer, r} ->
            Task.async(fn ->
              Emily.Peer.call(peer, Emily.Peer.Rank, :join, [[rank: r, hosts: hosts]])
            end)
          end)
          |> Task.await_many(90_000)

        assert joined == for(r <- 0..(n - 1), do: {:ok, r})
        per = div(8, n)

        results =
          ranks
          |> Enum.with_index()
          |> Enum.map(fn {peer, r} ->
            x = Enum.slice(rows, r * per, per)
            y = Enum.slice(targets, r * per, per)

            Task.async(fn ->
              Emily.Peer.call(peer, NxRemote, :dp_train, [x, y, 8, 4, 0.5, :group], 120_000)
            end)
          end)
          |> Task.await_many(120_000)

        for result <- results do
          assert {:ok, params} = result

          for {got, want} <- Enum.zip(params, whole), {g, w} <- Enum.zip(got, want) do
            assert abs(g - w) <= 1.0e-5 + 1.0e-5 * abs(w), "#{g} vs #{w}"
          end
        end

        # The step moved the parameters (the comparison is not of untouched values).
        {:ok, start} = NxRemote.dp_train(rows, targets, 8, 0, 0.5, D.init(rank: 0, size: 1))
        assert start != whole
      end
    end
  end
end
