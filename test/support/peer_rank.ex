defmodule Emily.Peer.Rank do
  @moduledoc false
  # What a rank of the collectives suites runs (in a peer VM, or in the test VM itself),
  # through Emily.Native only, so that it runs without Nx. The group joined last is kept
  # in this VM's persistent_term.
  alias Emily.Native, as: N

  @key {__MODULE__, :group}

  @doc "Joins a group (Emily.Distributed.init/1 options); `{:ok, rank}` or `{:error, e}`."
  def join(opts) do
    group = Emily.Distributed.init(opts)
    :persistent_term.put(@key, group)
    {:ok, group.rank}
  rescue
    e -> {:error, e}
  end

  def group, do: :persistent_term.get(@key)

  @doc "Runs `op` (:all_sum, :all_max, :all_min, :all_gather) on `list`: values or the error."
  def collective(op, list) do
    x = Emily.from_list(list, {:f, 32})
    {:ok, Emily.to_list(apply(N, op, [Emily.Distributed.stream(group()), x, group().id]))}
  rescue
    e -> {:error, e}
  end

  @doc """
  `collective/2` from another current stream than the default one, as a GPU machine
  runs it from its default GPU stream: `current` is `:own` (a new CPU stream of this
  rank's, standing in for it on any machine) or `:gpu` (the default GPU stream). The
  input is a lazy node of the current stream; the collective runs on `on`: `:group`
  (the stream `Emily.Distributed.stream/2` picks), `:cpu` (the default CPU stream: a
  worker other than the input's) or `:current` (the current stream, as given); its
  result is used by a lazy op on the current stream before it is read. Returns
  `{:ok, {values, the collective's stream name, the current stream's name}}`.
  """
  def collective_from(current, op, list, on) do
    own = if current == :own, do: Emily.Stream.new(:cpu), else: Emily.Stream.default(:gpu)

    try do
      Emily.Stream.with_stream(own, fn ->
        s = Emily.Stream.current()
        lazy = N.multiply(s, Emily.from_list(list, {:f, 32}), N.full(s, {}, 1.0, {:f, 32}))

        cs =
          case on do
            :group -> Emily.Distributed.stream(group())
            :cpu -> Emily.Stream.default(:cpu)
            :current -> s
          end

        y = apply(N, op, [cs, lazy, group().id])
        out = N.add(s, y, N.full(s, {}, 0.0, {:f, 32}))
        {:ok, {Emily.to_list(out), Emily.Stream.name(cs), Emily.Stream.name(s)}}
      end)
    after
      if current == :own, do: Emily.Stream.release(own)
    end
  rescue
    e -> {:error, e}
  end

  @doc "Sends `list` to `dst`, then receives `n` floats from `src`."
  def exchange(list, dst, src, n) do
    s = Emily.Distributed.stream(group())
    sent = N.send(s, Emily.from_list(list, {:f, 32}), dst, group().id)
    :ok = Emily.eval(sent)
    {:ok, Emily.to_list(N.recv(s, {n}, {:f, 32}, src, group().id))}
  rescue
    e -> {:error, e}
  end

  @doc "This VM's OS process id."
  def os_pid, do: List.to_integer(:os.getpid())

  @doc "Whether this VM's default stream still computes."
  def stream_works? do
    Emily.to_list(
      N.add(
        Emily.Stream.current(),
        Emily.from_list([1.0], {:f, 32}),
        Emily.from_list([2.0], {:f, 32})
      )
    ) == [3.0]
  end

  @doc """
  `steps` steps of gradient descent on a linear least-squares model, `w` of `{d, k}`:
  loss = sum((x w - y)^2) / (2 n) over the whole batch of `n` rows. This rank holds rows
  `x`, `y` (a shard); the gradient x^T (x w - y) of each shard is all-summed (with no
  group: the whole batch in one process). Returns w's values.
  """
  def linear_steps(x_rows, y_rows, w0, n, steps, lr, group_id) do
    s = Emily.Stream.current()
    group_id = if group_id == :group, do: group().id, else: group_id
    d = length(hd(x_rows))
    k = length(hd(y_rows))
    x = Emily.from_list(List.flatten(x_rows), {:f, 32}, shape: {length(x_rows), d})
    y = Emily.from_list(List.flatten(y_rows), {:f, 32}, shape: {length(y_rows), k})
    w = Emily.from_list(List.flatten(w0), {:f, 32}, shape: {d, k})
    scale = N.full(s, {}, lr / n, {:f, 32})

    w =
      Enum.reduce(1..steps, w, fn _, w ->
        residual = N.subtract(s, N.matmul(s, x, w), y)
        grad = N.matmul(s, N.transpose(s, x, [1, 0]), residual)

        grad =
          if group_id,
            do: N.all_sum(Emily.Distributed.stream(group(), s), grad, group_id),
            else: grad

        w = N.subtract(s, w, N.multiply(s, grad, scale))
        # One step per evaluation, as a training loop runs.
        :ok = Emily.eval(w)
        w
      end)

    {:ok, Emily.to_list(w)}
  rescue
    e -> {:error, e}
  end
end
