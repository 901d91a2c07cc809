defmodule Emily.Distributed do
  @moduledoc """
  Collectives across processes, over MLX's distributed layer: `all_sum/2`,
  `all_gather/2`, `all_max/2`, `all_min/2`, `send/3` and `recv/5` of tensors between
  the ranks of a group.

  A group is a fixed set of OS processes (BEAM nodes, or any process running Emily),
  each joining with `init/1` as one rank. Which backend carries the data:

    * `:ring` (default): TCP sockets between neighbouring ranks, on the CPU. Every
      Linux and macOS libmlx has it. Each rank listens on its own `"ip:port"`.
    * `:nccl`: NVIDIA's collectives between CUDA GPUs (the CUDA libmlx only); the
      ranks meet at rank 0's `"ip:port"`.
    * `:mpi`: an MPI launch (`mpirun`), where MLX finds an MPI library at run time.

  `available?/1` says whether this libmlx has a backend.

      group =
        Emily.Distributed.init(
          rank: rank,
          hosts: ["127.0.0.1:47001", "127.0.0.1:47002"]
        )

      grads = Emily.Distributed.all_sum(grads, group)

  The rank, the world size and the hosts are given explicitly: no environment variable
  or hostfile of the user's is read. A group of one (`size: 1`) needs no backend, and
  its reductions and gather return their input.

  ## Inside defn

  The collectives are `Nx.block/4`s: they work eagerly on `Emily.Backend` and inside
  `defn` with `Emily.Compiler` (both paths), where they are nodes of the graph, so
  `all_sum(grad(...), group)` in a training step sums the gradients as part of its
  evaluation. Pass the group as an option (`defn step(params, batch, opts \\\\ [])` with
  `opts[:group]`). Their default implementation, what other backends and compilers run,
  is the identity for a group of one; for larger groups it copies its input to Emily
  and back (and refuses to be traced by another compiler).

  Every rank must run the same collectives in the same order, with the same shapes and
  types: a collective is matched by position, not by name.

  ## Streams and threads

  A collective runs on a stream of its backend's device: the CPU for `:ring` and `:mpi`,
  a GPU for `:nccl`. Called from a stream of that device (the calling process's
  current stream, see `Emily.Stream`), it runs there; from any other (the default GPU
  stream of a CUDA machine, for a ring collective), on that device's default stream,
  its input evaluated on its own stream first and its result usable on any stream,
  as Emily's CPU-only linear algebra runs. `stream/2` says which stream that is.
  `Emily.Native`'s collectives take the stream as given and refuse one of the wrong
  device with `Emily.Error`.

  A collective runs when its graph is evaluated, on that stream's MLX thread, like any
  op: a group may be used from any process and stream, and collectives of one group run
  one at a time, in the order their graphs are evaluated.

  ## Failure

  On the ring backend, every collective of a group has a deadline, the group's
  `:timeout` (default 30 s) counted from when the collective starts on its stream:

    * a rank that dies closes its sockets: the other ranks' collective fails at once;
    * a rank that stays alive but does not take part lets the others' collective run
      into the deadline; it then fails.

  Either way the collective raises `Emily.Error` (at the `Emily.eval/1`,
  `Nx.to_binary/1` or `defn` call that evaluates it), the VM and the stream go on, and
  the group is closed: its sockets are shut down, so the other ranks fail too, and any
  later collective on it raises `Emily.Error` at once. Join a new group to go on.

  `init/1` waits for every rank for `:join_timeout` (default 60 s), then raises
  `Emily.Error`. A join given up on keeps a thread of its own until MLX's own connect
  retries end (about 30 s).

  NCCL collectives have no deadline of Emily's (NCCL has its own timeouts).

  ## Tensors between nodes

  This module moves tensor data between processes. A tensor handle itself is a native
  resource, valid only in the VM that made it: one sent to another node (a message,
  `:erpc`, `Nx.Serving`) arrives as a plain reference, and Emily refuses it with an
  `ArgumentError` that says so. `:erlang.term_to_binary/1` of an Emily tensor gives a
  binary that only this VM can read back into a live tensor (while the tensor lives).
  To send values, use `Nx.serialize/2` and `Nx.deserialize/2`, or copy to
  `Nx.BinaryBackend` first (`Emily.Distributed.Serving.values/1` does it for servings).
  """

  defmodule Group do
    @moduledoc """
    A group of ranks joined by `Emily.Distributed.init/1`: its `rank` (this process's),
    `size`, `backend` and `timeout` (ms; 0: none). `id` names it to `Emily.Native`'s
    collectives (0 is the group of one).
    """
    @enforce_keys [:id, :rank, :size]
    defstruct [:id, :rank, :size, backend: nil, timeout: 0]

    @type t :: %__MODULE__{
            id: non_neg_integer,
            rank: non_neg_integer,
            size: pos_integer,
            backend: :ring | :nccl | :mpi | nil,
            timeout: non_neg_integer
          }
  end

  @backends [:ring, :nccl, :mpi]

  @doc "Whether this libmlx has `backend` (`:ring`, `:nccl`, `:mpi`)."
  @spec available?(atom) :: boolean
  def available?(backend) when backend in @backends,
    do: Emily.Native.distributed_available(Atom.to_string(backend))

  @doc """
  Joins a group and returns it, once every rank has joined.

  Options:

    * `:rank` (required) - this process's rank, `0..size - 1`.
    * `:hosts` - for `:ring`, one `"ip:port"` per rank, in rank order: where each rank
      listens (the list's length is the world size); for `:nccl`, `[coordinator]`, rank
      0's `"ip:port"`, where the ranks meet.
    * `:size` - the world size (default: the length of `:hosts`); `size: 1` is a group
      of one, with no backend.
    * `:backend` - `:ring` (default), `:nccl` or `:mpi`.
    * `:timeout` - each collective's deadline on the ring backend, in ms (default
      `30_000`; `0` for none).
    * `:join_timeout` - how long to wait for every rank, in ms (default `60_000`).

  Raises `ArgumentError` for bad options and `Emily.Error` when the join fails or not
  every rank joined in time.
  """
  @spec init(keyword) :: Group.t()
  def init(opts) do
    opts =
      Keyword.validate!(opts, [
        :rank,
        :size,
        hosts: [],
        backend: :ring,
        timeout: 30_000,
        join_timeout: 60_000
      ])

    {backend, hosts} = {opts[:backend], opts[:hosts]}
    rank = opts[:rank]

    unless backend in @backends,
      do:
        raise(
          ArgumentError,
          "expected :backend to be one of #{inspect(@backends)}, got: #{inspect(backend)}"
        )

    unless is_list(hosts) and Enum.all?(hosts, &address?/1),
      do:
        raise(
          ArgumentError,
          "expected :hosts to be a list of \"ip:port\" strings, got: #{inspect(hosts)}"
        )

    size = opts[:size] || if backend == :ring, do: length(hosts), else: nil

    unless is_integer(size) and size >= 1,
      do:
        raise(
          ArgumentError,
          "expected :size (or :hosts) to give a world size of at least 1, got: #{inspect(size)}"
        )

    unless is_integer(rank) and rank in 0..(size - 1)//1,
      do: raise(ArgumentError, "expected :rank in 0..#{size - 1}, got: #{inspect(rank)}")

    for key <- [:timeout, :join_timeout] do
      unless is_integer(opts[key]) and opts[key] >= 0,
        do:
          raise(
            ArgumentError,
            "expected #{inspect(key)} to be a number of ms, got: #{inspect(opts[key])}"
          )
    end

    if size == 1 do
      %Group{id: 0, rank: 0, size: 1}
    else
      join(backend, rank, size, hosts, opts)
    end
  end

  defp join(backend, rank, size, hosts, opts) do
    if backend == :ring and length(hosts) != size,
      do:
        raise(
          ArgumentError,
          "the ring backend needs one host per rank: #{size} ranks, #{length(hosts)} hosts"
        )

    if backend == :nccl and length(hosts) != 1,
      do:
        raise(
          ArgumentError,
          "the nccl backend needs hosts: [coordinator], got: #{inspect(hosts)}"
        )

    with_hostfile(backend, hosts, fn hostfile ->
      ref = make_ref()
      own = if backend == :ring, do: Enum.at(hosts, rank), else: ""
      coordinator = if backend == :nccl, do: hd(hosts), else: ""

      Emily.Native.distributed_init(
        ref,
        Atom.to_string(backend),
        rank,
        size,
        hostfile,
        coordinator,
        opts[:timeout],
        max(opts[:join_timeout], 1),
        own
      )

      id = Emily.await(ref)
      timeout = if backend == :ring, do: opts[:timeout], else: 0
      %Group{id: id, rank: rank, size: size, backend: backend, timeout: timeout}
    end)
  end

  # MLX's ring backend reads its hosts from a JSON file: a private one per join. The
  # folder is named by the OS process too: the ranks of a group on one machine are VMs
  # whose unique integers can coincide, and one's cleanup must not take another's file.
  defp with_hostfile(:ring, hosts, fun) do
    name = "emily-dist-#{System.pid()}-#{System.unique_integer([:positive])}"
    dir = Path.join(System.tmp_dir!(), name)
    File.mkdir!(dir)
    File.chmod!(dir, 0o700)
    path = Path.join(dir, "hosts.json")
    File.write!(path, "[" <> Enum.map_join(hosts, ",", &~s(["#{&1}"])) <> "]")

    try do
      fun.(path)
    after
      File.rm_rf(dir)
    end
  end

  defp with_hostfile(_backend, _hosts, fun), do: fun.("")

  defp address?(a) when is_binary(a) do
    case String.split(a, ":") |> Enum.reverse() do
      [port | [_ | _] = host] ->
        host != [""] and not String.contains?(a, ["\"", "\\"]) and
          match?({p, ""} when p in 1..65_535, Integer.parse(port))

      _ ->
        false
    end
  end

  defp address?(_), do: false

  @doc """
  The device `group`'s collectives run on: `:cpu` for `:ring` and `:mpi`, `:gpu` for
  `:nccl`; `nil` for a group of one, whose collectives run on any device.
  """
  @spec device(Group.t()) :: :cpu | :gpu | nil
  def device(%Group{backend: nil}), do: nil
  def device(%Group{backend: :nccl}), do: :gpu
  def device(%Group{backend: backend}) when backend in [:ring, :mpi], do: :cpu

  @doc """
  The stream a collective of `group` runs on when called from `stream` (default: the
  calling process's current stream): `stream` itself where it is on the group's
  `device/1` (or the group is one of one), else that device's default stream.
  """
  @spec stream(Group.t(), Emily.Stream.t()) :: Emily.Stream.t()
  def stream(%Group{} = group, stream \\ Emily.Stream.current()) do
    case device(group) do
      nil ->
        stream

      device ->
        if Emily.Stream.device(stream) == device, do: stream, else: Emily.Stream.default(device)
    end
  end

  @doc """
  Leaves `group`: its connections close once no pending collective holds them. A group
  of one has nothing to release. Returns `:ok`.
  """
  @spec release(Group.t()) :: :ok
  def release(%Group{id: 0}), do: :ok
  def release(%Group{id: id}), do: Emily.Native.distributed_release(id)

  # The Nx-level collectives, where Nx is loaded. (Written without struct patterns and
  # imports of Nx, which the compiler would need to expand even where Nx is absent.)
  if Code.ensure_loaded?(Nx) do
    for {name, doc} <- [
          {AllSum, "`Emily.Distributed.all_sum/2`"},
          {AllMax, "`Emily.Distributed.all_max/2`"},
          {AllMin, "`Emily.Distributed.all_min/2`"},
          {AllGather, "`Emily.Distributed.all_gather/2`"},
          {Send, "`Emily.Distributed.send/3` (`peer`: the destination)"},
          {Recv,
           "`Emily.Distributed.recv/5` (`peer`: the source; the output's `shape` and `type`)"}
        ] do
      defmodule Module.concat(__MODULE__, name) do
        @moduledoc "The `Nx.block/4` struct of #{doc}."
        defstruct [:group, :peer, :shape, :type]
      end
    end

    @native %{
      __MODULE__.AllSum => :all_sum,
      __MODULE__.AllMax => :all_max,
      __MODULE__.AllMin => :all_min,
      __MODULE__.AllGather => :all_gather,
      __MODULE__.Send => :send,
      __MODULE__.Recv => :recv
    }

    @doc false
    # The block structs, for the native compiler's dispatch.
    def blocks, do: Map.keys(@native)

    @doc """
    The sum of `tensor` over the group's ranks; every rank gets it. The same shape and
    type on every rank. Works inside `defn`.
    """
    @spec all_sum(Nx.Tensor.t() | number, Group.t()) :: Nx.Tensor.t()
    def all_sum(tensor, group), do: reduce(__MODULE__.AllSum, tensor, group)

    @doc "The elementwise maximum of `tensor` over the group's ranks. Works inside `defn`."
    @spec all_max(Nx.Tensor.t() | number, Group.t()) :: Nx.Tensor.t()
    def all_max(tensor, group), do: reduce(__MODULE__.AllMax, tensor, group)

    @doc "The elementwise minimum of `tensor` over the group's ranks. Works inside `defn`."
    @spec all_min(Nx.Tensor.t() | number, Group.t()) :: Nx.Tensor.t()
    def all_min(tensor, group), do: reduce(__MODULE__.AllMin, tensor, group)

    @doc """
    Every rank's `tensor` concatenated along the first axis, in rank order (a scalar
    counts as a vector of one). The same shape and type on every rank. Works inside
    `defn`.
    """
    @spec all_gather(Nx.Tensor.t() | number, Group.t()) :: Nx.Tensor.t()
    def all_gather(tensor, group) do
      group = group!(group)
      x = Nx.to_tensor(tensor)
      x = if Nx.shape(x) == {}, do: Nx.reshape(x, {1}), else: x
      out = Nx.template(gathered_shape(Nx.shape(x), group), Nx.type(x))
      Nx.block(struct!(__MODULE__.AllGather, group: group), [x], out, &default/2)
    end

    @doc """
    Sends `tensor` to rank `dst` and returns it: the send happens when the result is
    evaluated (inside `defn`, return it or use it, or the graph drops it). The ring
    backend sends only to a rank's two neighbours (`rank ± 1` around the ring).
    """
    @spec send(Nx.Tensor.t() | number, non_neg_integer, Group.t()) :: Nx.Tensor.t()
    def send(tensor, dst, group) do
      group = group!(group)
      check_peer!(dst, group, "send")
      x = Nx.to_tensor(tensor)
      block = struct!(__MODULE__.Send, group: group, peer: dst)
      Nx.block(block, [x], Nx.template(Nx.shape(x), Nx.type(x)), &default/2)
    end

    @doc """
    A tensor of `shape` and `type` received from rank `src` (which sends it with
    `send/3`). `like` is any tensor of the computation (its value is not used): it ties
    the receive to the graph that uses it.
    """
    @spec recv(Nx.Tensor.t(), tuple, Nx.Type.t(), non_neg_integer, Group.t()) :: Nx.Tensor.t()
    def recv(like, shape, type, src, group) do
      group = group!(group)
      check_peer!(src, group, "recv")
      out = Nx.template(shape, Nx.Type.normalize!(type))
      block = struct!(__MODULE__.Recv, group: group, peer: src, shape: out.shape, type: out.type)
      Nx.block(block, [Nx.to_tensor(like)], out, &default/2)
    end

    # What `deftransform` would define for each (a remote call inside defn goes through
    # `__defn:name__`), written out because this module also compiles without Nx.
    for {name, arity} <- [all_sum: 2, all_max: 2, all_min: 2, all_gather: 2, send: 3, recv: 5] do
      args = Macro.generate_arguments(arity, __MODULE__)
      @doc false
      def unquote(:"__defn:#{name}__")(unquote_splicing(args)),
        do: unquote(name)(unquote_splicing(args))
    end

    defp reduce(struct, tensor, group) do
      group = group!(group)
      x = Nx.to_tensor(tensor)

      Nx.block(
        struct!(struct, group: group),
        [x],
        Nx.template(Nx.shape(x), Nx.type(x)),
        &default/2
      )
    end

    defp group!(%Group{} = group), do: group

    defp group!(other),
      do: raise(ArgumentError, "expected an Emily.Distributed.Group, got: #{inspect(other)}")

    defp gathered_shape(shape, group) do
      [d | rest] = Tuple.to_list(shape)
      List.to_tuple([d * group.size | rest])
    end

    defp check_peer!(peer, %Group{size: size, rank: rank}, op) do
      unless is_integer(peer) and peer in 0..(size - 1)//1 and peer != rank do
        raise ArgumentError,
              "#{op}: expected another rank of the group (0..#{size - 1}, not #{rank}), got: #{inspect(peer)}"
      end
    end

    @doc false
    # The native op and its arguments after the stream, for Emily.Compiler's lowering:
    # `{:arg, i, type}` is the block's i-th argument cast to `type`.
    def native_call(%{__struct__: __MODULE__.Recv} = block, out, _args),
      do: {:recv, [out.shape, Emily.Backend.Storage.dtype(out.type), block.peer, block.group.id]}

    def native_call(%{__struct__: __MODULE__.Send} = block, _out, [x]),
      do: {:send, [{:arg, 0, x.type}, block.peer, block.group.id]}

    def native_call(%{__struct__: struct, group: group}, _out, [x]),
      do: {Map.fetch!(@native, struct), [{:arg, 0, x.type}, group.id]}

    # What the block runs outside Emily.Compiler's native path (Nx.block calls it with
    # the block's one argument): the identity for a group of one, else the native op on
    # Emily tensors (inputs of other backends copied in and the result copied back).
    # Traced (Nx.Defn.Expr records a block's default), it stands in with the output's
    # shape: the input for the reductions and send, copies of it for the gather, zeros
    # for recv. Emily's compilers run the block itself, never that trace; a compiler that
    # computes a block's default would compute the stand-in.
    defp default(%{group: %Group{size: 1}, __struct__: struct}, x) do
      if struct in [__MODULE__.Send, __MODULE__.Recv],
        do: raise(ArgumentError, "send/recv: a group of one has no other rank"),
        else: x
    end

    defp default(block, x) do
      case x.data do
        %{__struct__: Emily.Backend} ->
          eager(block, x)

        %{__struct__: Nx.Defn.Expr} ->
          traced(block, x)

        %{__struct__: backend} ->
          block |> eager(Nx.backend_copy(x, Emily.Backend)) |> Nx.backend_transfer(backend)
      end
    end

    defp traced(%{__struct__: __MODULE__.AllGather, group: g}, x),
      do: Nx.concatenate(List.duplicate(x, g.size))

    defp traced(%{__struct__: __MODULE__.Recv, shape: shape, type: type}, _x),
      do: Nx.broadcast(Nx.tensor(0, type: type), shape)

    defp traced(_block, x), do: x

    # On the group's device (stream/2); the result stays with the caller's stream (as
    # Emily.Backend picks one: the selected stream, else the input's), where later ops
    # on it run.
    defp eager(block, x) do
      caller = Emily.Stream.selected() || x.data.stream
      s = stream(block.group, caller)
      out = out_template(block, x)
      {op, spec} = native_call(block, out, [x])

      args =
        Enum.map(spec, fn
          {:arg, 0, _type} -> x.data.ref
          other -> other
        end)

      y = apply(Emily.Native, op, [s | args])
      %{out | data: struct!(Emily.Backend, ref: y, stream: caller)}
    end

    defp out_template(%{__struct__: __MODULE__.AllGather, group: g}, x) do
      shape = gathered_shape(x.shape, g)
      %{x | shape: shape, names: List.duplicate(nil, tuple_size(shape))}
    end

    defp out_template(%{__struct__: __MODULE__.Recv, shape: shape, type: type}, x),
      do: %{x | shape: shape, type: type, names: List.duplicate(nil, tuple_size(shape))}

    defp out_template(_block, x), do: x
  end
end
