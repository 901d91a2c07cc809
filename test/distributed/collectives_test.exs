defmodule Emily.Distributed.CollectivesTest do
  # Emily.Distributed over MLX's ring backend: ranks are OS processes (peer VMs driven
  # over their stdio, and this VM) on loopback. Collectives run through Emily.Native
  # (no Nx needed); the failure cases check that a rank that dies, hangs or never joins
  # costs the others an Emily.Error within the stated timeout, never a hang.
  use ExUnit.Case, async: false
  @moduletag :distributed
  @moduletag timeout: 240_000

  alias Emily.Peer.Rank

  # Loopback ports nobody listens on now.
  defp hosts(n) do
    for _ <- 1..n do
      {:ok, sock} = :gen_tcp.listen(0, ip: {127, 0, 0, 1}, reuseaddr: true)
      {:ok, port} = :inet.port(sock)
      {sock, "127.0.0.1:#{port}"}
    end
    |> Enum.map(fn {sock, h} ->
      :gen_tcp.close(sock)
      h
    end)
  end

  defp peers(n), do: for(_ <- 1..n, do: Emily.Peer.start!(:rank, connection: :standard_io))

  # Every rank joins at once (each join waits for all the others).
  defp join_all(ranks, hosts, opts \\ []) do
    ranks
    |> Enum.with_index()
    |> Enum.map(fn {peer, rank} ->
      Task.async(fn -> call(peer, :join, [[rank: rank, hosts: hosts] ++ opts]) end)
    end)
    |> Task.await_many(90_000)
  end

  defp call(peer, f, args), do: Emily.Peer.call(peer, Rank, f, args, 90_000)

  defp on_all(ranks, fun) do
    ranks
    |> Enum.with_index()
    |> Enum.map(fn {peer, rank} -> Task.async(fn -> fun.(peer, rank) end) end)
    |> Task.await_many(90_000)
  end

  test "the ring backend is in this libmlx" do
    assert Emily.Distributed.available?(:ring)
  end

  test "a group of one needs no backend: reductions and gather are the identity" do
    group = Emily.Distributed.init(rank: 0, size: 1)
    assert %Emily.Distributed.Group{id: 0, size: 1} = group
    s = Emily.Stream.current()
    x = Emily.from_list([1.0, -2.0], {:f, 32})
    assert Emily.to_list(Emily.Native.all_sum(s, x, 0)) == [1.0, -2.0]
    assert Emily.to_list(Emily.Native.all_gather(s, x, 0)) == [1.0, -2.0]

    assert_raise Emily.Error, ~r/group of one has no other rank/, fn ->
      Emily.eval(Emily.Native.send(s, x, 1, 0))
    end
  end

  test "bad options are refused before any join" do
    assert_raise ArgumentError, ~r/:rank in 0..1/, fn ->
      Emily.Distributed.init(rank: 2, hosts: ["127.0.0.1:1", "127.0.0.1:2"])
    end

    assert_raise ArgumentError, ~r/"ip:port"/, fn ->
      Emily.Distributed.init(rank: 0, hosts: ["nope", "x:y"])
    end

    assert_raise ArgumentError, ~r/:backend/, fn ->
      Emily.Distributed.init(rank: 0, size: 2, backend: :tcp)
    end

    s = Emily.Stream.current()
    x = Emily.from_list([1.0], {:f, 32})

    assert_raise Emily.Error, ~r/unknown group/, fn ->
      Emily.eval(Emily.Native.all_sum(s, x, 987_654))
    end
  end

  for n <- [2, 4] do
    test "#{n} ranks: all_sum, all_max, all_gather, send and recv" do
      n = unquote(n)
      ranks = peers(n)
      assert join_all(ranks, hosts(n)) == for(r <- 0..(n - 1), do: {:ok, r})

      sums =
        on_all(ranks, fn peer, r ->
          call(peer, :collective, [:all_sum, [r * 1.0, 1.0, r * r * 0.5]])
        end)

      want = [Enum.sum(0..(n - 1)) * 1.0, n * 1.0, Enum.sum(for r <- 0..(n - 1), do: r * r * 0.5)]
      assert Enum.uniq(sums) == [{:ok, want}]

      maxes =
        on_all(ranks, fn peer, r -> call(peer, :collective, [:all_max, [r * 1.0, -r * 1.0]]) end)

      assert Enum.uniq(maxes) == [{:ok, [(n - 1) * 1.0, 0.0]}]

      gathered =
        on_all(ranks, fn peer, r ->
          call(peer, :collective, [:all_gather, [r * 10.0, r + 0.5]])
        end)

      assert Enum.uniq(gathered) == [{:ok, Enum.flat_map(0..(n - 1), &[&1 * 10.0, &1 + 0.5])}]

      # Around the ring: each rank sends to its right neighbour, receives from its left.
      passed =
        on_all(ranks, fn peer, r ->
          call(peer, :exchange, [[r * 1.0, 100.0 + r], rem(r + 1, n), rem(r + n - 1, n), 2])
        end)

      assert passed ==
               for(
                 r <- 0..(n - 1),
                 do: {:ok, [rem(r + n - 1, n) * 1.0, 100.0 + rem(r + n - 1, n)]}
               )
    end

    test "#{n} ranks: a data-parallel step gives the whole batch's parameters" do
      n = unquote(n)
      # A seeded synthetic regression problem, 16 rows, split into n shards.
      :rand.seed(:exsss, {7, 11, 13})
      rows = for _ <- 1..16, do: for(_ <- 1..3, do: :rand.uniform() - 0.5)
      targets = for r <- rows, do: [Enum.sum(r) + 0.1, hd(r) * 2]
      w0 = [[0.1, 0.0], [0.0, 0.1], [0.2, -0.1]]

      {:ok, whole} = Rank.linear_steps(rows, targets, w0, 16, 5, 0.5, nil)

      ranks = peers(n)
      assert Enum.all?(join_all(ranks, hosts(n)), &match?({:ok, _}, &1))
      per = div(16, n)

      results =
        on_all(ranks, fn peer, r ->
          x = Enum.slice(rows, r * per, per)
          y = Enum.slice(targets, r * per, per)
          call(peer, :linear_steps, [x, y, w0, 16, 5, 0.5, :group])
        end)

      for {:ok, w} <- results, do: assert_close(w, whole)
      assert length(for {:ok, _} <- results, do: 1) == n
    end
  end

  test "a collective's stream: the caller's where it is on the backend's device, else that device's default" do
    own = Emily.Stream.new(:cpu)
    ring = %Emily.Distributed.Group{id: 1, rank: 0, size: 2, backend: :ring}
    one = %Emily.Distributed.Group{id: 0, rank: 0, size: 1}
    assert Emily.Distributed.device(ring) == :cpu
    assert Emily.Distributed.device(%{ring | backend: :nccl}) == :gpu
    assert Emily.Distributed.device(one) == nil
    assert Emily.Distributed.stream(ring, own) == own
    assert Emily.Distributed.stream(one, own) == own
    assert Emily.Stream.with_stream(own, fn -> Emily.Distributed.stream(ring) end) == own

    if :gpu in Emily.devices() do
      gpu = Emily.Stream.default(:gpu)
      assert Emily.Distributed.stream(ring, gpu) == Emily.Stream.default(:cpu)
      assert Emily.Distributed.stream(%{ring | backend: :nccl}, own) == gpu
      assert Emily.Distributed.stream(one, gpu) == gpu
    end

    Emily.Stream.release(own)
  end

  test "2 ranks: from another current stream, a collective hands its result back to it" do
    ranks = peers(2)
    assert join_all(ranks, hosts(2)) == [{:ok, 0}, {:ok, 1}]

    # The current stream is a CPU stream of the rank's own: the collective runs on it.
    got =
      on_all(ranks, fn peer, r ->
        call(peer, :collective_from, [:own, :all_sum, [r + 1.0, 2.0], :group])
      end)

    assert [{:ok, {[3.0, 4.0], s0, s0}}, {:ok, {[3.0, 4.0], s1, s1}}] = got

    # On another worker than its input's and its consumer's (the path a GPU machine's
    # default stream takes): the lazy input is evaluated on its own stream, the result
    # is read by an op of the current stream.
    got =
      on_all(ranks, fn peer, r ->
        call(peer, :collective_from, [:own, :all_gather, [r * 1.0, 5.0], :cpu])
      end)

    for result <- got do
      assert {:ok, {[+0.0, 5.0, 1.0, 5.0], on, current}} = result
      assert on != current
    end

    # The group goes on from the default stream.
    assert on_all(ranks, fn peer, r -> call(peer, :collective, [:all_max, [r * 1.0]]) end) ==
             [{:ok, [1.0]}, {:ok, [1.0]}]
  end

  @tag :gpu
  test "2 ranks from the GPU stream: a ring collective runs on the CPU; on a GPU stream Emily.Native refuses it" do
    ranks = peers(2)
    assert join_all(ranks, hosts(2)) == [{:ok, 0}, {:ok, 1}]

    got =
      on_all(ranks, fn peer, r ->
        call(peer, :collective_from, [:gpu, :all_sum, [r + 1.0], :group])
      end)

    for result <- got do
      assert {:ok, {[3.0], on, current}} = result
      assert on =~ "cpu" and current =~ "gpu"
    end

    # Refused as the graph is built, on every rank: nothing is queued, the VM and the
    # group go on.
    refused =
      on_all(ranks, fn peer, _ ->
        call(peer, :collective_from, [:gpu, :all_sum, [1.0], :current])
      end)

    for result <- refused do
      assert {:error, %Emily.Error{message: msg}} = result
      assert msg =~ "the ring backend runs on the CPU stream only"
    end

    assert Enum.all?(ranks, &call(&1, :stream_works?, []))

    assert on_all(ranks, fn peer, r -> call(peer, :collective, [:all_sum, [r * 1.0]]) end) ==
             [{:ok, [1.0]}, {:ok, [1.0]}]
  end

  describe "failure" do
    test "a rank that never joins: init raises Emily.Error within the join timeout" do
      started = System.monotonic_time(:millisecond)

      assert_raise Emily.Error, ~r/not every rank joined within 1500 ms/, fn ->
        Emily.Distributed.init(rank: 0, hosts: hosts(2), join_timeout: 1500)
      end

      assert System.monotonic_time(:millisecond) - started < 5_000
      assert Rank.stream_works?()
    end

    test "a rank that dies mid-collective: the other's collective fails at once" do
      [a, b] = peers(2)
      assert join_all([a, b], hosts(2), timeout: 60_000) == [{:ok, 0}, {:ok, 1}]
      assert {:ok, [3.0]} = collective_pair(a, b, [1.0], [2.0])

      # Rank 0 waits in all_sum; rank 1 dies without taking part.
      waiting = Task.async(fn -> call(a, :collective, [:all_sum, [1.0]]) end)
      Process.sleep(300)
      os_pid = call(b, :os_pid, [])
      started = System.monotonic_time(:millisecond)
      {_, 0} = System.cmd("kill", ["-9", Integer.to_string(os_pid)])

      assert {:error, %Emily.Error{}} = Task.await(waiting, 20_000)
      assert System.monotonic_time(:millisecond) - started < 10_000
      assert call(a, :stream_works?, [])

      # The group is closed: the next collective fails at once.
      assert {:error, %Emily.Error{message: msg}} = call(a, :collective, [:all_sum, [1.0]])
      assert msg =~ "the group is closed"
    end

    test "a rank that hangs: the collective fails at the group's timeout, on every rank" do
      [a, b] = peers(2)
      assert join_all([a, b], hosts(2), timeout: 1500) == [{:ok, 0}, {:ok, 1}]

      # Rank 1 is alive but does not take part.
      started = System.monotonic_time(:millisecond)
      assert {:error, %Emily.Error{}} = call(a, :collective, [:all_sum, [1.0, 2.0]])
      elapsed = System.monotonic_time(:millisecond) - started
      assert elapsed >= 1400 and elapsed < 10_000
      assert call(a, :stream_works?, [])

      # Its sockets are shut down: rank 1's own collective fails too, and both stay up.
      assert {:error, %Emily.Error{}} = call(b, :collective, [:all_sum, [1.0, 2.0]])
      assert call(b, :stream_works?, [])
      assert {:error, %Emily.Error{message: msg}} = call(a, :collective, [:all_sum, [1.0]])
      assert msg =~ "the group is closed"
    end
  end

  defp collective_pair(a, b, mine, theirs) do
    other = Task.async(fn -> call(b, :collective, [:all_sum, theirs]) end)
    here = call(a, :collective, [:all_sum, mine])
    ^here = Task.await(other, 30_000)
    here
  end

  defp assert_close(got, want) do
    for {g, w} <- Enum.zip(got, want), do: assert(abs(g - w) <= 1.0e-5 + 1.0e-5 * abs(w))
  end
end
