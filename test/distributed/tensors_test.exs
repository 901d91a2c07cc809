defmodule Emily.Distributed.TensorsTest do
  # Tensors between nodes: a handle is a NIF resource, meaningful only in the VM that
  # made it. A handle that reaches another node (a message, :erpc) must be refused with an
  # ArgumentError that says why, never crash; values travel through Nx.serialize/1.
  use ExUnit.Case, async: false
  @moduletag :distributed
  @moduletag timeout: 120_000

  @dead ~r/not an Emily tensor or stream of this VM.*Nx.serialize/s

  setup_all do
    peer = Emily.Peer.start!(:tensors)
    on_exit(fn -> Emily.Peer.stop(peer) end)
    {:ok, peer: peer}
  end

  describe "Emily handles" do
    test "a tensor made on another node raises a named ArgumentError here", %{peer: peer} do
      remote = Emily.Peer.call(peer, Emily, :from_list, [[1.0, 2.0], {:f, 32}])
      assert is_reference(remote) and node(remote) != node()

      assert_raise ArgumentError, @dead, fn -> Emily.to_binary(remote) end
      assert_raise ArgumentError, @dead, fn -> Emily.eval(remote) end
      assert_raise ArgumentError, @dead, fn -> Emily.shape(remote) end
      assert_raise ArgumentError, @dead, fn -> Emily.release(remote) end
      assert_raise ArgumentError, @dead, fn -> Emily.async_eval(remote) end

      local = Emily.from_list([3.0], {:f, 32})
      s = Emily.Stream.current()
      assert_raise ArgumentError, @dead, fn -> Emily.Native.add(s, local, remote) end
      assert_raise ArgumentError, @dead, fn -> Emily.Native.concatenate(s, [local, remote], 0) end

      # The stream handle of the other node is refused the same way.
      remote_stream = Emily.Peer.call(peer, Emily.Stream, :default, [:cpu])
      assert_raise ArgumentError, @dead, fn -> Emily.Native.add(remote_stream, local, local) end

      assert_raise ArgumentError, @dead, fn ->
        Emily.Native.from_binary(remote_stream, <<0::32>>, {1}, {:f, 32})
      end

      # Nothing broke: this VM's tensors and streams work on.
      assert Emily.to_list(Emily.Native.add(s, local, local)) == [6.0]
    end

    test "a tensor of this node used on another raises there, not a crash", %{peer: peer} do
      local = Emily.from_list([1.0, 2.0], {:f, 32})

      assert {:exception, %ArgumentError{message: msg}, _} =
               catch_error(Emily.Peer.call(peer, Emily, :to_binary, [local]))

      assert msg =~ @dead
      # The peer is alive and its own tensors work.
      assert Emily.Peer.call(peer, Emily.Peer, :from_to_list, [[5], {:s, 32}]) == [5]

      # A handle that went to another node and came back is dead in its own VM too: the
      # BEAM sends a resource as a plain reference, and it comes back as one.
      t = Emily.Peer.call(peer, Emily, :from_list, [[5], {:s, 32}])

      assert {:exception, %ArgumentError{message: msg}, _} =
               catch_error(Emily.Peer.call(peer, Emily, :to_list, [t]))

      assert msg =~ @dead
    end

    test "any other term in a tensor argument is refused with its value" do
      assert_raise ArgumentError, ~r/expected an Emily tensor or stream handle, got: oops/, fn ->
        Emily.to_binary(:oops)
      end
    end
  end

  if Code.ensure_loaded?(Nx) do
    describe "Nx tensors on Emily.Backend" do
      @describetag :nx

      test "Nx.serialize and Nx.deserialize carry values across nodes", %{peer: peer} do
        Nx.default_backend(Emily.Backend)

        for {list, type} <- [
              {[1.5, -2.0, 3.25], {:f, 32}},
              {[1.5, -2.0, 3.25], {:bf, 16}},
              {[0.5, 1.0e4], {:f, 16}},
              {[1, 255, 0], {:u, 8}},
              {[-7, 1_099_511_627_776], {:s, 64}}
            ] do
          t = Nx.tensor(list, type: type, backend: Emily.Backend)
          bin = Nx.serialize(%{x: t, pair: {t, Nx.multiply(t, 2)}})

          # There and back: the peer deserializes onto its own Emily.Backend, computes,
          # and serializes the result.
          {:ok, got} = Emily.Peer.call(peer, Emily.Peer.NxRemote, :double, [bin])
          back = Nx.deserialize(got)

          assert %Emily.Backend{} = back.x.data
          assert Nx.to_list(back.x) == Nx.to_list(Nx.multiply(t, 2))
          assert Nx.to_list(elem(back.pair, 1)) == Nx.to_list(Nx.multiply(t, 4))
          assert Nx.type(back.x) == type
        end
      end

      test "an Nx tensor made on another node raises a named ArgumentError", %{peer: peer} do
        remote = Emily.Peer.call(peer, Nx, :tensor, [[1.0, 2.0], [backend: Emily.Backend]])
        assert %Emily.Backend{} = remote.data

        assert_raise ArgumentError, @dead, fn -> Nx.add(remote, 1) end
        assert_raise ArgumentError, @dead, fn -> Nx.to_binary(remote) end
        # Inspect reports the error in its output rather than raising it.
        assert inspect(remote) =~ "not an Emily tensor or stream of this VM"
        assert_raise ArgumentError, @dead, fn -> Nx.backend_copy(remote, Nx.BinaryBackend) end

        # Copied to Nx.BinaryBackend on its own node first, it arrives as a value.
        copy = Emily.Peer.call(peer, Emily.Peer.NxRemote, :binary_copy, [[1.0, 2.0]])
        assert %Nx.BinaryBackend{} = copy.data

        assert Nx.to_list(Nx.add(Nx.backend_transfer(copy, Emily.Backend), 1)) == [2.0, 3.0]
      end

      test ":erlang.term_to_binary keeps a live handle only within this VM", %{peer: peer} do
        t = Nx.tensor([1.0, 2.0], backend: Emily.Backend)
        bin = :erlang.term_to_binary(t)
        # Read back by the VM that wrote it, while the tensor lives, it is the same tensor.
        assert Nx.to_list(:erlang.binary_to_term(bin)) == [1.0, 2.0]
        # Another VM gets a dead reference: the peer's own Nx raises the named error.
        assert {:ok, {:error, %ArgumentError{message: msg}}} =
                 Emily.Peer.call(peer, Emily.Peer.NxRemote, :read_term, [bin])

        assert msg =~ @dead
      end
    end
  end
end
