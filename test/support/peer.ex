defmodule Emily.Peer do
  @moduledoc false
  # Peer nodes on loopback for the multi-node suites (OTP's :peer), each with the test
  # VM's code path and Emily started.
  #
  # Distributed Erlang needs epmd: `ensure_distributed!/0` starts it (`epmd -daemon` is a
  # no-op when one runs) and makes the test VM a node named on 127.0.0.1, so nothing
  # outside loopback is needed. Peers that only run collectives (Emily.Distributed) need
  # no distribution at all: `start!/2` with `connection: :standard_io` drives them over
  # their stdio.

  @doc "Makes the test VM a distributed node on 127.0.0.1 (once)."
  def ensure_distributed! do
    unless Node.alive?() do
      epmd = System.find_executable("epmd") || raise "epmd not found: distributed Erlang needs it"
      {_, 0} = System.cmd(epmd, ["-daemon"])
      name = :"emily_test_#{System.unique_integer([:positive])}@127.0.0.1"

      case :net_kernel.start([name, :longnames]) do
        {:ok, _} -> :ok
        {:error, {:already_started, _}} -> :ok
        {:error, reason} -> raise "could not start distribution: #{inspect(reason)}"
      end
    end

    :ok
  end

  @doc """
  Starts a peer with the test VM's code path and Emily started; returns `{pid, node}`.

  Options: `:connection` (`:standard_io` for a peer that is not a distributed node; the
  node is then `nil` and `call/4` reaches it through its pid), `:env` (a list of
  `{name, value}` OS environment variables).
  """
  def start!(prefix, opts \\ []) do
    standard_io? = opts[:connection] == :standard_io
    unless standard_io?, do: ensure_distributed!()

    # The code path's ebin directories, as test/soak/exit_test.exs passes them: its "."
    # would name the working directory as an app.
    paths =
      for path <- :code.get_path(),
          Path.basename(to_string(path)) == "ebin",
          arg <- [~c"-pa", path],
          do: arg

    name = :"#{prefix}_#{System.unique_integer([:positive])}"

    # A standard_io peer has no name: a name would make it a distributed node (when this
    # VM is one), which it is not meant to be.
    spec =
      %{
        args: paths,
        env: for({k, v} <- opts[:env] || [], do: {to_charlist(k), to_charlist(v)}),
        wait_boot: 60_000
      }
      |> Map.merge(
        if standard_io?,
          do: %{connection: :standard_io},
          else: %{
            name: name,
            host: ~c"127.0.0.1",
            longnames: true,
            args: paths ++ [~c"-setcookie", Atom.to_charlist(Node.get_cookie())]
          }
      )

    {:ok, pid, node} = :peer.start(spec)
    # A peer outlives nothing: it stops with the test process that started it.
    owner = self()

    spawn(fn ->
      ref = Process.monitor(owner)

      receive do
        {:DOWN, ^ref, _, _, _} -> stop(pid)
      end
    end)

    node = if standard_io?, do: nil, else: node
    peer = {pid, node}
    {:ok, _} = call(peer, Application, :ensure_all_started, [:emily])
    peer
  end

  @doc "Calls `m.f(args)` on a peer from `start!/2`."
  def call(peer, m, f, args, timeout \\ 60_000)
  def call({pid, nil}, m, f, args, timeout), do: :peer.call(pid, m, f, args, timeout)
  def call({_pid, node}, m, f, args, timeout), do: :erpc.call(node, m, f, args, timeout)

  @doc "Stops a peer; a peer already gone is fine."
  def stop({pid, _node}), do: stop(pid)

  def stop(pid) do
    :peer.stop(pid)
  catch
    :exit, _ -> :ok
  end

  @doc "A tensor from `list` read back, in one call (for a peer to run)."
  def from_to_list(list, dtype), do: list |> Emily.from_list(dtype) |> Emily.to_list()

  @doc "The OS process id of a distributed peer node."
  def os_pid(node), do: :erpc.call(node, :os, :getpid, []) |> List.to_integer()

  @doc "Kills a distributed peer node's OS process at once (SIGKILL)."
  def kill!(node) do
    pid = os_pid(node)
    {_, 0} = System.cmd("kill", ["-9", Integer.to_string(pid)])
    :ok
  end
