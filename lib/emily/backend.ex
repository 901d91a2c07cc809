if Code.ensure_loaded?(Nx) do
  defmodule Emily.Backend do
    @moduledoc """
    An `Nx.Backend` on MLX: Nx tensors held in MLX arrays, Nx ops run as MLX ops.

        Nx.default_backend(Emily.Backend)
        Nx.default_backend({Emily.Backend, device: :cpu})

    MLX is lazy: an op queues an MLX node on the op's stream and returns at once; values
    are computed when something needs them (`Nx.to_binary/1`, `Nx.to_number/1`,
    `inspect`, a `while` predicate).

    ## Options

      * `:device` - `:cpu` or `:gpu`; where new tensors (constants, `Nx.tensor/2`,
        `Nx.iota/2`, transfers) go. Defaults to `Emily.default_device/0`.

    ## Streams

    An op runs on the calling process's stream when one is set with
    `Emily.Stream.with_stream/2` (`Emily.Compiler` sets one per `Nx.Serving` partition),
    else on the stream of its first Emily input, else on the default stream. Inputs lazy
    on another stream are evaluated there first (only evaluated arrays cross streams).
    `{:f, 64}` runs on the CPU device: MLX has no f64 on GPUs.

    ## Types

    MLX computes with u8-u64, s8-s64, f16, bf16, f32, f64 and c64. Its boolean results
    come back as u8, as Nx expects. Tensors of the other Nx types are held in MLX too
    (u2/u4/s2/s4 unpacked to one byte per element, f8, f8_e4m3fn and c128 as raw bytes)
    and every op on them falls back (below). Nx.BinaryBackend tensors are accepted in any
    tensor argument; they are copied in.

    ## Fallbacks

    Ops MLX has no path for run on `Nx.BinaryBackend`: the inputs are read out of MLX,
    the op runs with the default backend pinned to `Nx.BinaryBackend`, and the result
    goes back into MLX on the op's stream. Each fallback emits
    `[:emily, :fallback, :start]` and `[:emily, :fallback, :stop]` telemetry (when
    `:telemetry` is loaded) with `%{op: op, shapes: input_shapes, types: input_types}`,
    and `config :emily, :fallback, :silent | :warn | :raise` chooses whether it also logs
    a warning or raises instead (default `:silent`).

    `fallbacks/0` lists the ops that fall back for every type, each with the reason.
    Every op on u2/u4/s2/s4, f8, f8_e4m3fn or c128 tensors falls back as well, and so do
    #{Enum.map_join(Emily.Backend.Catalogue.f64_imprecise(), ", ", &"`#{&1}`")} on f64
    (MLX's CPU kernels compute them with f32 accuracy).

    `block/4` runs natively for `Nx.Block.LogicalNot` and `Nx.Block.Phase` (complex
    input); the other `Nx.Block` structs run their default implementation, which is made
    of Nx ops that run on this backend (natively where listed above).

    ## Not supported

      * `Nx.to_pointer/2` and `Nx.from_pointer/5`: MLX's buffers are not shared out of
        the process; both raise `ArgumentError`.
      * `Nx.backend_deallocate/1` returns `:ok` and leaves the array to the garbage
        collector: an MLX array is freed when the last tensor holding it is collected.
    """

    @behaviour Nx.Backend
    # `evaluated: true` records that the array is known to be evaluated, so other
    # streams can use it without asking its worker first.
    @enforce_keys [:ref, :stream]
    defstruct [:ref, :stream, evaluated: false]

    @type t :: %__MODULE__{ref: Emily.tensor(), stream: Emily.Stream.t(), evaluated: boolean}

    alias Nx.Tensor, as: T
    alias Emily.Backend, as: B
    alias Emily.Backend.{Fallback, Storage}
    alias Emily.Native, as: N

    @check? Application.compile_env(:emily, :check_shape_and_type, false)

    ## Dispatch
    #
    # Every Nx.Backend callback not written out below as a public function is generated
    # at the end of this module: it calls `n_<op>` (the native path) where that private
    # function exists, else it falls back to Nx.BinaryBackend. Giving an op a native path
    # is writing its `n_<op>`.

    # MLX's CPU kernels for these compute f64 inputs with f32 accuracy: f64 falls back.
    @f64_imprecise Emily.Backend.Catalogue.f64_imprecise()

    defp native_type?(%T{type: type}), do: Storage.native?(type)

    defp native_inputs?([%T{type: type} | rest]),
      do: Storage.native?(type) and native_inputs?(rest)

    defp native_inputs?([list | rest]) when is_list(list),
      do: native_inputs?(list) and native_inputs?(rest)

    defp native_inputs?([_ | rest]), do: native_inputs?(rest)
    defp native_inputs?([]), do: true

    defp fallback(op, [out | inputs] = args) do
      s = stream(Enum.filter(List.flatten(inputs), &match?(%T{}, &1)), out.type)
      Fallback.run(op, args, &from_binary_backend(&1, s))
    end

    defp from_binary_backend(%T{type: type, shape: shape} = t, s) do
      bin = t |> Nx.BinaryBackend.to_binary(Nx.size(shape)) |> Storage.from_nx_binary(type)
      ref = N.from_binary(s, bin, Storage.shape(type, shape), Storage.dtype(type))
      wrap(ref, t, s)
    end

    ## Options

    @impl true
    def init([]), do: []

    def init(opts) when is_list(opts) do
      for opt <- opts do
        case opt do
          {:device, device} when device in [:cpu, :gpu] ->
            :ok

          other ->
            raise ArgumentError,
                  "Emily.Backend accepts only the option :device (:cpu or :gpu), got: " <>
                    inspect(other)
        end
      end

      opts
    end

    ## Creation

    @impl true
    def constant(%T{type: type, shape: shape} = out, value, opts) do
      if Storage.native?(type) do
        s = creation_stream(opts, type)
        wrap(scalar(s, value, type, shape), out, s)
      else
        creation_fallback(:constant, [out, value, []], opts, type)
      end
    end

    @impl true
    def from_binary(%T{type: type, shape: shape} = out, binary, opts) do
      s = creation_stream(opts, type)
      binary = if is_list(binary), do: :erlang.list_to_bitstring(binary), else: binary
      bin = Storage.from_nx_binary(binary, type)
      wrap(N.from_binary(s, bin, Storage.shape(type, shape), Storage.dtype(type)), out, s)
    end

    @impl true
    def eye(%T{type: type, shape: shape} = out, opts) do
      if Storage.native?(type) do
        s = creation_stream(opts, type)
        rank = tuple_size(shape)
        m = elem(shape, rank - 2)
        n = elem(shape, rank - 1)
        ref = N.eye(s, m, n, 0, type)
        ref = if rank > 2, do: N.broadcast_to(s, ref, shape), else: ref
        wrap(ref, out, s)
      else
        creation_fallback(:eye, [out, []], opts, type)
      end
    end

    @impl true
    def iota(%T{type: type, shape: shape} = out, axis, opts) do
      if Storage.native?(type) do
        s = creation_stream(opts, type)

        ref =
          case axis do
            nil ->
              s |> arange(Nx.size(shape), type) |> reshape(s, shape)

            axis ->
              dim = elem(shape, axis)
              ones = 1 |> Tuple.duplicate(tuple_size(shape)) |> put_elem(axis, dim)
              s |> arange(dim, type) |> reshape(s, ones) |> broadcast_to(s, shape)
          end

        wrap(ref, out, s)
      else
        creation_fallback(:iota, [out, axis, []], opts, type)
      end
    end

    # MLX's arange steps in the target dtype; half precision loses integers early, so
    # count in s32 and round once, as Nx does.
    defp arange(s, n, {kind, 16} = type) when kind in [:f, :bf],
      do: N.astype(s, N.arange(s, 0, n, 1, {:s, 32}), type)

    defp arange(s, n, {:c, _} = type), do: N.astype(s, N.arange(s, 0, n, 1, {:f, 32}), type)
    defp arange(s, n, type), do: N.arange(s, 0, n, 1, type)

    defp creation_fallback(op, args, opts, type) do
      s = creation_stream(opts, type)
      Fallback.run(op, args, &from_binary_backend(&1, s))
    end

    ## Conversion and transfer

    @impl true
    def to_binary(%T{data: %B{ref: ref}, type: type}, limit) do
      ref |> Emily.to_binary() |> Storage.to_nx_binary(type, limit)
    end

    @impl true
    def backend_copy(%T{data: %B{stream: ts}} = t, B, opts) do
      case opts[:device] do
        nil ->
          t

        device ->
          if Emily.Stream.device(ts) == device,
            do: t,
            else: from_binary(t, to_binary(t, Nx.size(t)), opts)
      end
    end

    def backend_copy(%T{} = t, Nx.Tensor, _opts), do: t

    def backend_copy(%T{} = t, backend, opts) do
      backend.from_binary(t, to_binary(t, Nx.size(t)), opts)
    end

    @impl true
    def backend_transfer(t, backend, opts), do: backend_copy(t, backend, opts)

    @impl true
    def backend_deallocate(%T{data: %B{}}), do: :ok

    @impl true
    def inspect(%T{} = tensor, inspect_opts) do
      limit = if inspect_opts.limit == :infinity, do: :infinity, else: inspect_opts.limit + 1

      tensor
      |> to_binary(min(limit, Nx.size(tensor)))
      |> then(&Nx.Backend.inspect(tensor, &1, inspect_opts))
      |> maybe_add_signature(tensor)
    end

    if Application.compile_env(:emily, :add_backend_on_inspect, true) do
      defp maybe_add_signature(result, %T{data: %B{stream: s}}) do
        Inspect.Algebra.concat([
          "Emily.Backend<#{Emily.Stream.device(s)}>",
          Inspect.Algebra.line(),
          result
        ])
      end
    else
      defp maybe_add_signature(result, _tensor), do: result
    end

    @impl true
    def to_pointer(_tensor, _opts) do
      raise ArgumentError,
            "Emily.Backend does not support Nx.to_pointer/2: MLX buffers are not shared " <>
              "outside the VM; use Nx.to_binary/1 to read a tensor's data"
    end

    @impl true
    def from_pointer(_pointer, _type, _shape, _backend_opts, _opts) do
      raise ArgumentError,
            "Emily.Backend does not support Nx.from_pointer/5: MLX cannot adopt foreign " <>
              "buffers; use Nx.from_binary/3 to bring data in"
    end

    defp n_to_batched(%T{shape: shape} = out, %T{} = t, opts) do
      s = stream([t], t.type)
      x = ref(t, s)
      batch = elem(shape, 0)
      size = elem(t.shape, 0)
      full = div(size, batch)
      remainder = rem(size, batch)
      slice0 = fn from, len -> slice_axis(s, x, t.shape, 0, from, len) end

      batches = Stream.map(0..(full - 1)//1, fn i -> wrap(slice0.(i * batch, batch), out, s) end)

      if remainder != 0 and opts[:leftover] == :repeat do
        last =
          Stream.map([:last], fn :last ->
            tail = slice0.(full * batch, remainder)
            head = slice0.(0, batch - remainder)
            wrap(N.concatenate(s, [tail, head], 0), out, s)
          end)

        Stream.concat(batches, last)
      else
        batches
      end
    end

    ## Shape

    defp n_as_type(%T{type: to} = out, %T{type: from} = t) do
      s = stream([t], to)
      wrap(convert(s, ref(t, s), from, to), out, s)
    end

    defp n_bitcast(%T{type: to, shape: shape} = out, %T{} = t) do
      s = stream([t], to)
      bin = Emily.to_binary(ref(t, s))
      wrap(N.from_binary(s, bin, shape, to), out, s)
    end

    defp n_reshape(%T{shape: shape} = out, %T{} = t) do
      s = stream([t], t.type)
      wrap(reshape(ref(t, s), s, shape), out, s)
    end

    defp n_squeeze(out, %T{} = t, axes) do
      s = stream([t], t.type)
      wrap(N.squeeze(s, ref(t, s), axes), out, s)
    end

    defp n_broadcast(%T{shape: shape, type: type} = out, %T{} = t, shape, axes) do
      s = stream([t], type)
      rank = tuple_size(shape)
      x = ref(t, s, type)

      x =
        if tuple_size(t.shape) == rank and axes == Enum.to_list(0..(rank - 1)//1) do
          x
        else
          dims = List.duplicate(1, rank)

          dims =
            t.shape
            |> Tuple.to_list()
            |> Enum.zip(axes)
            |> Enum.reduce(dims, fn {dim, axis}, acc -> List.replace_at(acc, axis, dim) end)

          reshape(x, s, List.to_tuple(dims))
        end

      wrap(broadcast_to(x, s, shape), out, s)
    end

    defp n_transpose(out, %T{} = t, axes) do
      s = stream([t], t.type)
      wrap(N.transpose(s, ref(t, s), axes), out, s)
    end

    defp n_pad(%T{type: type} = out, %T{} = t, %T{} = value, config) do
      s = stream([t, value], type)
      value = ref(value, s, type)
      wrap(pad(s, ref(t, s, type), t.shape, value, config), out, s)
    end

    defp n_reverse(out, %T{shape: shape} = t, axes) do
      s = stream([t], t.type)
      wrap(reverse(s, ref(t, s), shape, axes), out, s)
    end

    ## Slicing, joining and selection

    defp n_slice(out, %T{shape: shape} = t, starts, lengths, strides) do
      s = stream([t], t.type)

      starts =
        [Tuple.to_list(shape), starts, lengths]
        |> Enum.zip_with(fn [dim, start, len] -> start |> to_index() |> clamp(dim - len) end)

      # Nx's lengths count input elements; the output has ceil(len / stride) of them.
      stops = Enum.zip_with(starts, lengths, &(&1 + &2))

      wrap(N.slice(s, ref(t, s), starts, stops, strides), out, s)
    end

    defp n_put_slice(%T{type: type} = out, %T{shape: shape} = t, starts, %T{} = update) do
      s = stream([t, update], type)
      x = ref(t, s, type)

      starts =
        [Tuple.to_list(shape), starts, Tuple.to_list(update.shape)]
        |> Enum.zip_with(fn [dim, start, len] -> start |> to_index() |> clamp(dim - len) end)

      if Nx.size(update.shape) == 0 do
        wrap(x, out, s)
      else
        u = ref(update, s, type)
        dims = Tuple.to_list(shape)
        lens = Tuple.to_list(update.shape)
        wrap(put_slice(s, x, dims, starts, lens, u, 0), out, s)
      end
    end

    # Rebuilds `x` around the update one axis at a time: the part before the update's
    # start, the middle (recursing into the next axis), the part after.
    defp put_slice(_s, _x, [], [], [], u, _axis), do: u

    defp put_slice(s, x, [dim | dims], [start | starts], [len | lens], u, axis) do
      if start == 0 and len == dim do
        put_slice(s, x, dims, starts, lens, u, axis + 1)
      else
        rank = axis + length(dims) + 1
        full = fn from, n -> slice_axis_rank(s, x, axis, from, n, rank) end
        middle = put_slice(s, full.(start, len), dims, starts, lens, u, axis + 1)

        pieces =
          [
            if(start > 0, do: full.(0, start)),
            middle,
            if(start + len < dim, do: full.(start + len, dim - start - len))
          ]
          |> Enum.reject(&is_nil/1)

        N.concatenate(s, pieces, axis)
      end
    end

    defp n_concatenate(%T{type: type} = out, tensors, axis) do
      s = stream(tensors, type)
      wrap(N.concatenate(s, Enum.map(tensors, &ref(&1, s, type)), axis), out, s)
    end

    defp n_stack(%T{type: type} = out, tensors, axis) do
      s = stream(tensors, type)
      refs = Enum.map(tensors, &N.expand_dims(s, ref(&1, s, type), [axis]))
      wrap(N.concatenate(s, refs, axis), out, s)
    end

    defp n_select(%T{type: type} = out, pred, on_true, on_false) do
      s = stream([pred, on_true, on_false], type)
      p = N.astype(s, ref(pred, s), :bool)
      # MLX broadcasts the three like Nx does: the result has `out`'s shape.
      wrap(N.where(s, p, ref(on_true, s, type), ref(on_false, s, type)), out, s)
    end

    defp n_clip(%T{type: type} = out, %T{} = t, %T{} = min, %T{} = max) do
      s = stream([t, min, max], type)
      x = N.maximum(s, ref(t, s, type), ref(min, s, type))
      wrap(N.minimum(s, x, ref(max, s, type)), out, s)
    end

    ## Reductions

    defp n_sum(out, t, opts), do: reduction(:sum, out, t, opts)
    defp n_product(out, t, opts), do: reduction(:prod, out, t, opts)
    defp n_reduce_max(out, t, opts), do: reduction(:max, out, t, opts)
    defp n_reduce_min(out, t, opts), do: reduction(:min, out, t, opts)

    defp n_all(%T{type: type} = out, %T{} = t, opts) do
      s = stream([t], type)
      x = N.all(s, ref(t, s), reduce_axes(t, opts[:axes]), opts[:keep_axes] || false)
      wrap(N.astype(s, x, type), out, s)
    end

    defp n_any(%T{type: type} = out, %T{} = t, opts) do
      s = stream([t], type)
      x = N.any(s, ref(t, s), reduce_axes(t, opts[:axes]), opts[:keep_axes] || false)
      wrap(N.astype(s, x, type), out, s)
    end

    defp reduction(op, %T{type: type} = out, %T{} = t, opts) do
      s = stream([t], type)
      x = ref(t, s, type)
      x = apply(N, op, [s, x, reduce_axes(t, opts[:axes]), opts[:keep_axes] || false])
      wrap(x, out, s)
    end

    defp reduce_axes(%T{shape: shape}, nil), do: Enum.to_list(0..(tuple_size(shape) - 1)//1)
    defp reduce_axes(_t, axes), do: axes

    defp n_argmax(out, t, opts), do: arg_reduction(:argmax, out, t, opts)
    defp n_argmin(out, t, opts), do: arg_reduction(:argmin, out, t, opts)

    defp arg_reduction(op, %T{type: type, shape: out_shape} = out, %T{shape: shape} = t, opts) do
      s = stream([t], type)
      x = ref(t, s)

      {x, shape, axis} =
        case opts[:axis] do
          nil -> {reshape(x, s, {Nx.size(shape)}), {Nx.size(shape)}, 0}
          axis -> {x, shape, axis}
        end

      high? = opts[:tie_break] == :high
      x = if high?, do: reverse(s, x, shape, [axis]), else: x
      idx = N.astype(s, apply(N, op, [s, x, axis, false]), type)

      idx =
        if high?,
          do: N.subtract(s, scalar(s, elem(shape, axis) - 1, type, {}), idx),
          else: idx

      wrap(reshape(idx, s, out_shape), out, s)
    end

    ## Window reductions
    #
    # A box window reduces one axis at a time (the reductions are associative), each
    # axis as the combination of one strided slice per window position: sum(w_i) slices
    # rather than prod(w_i).

    defp n_window_sum(out, t, window, opts), do: window(:add, 0, out, t, window, opts)
    defp n_window_product(out, t, window, opts), do: window(:multiply, 1, out, t, window, opts)
    defp n_window_max(out, t, window, opts), do: window(:maximum, :min, out, t, window, opts)
    defp n_window_min(out, t, window, opts), do: window(:minimum, :max, out, t, window, opts)

    defp window(op, identity, %T{type: type, shape: out_shape} = out, t, window, opts) do
      s = stream([t], type)
      rank = tuple_size(t.shape)
      strides = opts[:strides] || List.duplicate(1, rank)
      padding = opts[:padding] || List.duplicate({0, 0}, rank)
      dilations = opts[:window_dilations] || List.duplicate(1, rank)

      identity =
        case identity do
          :min -> N.from_binary(s, Nx.Type.min_binary(type), {}, type)
          :max -> N.from_binary(s, Nx.Type.max_binary(type), {}, type)
          n -> scalar(s, n, type, {})
        end

      axes =
        Enum.zip([0..(rank - 1)//1, Tuple.to_list(window), strides, padding, dilations])

      {x, _dims} =
        Enum.reduce(axes, {ref(t, s, type), Tuple.to_list(t.shape)}, fn
          {_axis, 1, 1, {0, 0}, _}, acc ->
            acc

          {axis, w, stride, {lo, hi}, dilation}, {x, dims} ->
            {x, dims} = pad_edge(s, x, dims, axis, lo, identity, :low)
            {x, dims} = pad_edge(s, x, dims, axis, hi, identity, :high)
            n = elem(out_shape, axis)

            positions =
              for k <- 0..(w - 1) do
                start = k * dilation

                slice_axis_strided(
                  s,
                  x,
                  axis,
                  start,
                  start + max(n - 1, 0) * stride + 1,
                  stride,
                  rank
                )
              end

            x = Enum.reduce(tl(positions), hd(positions), &apply(N, op, [s, &2, &1]))
            {x, List.replace_at(dims, axis, n)}
        end)

      wrap(x, out, s)
    end

    ## Elementwise binary ops

    @arith %{
      add: :add,
      subtract: :subtract,
      multiply: :multiply,
      divide: :divide,
      pow: :power,
      atan2: :arctan2,
      min: :minimum,
      max: :maximum,
      bitwise_and: :bitwise_and,
      bitwise_or: :bitwise_or,
      bitwise_xor: :bitwise_xor,
      left_shift: :left_shift,
      right_shift: :right_shift
    }

    for {name, mlx} <- @arith do
      defp unquote(:"n_#{name}")(%T{type: type} = out, l, r) do
        s = stream([l, r], type)
        wrap(N.unquote(mlx)(s, ref(l, s, type), ref(r, s, type)), out, s)
      end
    end

    @compare %{
      equal: :equal,
      not_equal: :not_equal,
      greater: :greater,
      less: :less,
      greater_equal: :greater_equal,
      less_equal: :less_equal
    }

    for {name, mlx} <- @compare do
      defp unquote(:"n_#{name}")(%T{type: type} = out, l, r) do
        s = stream([l, r], type)
        common = Nx.Type.merge(l.type, r.type)
        x = N.unquote(mlx)(s, ref(l, s, common), ref(r, s, common))
        wrap(N.astype(s, x, type), out, s)
      end
    end

    for {name, mlx} <- [
          logical_and: :logical_and,
          logical_or: :logical_or,
          logical_xor: :not_equal
        ] do
      defp unquote(:"n_#{name}")(%T{type: type} = out, l, r) do
        s = stream([l, r], type)
        x = N.unquote(mlx)(s, N.astype(s, ref(l, s), :bool), N.astype(s, ref(r, s), :bool))
        wrap(N.astype(s, x, type), out, s)
      end
    end

    # Nx's remainder truncates (the result has the dividend's sign, like `rem/2` and
    # `fmod`); MLX's floors (the divisor's sign). They differ by one divisor where the
    # result is nonzero and the signs differ.
    defp n_remainder(%T{type: type} = out, l, r) do
      s = stream([l, r], type)

      case type do
        # In half precision the sign fix-up below would round twice: work in f32.
        {k, 16} when k in [:f, :bf] ->
          a = ref(l, s, {:f, 32})
          b = ref(r, s, {:f, 32})
          wrap(N.astype(s, trunc_remainder(s, a, b, {:f, 32}), type), out, s)

        _ ->
          wrap(trunc_remainder(s, ref(l, s, type), ref(r, s, type), type), out, s)
      end
    end

    defp trunc_remainder(s, a, b, {:u, _} = _type), do: N.remainder(s, a, b)

    defp trunc_remainder(s, a, b, type) do
      r = N.remainder(s, a, b)
      zero = scalar(s, 0, type, {})

      fix =
        N.logical_and(
          s,
          N.not_equal(s, r, zero),
          N.not_equal(s, N.less(s, r, zero), N.less(s, a, zero))
        )

      N.where(s, fix, N.subtract(s, r, b), r)
    end

    # Nx's quotient truncates toward zero; MLX's floor_divide floors.
    defp n_quotient(%T{type: type} = out, l, r) do
      s = stream([l, r], type)
      a = ref(l, s, type)
      b = ref(r, s, type)
      q = N.floor_divide(s, a, b)

      q =
        case type do
          {:u, _} ->
            q

          _ ->
            zero = scalar(s, 0, type, {})

            inexact =
              N.logical_and(
                s,
                N.not_equal(s, N.remainder(s, a, b), zero),
                N.not_equal(s, N.less(s, a, zero), N.less(s, b, zero))
              )

            N.where(s, inexact, N.add(s, q, scalar(s, 1, type, {})), q)
        end

      wrap(q, out, s)
    end

    ## Elementwise unary ops

    @unary %{
      exp: :exp,
      expm1: :expm1,
      log: :log,
      log1p: :log1p,
      sigmoid: :sigmoid,
      cos: :cos,
      sin: :sin,
      tan: :tan,
      cosh: :cosh,
      sinh: :sinh,
      tanh: :tanh,
      acos: :arccos,
      asin: :arcsin,
      atan: :arctan,
      acosh: :arccosh,
      asinh: :arcsinh,
      atanh: :arctanh,
      sqrt: :sqrt,
      rsqrt: :rsqrt,
      erf: :erf,
      erf_inv: :erfinv,
      bitwise_not: :bitwise_invert,
      negate: :negative,
      sign: :sign
    }

    for {name, mlx} <- @unary do
      defp unquote(:"n_#{name}")(%T{type: type} = out, %T{} = t) do
        s = stream([t], type)
        wrap(N.unquote(mlx)(s, ref(t, s, type)), out, s)
      end
    end

    defp n_erfc(%T{type: type} = out, %T{} = t) do
      s = stream([t], type)
      x = N.erf(s, ref(t, s, type))
      wrap(N.subtract(s, scalar(s, 1, type, {}), x), out, s)
    end

    # MLX has no cube root: pow(|x|, 1/3) with the sign put back, then one Newton step,
    # which brings exact cubes back to their integer roots.
    defp n_cbrt(%T{type: type} = out, %T{} = t) do
      s = stream([t], type)
      x = ref(t, s, type)
      y = N.power(s, N.abs(s, x), scalar(s, 1 / 3, type, {}))
      y = N.multiply(s, N.sign(s, x), y)
      y2 = N.multiply(s, y, y)

      step =
        N.divide(
          s,
          N.subtract(s, N.multiply(s, y2, y), x),
          N.multiply(s, scalar(s, 3, type, {}), y2)
        )

      refined = N.subtract(s, y, step)
      ok = N.logical_and(s, N.isfinite(s, refined), N.not_equal(s, y, scalar(s, 0, type, {})))
      wrap(N.where(s, ok, refined, y), out, s)
    end

    defp n_abs(%T{type: type} = out, %T{type: in_type} = t) do
      s = stream([t], type)

      case in_type do
        {:u, _} -> wrap(ref(t, s), out, s)
        {:c, _} -> wrap(N.abs(s, ref(t, s)), out, s)
        _ -> wrap(N.abs(s, ref(t, s, type)), out, s)
      end
    end

    for {name, mlx} <- [ceil: :ceil, floor: :floor] do
      defp unquote(:"n_#{name}")(%T{type: type} = out, %T{} = t) do
        s = stream([t], type)
        x = ref(t, s, type)

        case type do
          {k, _} when k in [:u, :s] -> wrap(x, out, s)
          _ -> wrap(N.unquote(mlx)(s, x), out, s)
        end
      end
    end

    # Nx rounds half away from zero; MLX rounds half to even. Ties get the truncated
    # value plus the sign.
    defp n_round(%T{type: type} = out, %T{} = t) do
      s = stream([t], type)
      x = ref(t, s, type)

      case type do
        {k, _} when k in [:u, :s] ->
          wrap(x, out, s)

        _ ->
          r = N.round(s, x, 0)
          zero = scalar(s, 0, type, {})
          trunc = N.where(s, N.less(s, x, zero), N.ceil(s, x), N.floor(s, x))
          tie = N.equal(s, N.abs(s, N.subtract(s, x, trunc)), scalar(s, 0.5, type, {}))
          wrap(N.where(s, tie, N.add(s, trunc, N.sign(s, x)), r), out, s)
      end
    end

    defp n_conjugate(%T{type: type} = out, %T{} = t) do
      s = stream([t], type)
      wrap(N.conjugate(s, ref(t, s, type)), out, s)
    end

    defp n_real(%T{type: type} = out, %T{type: in_type} = t) do
      s = stream([t], type)

      case in_type do
        {:c, _} -> wrap(N.real(s, ref(t, s)), out, s)
        _ -> wrap(ref(t, s, type), out, s)
      end
    end

    defp n_imag(%T{type: type, shape: shape} = out, %T{type: in_type} = t) do
      s = stream([t], type)

      case in_type do
        {:c, _} -> wrap(N.imag(s, ref(t, s)), out, s)
        _ -> wrap(scalar(s, 0, type, shape), out, s)
      end
    end

    for {name, mlx} <- [is_nan: :isnan, is_infinity: :isinf] do
      defp unquote(:"n_#{name}")(%T{type: type, shape: shape} = out, %T{type: in_type} = t) do
        s = stream([t], type)

        case in_type do
          {k, _} when k in [:u, :s] -> wrap(scalar(s, 0, type, shape), out, s)
          _ -> wrap(N.astype(s, N.unquote(mlx)(s, ref(t, s)), type), out, s)
        end
      end
    end

    # Bit counts on the unsigned view of the bits (MLX's right shift of a signed value is
    # arithmetic).
    defp n_population_count(%T{type: {_, bits} = type} = out, %T{} = t) do
      s = stream([t], type)
      u = {:u, bits}
      x = N.astype(s, ref(t, s, type), u)
      c = fn v -> scalar(s, v, u, {}) end
      mask = fn byte -> Enum.reduce(1..div(bits, 8), 0, fn _, acc -> acc * 256 + byte end) end
      x = N.subtract(s, x, N.bitwise_and(s, N.right_shift(s, x, c.(1)), c.(mask.(0x55))))

      x =
        N.add(
          s,
          N.bitwise_and(s, x, c.(mask.(0x33))),
          N.bitwise_and(s, N.right_shift(s, x, c.(2)), c.(mask.(0x33)))
        )

      x = N.bitwise_and(s, N.add(s, x, N.right_shift(s, x, c.(4))), c.(mask.(0x0F)))

      x =
        if bits > 8,
          do: N.right_shift(s, N.multiply(s, x, c.(mask.(0x01))), c.(bits - 8)),
          else: x

      wrap(N.astype(s, x, type), out, s)
    end

    defp n_count_leading_zeros(%T{type: {_, bits} = type} = out, %T{} = t) do
      s = stream([t], type)
      u = {:u, bits}
      x = N.astype(s, ref(t, s, type), u)
      zero = scalar(s, 0, u, {})

      {n, x} =
        bits
        |> shifts()
        |> Enum.reduce({scalar(s, bits, u, {}), x}, fn shift, {n, x} ->
          y = N.right_shift(s, x, scalar(s, shift, u, {}))
          nonzero = N.not_equal(s, y, zero)

          {N.where(s, nonzero, N.subtract(s, n, scalar(s, shift, u, {})), n),
           N.where(s, nonzero, y, x)}
        end)

      wrap(N.astype(s, N.subtract(s, n, x), type), out, s)
    end

    defp shifts(1), do: []
    defp shifts(bits), do: [div(bits, 2) | shifts(div(bits, 2))]

    ## Linear algebra

    defp n_dot(%T{type: type, shape: out_shape} = out, l, cl, bl, r, cr, br) do
      s = stream([l, r], type)
      a = ref(l, s, type)
      b = ref(r, s, type)
      fl = free_axes(l, cl, bl)
      fr = free_axes(r, cr, br)
      a = permute(s, a, l.shape, bl ++ fl ++ cl)
      b = permute(s, b, r.shape, br ++ cr ++ fr)
      batch = dims_product(l.shape, bl)
      m = dims_product(l.shape, fl)
      k = dims_product(l.shape, cl)
      n = dims_product(r.shape, fr)

      result =
        case type do
          {kind, _} when kind in [:u, :s] ->
            # MLX's matmul is floating point only: integer dots multiply and sum, exactly
            # (wrapping like Nx's).
            a = reshape(a, s, {batch, m, k, 1})
            b = reshape(b, s, {batch, 1, k, n})
            # (MLX sums narrow integers into 32 bits.)
            N.astype(s, N.sum(s, N.multiply(s, a, b), [2], false), type)

          _ when bl == [] ->
            N.matmul(s, reshape(a, s, {m, k}), reshape(b, s, {k, n}))

          _ ->
            N.matmul(s, reshape(a, s, {batch, m, k}), reshape(b, s, {batch, k, n}))
        end

      wrap(reshape(result, s, out_shape), out, s)
    end

    defp free_axes(%T{shape: shape}, contract, batch) do
      for axis <- 0..(tuple_size(shape) - 1)//1, axis not in contract, axis not in batch, do: axis
    end

    defp dims_product(shape, axes), do: Enum.reduce(axes, 1, &(elem(shape, &1) * &2))

    ## Blocks

    @impl true
    def block(%Nx.Block.LogicalNot{}, %T{type: type} = out, [%T{} = t], fun) do
      if native_type?(out) and native_type?(t) do
        s = stream([t], type)
        x = N.logical_not(s, N.astype(s, ref(t, s), :bool))
        wrap(N.astype(s, x, type), out, s)
      else
        fun.(%Nx.Block.LogicalNot{}, t)
      end
    end

    def block(%Nx.Block.Phase{} = struct, %T{type: type} = out, [%T{type: {:c, 64}} = t], fun) do
      if native_type?(out) do
        s = stream([t], type)
        x = ref(t, s)
        wrap(N.arctan2(s, N.imag(s, x), N.real(s, x)), out, s)
      else
        fun.(struct, t)
      end
    end

    def block(struct, _out, args, fun), do: apply(fun, [struct | args])

    @doc false
    # Makes `t` usable from `stream` without a round trip per op: evaluates it on its own
    # stream if it lives on another one, and records that it is evaluated.
    def for_stream(%T{data: %B{stream: s}} = t, s), do: t
    def for_stream(%T{data: %B{evaluated: true}} = t, _s), do: t

    def for_stream(%T{data: %B{ref: ref} = data} = t, _s) do
      Emily.eval(ref)
      %{t | data: %{data | evaluated: true}}
    end

    ## Streams and tensors

    # The stream an op runs on: the process's stream if one is set, else the stream of
    # the first Emily input, else the default one; f64 work goes to the CPU.
    defp stream(inputs, type) do
      s = Emily.Stream.selected() || first_stream(inputs) || Emily.Stream.current()
      route(s, fn -> type == {:f, 64} or Enum.any?(inputs, &(&1.type == {:f, 64})) end)
    end

    defp first_stream([%T{data: %B{stream: s}} | _]), do: s
    defp first_stream([_ | rest]), do: first_stream(rest)
    defp first_stream([]), do: nil

    defp creation_stream(opts, type) do
      s =
        case opts[:device] do
          nil ->
            Emily.Stream.current()

          device ->
            selected = Emily.Stream.selected()

            if selected && Emily.Stream.device(selected) == device,
              do: selected,
              else: Emily.Stream.default(device)
        end

      route(s, fn -> type == {:f, 64} end)
    end

    defp route(s, f64?) do
      if :gpu in Emily.devices() and f64?.() and Emily.Stream.device(s) == :gpu do
        Emily.Stream.default(:cpu)
      else
        s
      end
    end

    # The MLX array of `t` usable on stream `s`.
    defp ref(%T{data: %B{ref: ref, stream: s}}, s), do: ref
    defp ref(%T{data: %B{ref: ref, evaluated: true}}, _s), do: ref

    defp ref(%T{data: %B{ref: ref}}, _s) do
      # Only evaluated arrays cross streams.
      Emily.eval(ref)
      ref
    end

    defp ref(%T{type: type, shape: shape} = t, s) do
      bin = t |> Nx.to_binary() |> Storage.from_nx_binary(type)
      N.from_binary(s, bin, Storage.shape(type, shape), Storage.dtype(type))
    end

    # ... converted to `type` (a plain MLX cast: Nx's rules for non-finite values only
    # apply to `as_type/2`).
    defp ref(%T{type: type} = t, s, type), do: ref(t, s)
    defp ref(%T{} = t, s, type), do: N.astype(s, ref(t, s), type)

    defp wrap(ref, %T{} = out, s), do: %{out | data: %B{ref: check(ref, out), stream: s}}

    if @check? do
      defp check(ref, %T{type: type, shape: shape}) do
        want = {Storage.shape(type, shape), Storage.dtype(type)}
        got = {Emily.shape(ref), Emily.dtype(ref)}

        if got != want do
          raise "Emily.Backend produced #{inspect(got)} where Nx expects #{inspect(want)}"
        end

        ref
      end
    else
      defp check(ref, _out), do: ref
    end

    ## Helpers

    # Nx's as_type: floats to integers truncate, NaN becomes 0 and infinities the
    # type's limits; complex to real keeps the real part.
    defp convert(_s, x, type, type), do: x

    defp convert(s, x, {:c, _}, {k, _} = to) when k in [:u, :s] do
      convert(s, N.real(s, x), {:f, 32}, to)
    end

    defp convert(s, x, {k, _} = from, {ik, _} = to) when k in [:f, :bf] and ik in [:u, :s] do
      y = N.astype(s, x, to)
      y = N.where(s, N.isnan(s, x), scalar(s, 0, to, {}), y)
      inf = scalar(s, :infinity, from, {})
      y = N.where(s, N.equal(s, x, inf), limit(s, :max, to), y)
      y = N.where(s, N.equal(s, x, N.negative(s, inf)), limit(s, :min, to), y)
      y
    end

    defp convert(s, x, _from, to), do: N.astype(s, x, to)

    defp limit(s, :max, type), do: N.from_binary(s, Nx.Type.max_finite_binary(type), {}, type)
    defp limit(s, :min, type), do: N.from_binary(s, Nx.Type.min_finite_binary(type), {}, type)

    # A constant of `type` and `shape`: one `full` where a double holds the value, else
    # its exact bytes broadcast.
    defp scalar(s, value, {kind, _} = type, shape) when kind in [:u, :s] do
      value =
        case value do
          v when is_integer(v) -> v
          v when is_float(v) -> trunc(v)
          %Complex{re: re} -> trunc(re)
        end

      if abs(value) < 9_007_199_254_740_992 and shape != {} do
        N.full(s, shape, value, type)
      else
        bin = Emily.Codec.pack([value], type)
        x = N.from_binary(s, bin, {}, type)
        if shape == {}, do: x, else: N.broadcast_to(s, x, shape)
      end
    end

    defp scalar(s, value, {:c, _} = type, shape) do
      value =
        case value do
          %Complex{} -> value
          v -> Complex.new(v, 0.0)
        end

      x = N.from_binary(s, Emily.Codec.pack([value], type), {}, type)
      if shape == {}, do: x, else: N.broadcast_to(s, x, shape)
    end

    defp scalar(s, value, type, shape) do
      value =
        case value do
          %Complex{re: re} -> re
          v -> v
        end

      if shape == {} do
        N.from_binary(s, Emily.Codec.pack([value], type), {}, type)
      else
        N.full(s, shape, value, type)
      end
    end

    defp reshape(x, s, shape), do: N.reshape(s, x, shape)
    defp broadcast_to(x, s, shape), do: N.broadcast_to(s, x, shape)

    defp permute(s, x, shape, axes) do
      if axes == Enum.to_list(0..(tuple_size(shape) - 1)//1),
        do: x,
        else: N.transpose(s, x, axes)
    end

    defp reverse(_s, x, _shape, []), do: x

    defp reverse(s, x, shape, axes) do
      dims = Tuple.to_list(shape)

      {starts, stops, strides} =
        dims
        |> Enum.with_index()
        |> Enum.map(fn {dim, axis} ->
          if axis in axes and dim > 0, do: {dim - 1, -dim - 1, -1}, else: {0, dim, 1}
        end)
        |> unzip3()

      N.slice(s, x, starts, stops, strides)
    end

    defp unzip3(list) do
      {Enum.map(list, &elem(&1, 0)), Enum.map(list, &elem(&1, 1)), Enum.map(list, &elem(&1, 2))}
    end

    defp slice_axis(s, x, shape, axis, from, len) do
      slice_axis_rank(s, x, axis, from, len, tuple_size(shape))
    end

    # [from, from + len) along `axis` of a rank-`rank` array, all of the other axes.
    defp slice_axis_rank(s, x, axis, from, len, rank) do
      big = 2_147_483_647
      starts = List.duplicate(0, rank) |> List.replace_at(axis, from)
      stops = List.duplicate(big, rank) |> List.replace_at(axis, from + len)
      N.slice(s, x, starts, stops, List.duplicate(1, rank))
    end

    defp slice_axis_strided(s, x, axis, from, to, stride, rank) do
      big = 2_147_483_647
      starts = List.duplicate(0, rank) |> List.replace_at(axis, from)
      stops = List.duplicate(big, rank) |> List.replace_at(axis, to)
      strides = List.duplicate(1, rank) |> List.replace_at(axis, stride)
      N.slice(s, x, starts, stops, strides)
    end

    # Nx's pad: per axis {low, high, interior}; negative low/high crop.
    defp pad(s, x, shape, value, config) do
      {x, _dims} =
        config
        |> Enum.with_index()
        |> Enum.reduce({x, Tuple.to_list(shape)}, fn {{lo, hi, interior}, axis}, {x, dims} ->
          {x, dims} = pad_interior(s, x, dims, axis, interior, value)
          {x, dims} = pad_edge(s, x, dims, axis, lo, value, :low)
          pad_edge(s, x, dims, axis, hi, value, :high)
        end)

      x
    end

    defp pad_interior(_s, x, dims, _axis, 0, _value), do: {x, dims}

    defp pad_interior(s, x, dims, axis, interior, value) do
      case Enum.at(dims, axis) do
        d when d <= 1 ->
          {x, dims}

        d ->
          rank = length(dims)
          expanded = N.expand_dims(s, x, [axis + 1])
          fill_dims = List.insert_at(dims, axis + 1, interior) |> List.replace_at(axis, d)
          fill = broadcast_to(value, s, List.to_tuple(fill_dims))
          joined = N.concatenate(s, [expanded, fill], axis + 1)
          merged_dims = List.replace_at(dims, axis, d * (interior + 1))
          merged = reshape(joined, s, List.to_tuple(merged_dims))
          new = d + (d - 1) * interior
          {slice_axis_rank(s, merged, axis, 0, new, rank), List.replace_at(dims, axis, new)}
      end
    end

    defp pad_edge(_s, x, dims, _axis, 0, _value, _side), do: {x, dims}

    defp pad_edge(s, x, dims, axis, n, _value, side) when n < 0 do
      d = Enum.at(dims, axis)
      from = if side == :low, do: -n, else: 0
      {slice_axis_rank(s, x, axis, from, d + n, length(dims)), List.replace_at(dims, axis, d + n)}
    end

    defp pad_edge(s, x, dims, axis, n, value, side) do
      fill = broadcast_to(value, s, dims |> List.replace_at(axis, n) |> List.to_tuple())
      pieces = if side == :low, do: [fill, x], else: [x, fill]
      d = Enum.at(dims, axis)
      {N.concatenate(s, pieces, axis), List.replace_at(dims, axis, d + n)}
    end

    defp to_index(i) when is_integer(i), do: i
    defp to_index(%T{} = t), do: Nx.to_number(t)

    defp clamp(i, max), do: i |> max(0) |> min(max)

    ## Generated callbacks (see "Dispatch" above)

    generated =
      for {name, arity} <- Enum.sort(Nx.Backend.behaviour_info(:callbacks)),
          not Module.defines?(__MODULE__, {name, arity}, :def),
          do: {name, arity, Module.defines?(__MODULE__, {:"n_#{name}", arity})}

    @fallbacks for {name, _, false} <- generated,
                   do: {name, Emily.Backend.Catalogue.reason(name)}

    for {name, arity, native?} <- generated do
      [out | inputs] = args = Macro.generate_arguments(arity, __MODULE__)

      if native? do
        native = :"n_#{name}"
        check = quote(do: native_type?(unquote(out)) and native_inputs?(unquote(inputs)))

        check =
          if name in @f64_imprecise,
            do: quote(do: unquote(out).type != {:f, 64} and unquote(check)),
            else: check

        @impl true
        def unquote(name)(unquote_splicing(args)) do
          if unquote(check),
            do: unquote(native)(unquote_splicing(args)),
            else: fallback(unquote(name), unquote(args))
        end
      else
        @impl true
        def unquote(name)(unquote_splicing(args)), do: fallback(unquote(name), unquote(args))
      end
    end

    @doc """
    The `Nx.Backend` callbacks that run on `Nx.BinaryBackend` for every type, each with
    the reason:

    #{Enum.map_join(@fallbacks, "\n", fn {op, why} -> "  * `#{op}` - #{why}" end)}
    """
    @spec fallbacks() :: [{atom, String.t()}]
    def fallbacks, do: @fallbacks
  end
end