end

if Code.ensure_loaded?(Nx) do
  defmodule Emily.Peer.NxRemote do
    @moduledoc false
    # Code the multi-node suites run on a peer (support modules are on its code path).

    @doc "Deserializes `bin` onto Emily.Backend, doubles it, serializes the result."
    def double(bin) do
      Nx.default_backend(Emily.Backend)
      got = Nx.deserialize(bin)
      %Emily.Backend{} = got.x.data
      {x, y} = got.pair
      {:ok, Nx.serialize(%{x: Nx.multiply(got.x, 2), pair: {x, Nx.multiply(y, 2)}})}
    end

    @doc "An Emily tensor of `list`, copied to Nx.BinaryBackend on this node."
    def binary_copy(list),
      do: list |> Nx.tensor(backend: Emily.Backend) |> Nx.backend_copy(Nx.BinaryBackend)

    @doc "Emily as this node's default backend and defn compiler."
    def use_emily do
      Nx.global_default_backend(Emily.Backend)
      Nx.Defn.global_default_options(compiler: Emily.Compiler)
      :ok
    end

    import Nx.Defn

    @doc "A small MLP with fixed weights: the model the serving suites serve."
    defn mlp(x) do
      w1 = Nx.iota({4, 8}, type: :f32) |> Nx.divide(16) |> Nx.subtract(1)
      w2 = Nx.iota({8, 3}, type: :f32) |> Nx.divide(12) |> Nx.subtract(0.5)
      x |> Nx.dot(w1) |> Nx.tanh() |> Nx.dot(w2) |> Nx.add(0.25)
    end

    defn staged(x) do
      x
      |> mlp()
      |> Emily.NxHooks.named(:hidden)
      |> Nx.multiply(2)
    end

    @doc """
    Starts a serving named `name` on this node, outside the calling process (which an
    :erpc call ends): `:jit` serves `mlp/1`, `:streaming` `staged/1` streaming its
    `:hidden` hook, `:gated` a serving whose batches wait for `:go` from `pid`
    (`partitions: true`, two partitions).
    """
    def start_serving(kind, name, pid \\ nil) do
      use_emily()

      {serving, opts} =
        case kind do
          :jit ->
            {Nx.Serving.jit(&mlp/1), [batch_size: 4, batch_timeout: 20]}

          :streaming ->
            {Nx.Serving.jit(&staged/1) |> Nx.Serving.streaming(hooks: [:hidden]),
             [batch_size: 4, batch_timeout: 20]}

          :gated ->
            {Nx.Serving.new(Emily.Peer.NxRemote.Gated, pid, max_concurrency: 2),
             [batch_size: 2, batch_timeout: 10, partitions: true]}
        end

      serving = Emily.Distributed.Serving.postprocessing(serving)
      spec = {Nx.Serving, [name: name, serving: serving] ++ opts}
      {:ok, sup} = Supervisor.start_link([spec], strategy: :one_for_one)
      Process.unlink(sup)
      {:ok, sup}
    end

    defn mlp_loss(params, x, y) do
      {w1, b1, w2, b2} = params
      out = x |> Nx.dot(w1) |> Nx.add(b1) |> Nx.tanh() |> Nx.dot(w2) |> Nx.add(b2)
      # Summed over this shard's rows: the shards' sums add up to the whole batch's.
      Nx.sum(Nx.pow(out - y, 2)) / 2
    end

    defn dp_step(params, x, y, opts \\ []) do
      grads = grad(params, &mlp_loss(&1, x, y))
      {g1, c1, g2, c2} = grads
      group = opts[:group]

      {g1, c1, g2, c2} =
        {Emily.Distributed.all_sum(g1, group), Emily.Distributed.all_sum(c1, group),
         Emily.Distributed.all_sum(g2, group), Emily.Distributed.all_sum(c2, group)}

      {w1, b1, w2, b2} = params
      lr = opts[:lr]
      {w1 - lr * g1, b1 - lr * c1, w2 - lr * g2, b2 - lr * c2}
    end

    @doc """
    `steps` data-parallel steps of an MLP on rows `x`, `y` (this rank's shard of a batch
    of `n` rows), the gradients all-summed over `group` (`:group`: the one joined last
    with Emily.Peer.Rank). Returns the parameters' values.
    """
    def dp_train(x, y, n, steps, lr, group), do: dp_train(x, y, n, steps, lr, group, [])

    @doc """
    `dp_train/6` with `opts`: `:stream` (`:own`, a new CPU stream of this rank's, or
    `:gpu`, the default GPU stream: the current stream while it runs; default: none set)
    and `:jit` (Nx.Defn.jit's options; default `compiler: Emily.Compiler`).
    """
    def dp_train(x, y, n, steps, lr, group, opts) do
      case opts[:stream] do
        nil ->
          train(x, y, n, steps, lr, group, opts)

        :gpu ->
          Emily.Stream.with_stream(Emily.Stream.default(:gpu), fn ->
            train(x, y, n, steps, lr, group, opts)
          end)

        :own ->
          own = Emily.Stream.new(:cpu)

          try do
            Emily.Stream.with_stream(own, fn -> train(x, y, n, steps, lr, group, opts) end)
          after
            Emily.Stream.release(own)
          end
      end
    end

    defp train(x, y, n, steps, lr, group, opts) do
      group = if group == :group, do: Emily.Peer.Rank.group(), else: group
      x = Nx.tensor(x, type: :f32, backend: Emily.Backend)
      y = Nx.tensor(y, type: :f32, backend: Emily.Backend)

      params =
        {Nx.iota({3, 5}, type: :f32) |> Nx.divide(15) |> Nx.subtract(0.4),
         Nx.broadcast(Nx.tensor(0.05, type: :f32), {5}),
         Nx.iota({5, 2}, type: :f32) |> Nx.divide(10) |> Nx.subtract(0.3),
         Nx.tensor([0.0, 0.1], type: :f32)}

      jit = opts[:jit] || [compiler: Emily.Compiler]
      step = Nx.Defn.jit(&dp_step(&1, &2, &3, group: group, lr: lr / n), jit)
      params = Enum.reduce(1..steps//1, params, fn _, p -> step.(p, x, y) end)
      {:ok, params |> Tuple.to_list() |> Enum.map(&Nx.to_flat_list/1)}
    rescue
      e -> {:error, e}
    end

    @doc "Reads a term written by another VM and uses the tensor in it."
    def read_term(bin) do
      {:ok, {:ok, Nx.to_list(:erlang.binary_to_term(bin))}}
    rescue
      e -> {:ok, {:error, e}}
    end
  end
end

if Code.ensure_loaded?(Nx) do
  defmodule Emily.Peer.NxRemote.Gated do
    @moduledoc false
    # A serving whose batches tell `pid` they started (with their node, partition and
    # executor), then wait for `:go`: so a test can act while a batch is in flight.
    @behaviour Nx.Serving

    @impl true
    def init(_type, pid, partitions) do
      funs = Enum.map(partitions, &Nx.Defn.jit(fn x -> Emily.Peer.NxRemote.mlp(x) end, &1))
      {:ok, {funs, pid}}
    end

    @impl true
    def handle_batch(batch, partition, {funs, pid} = state) do
      fun = fn ->
        send(pid, {:batch, node(), partition, self()})

        receive do
          :go -> {Enum.fetch!(funs, partition).(batch), :done}
        end
      end

      {:execute, fun, state}
    end
  end
end
