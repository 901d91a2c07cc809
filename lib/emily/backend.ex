if Code.ensure_loaded?(Nx) do
  defmodule Emily.Backend do
    # MLX's CPU kernels for these compute f64 inputs with f32 accuracy: f64 falls back.
    @f64_imprecise Emily.Backend.Ops.f64_imprecise()

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

    Every callback has a native path (`fallbacks/0` lists those without one). What still
    falls back:

      * every op on u2/u4/s2/s4, f8, f8_e4m3fn or c128 tensors (sub-byte tensors are
        packed and unpacked on the device, but computed on by the fallback);
      * #{Enum.map_join(@f64_imprecise, ", ", &"`#{&1}`")} on f64: MLX's CPU kernels
        compute these with f32 accuracy (relative errors of 5e-8 to 5e-7 against libm
        on f64 inputs, MLX 0.32), where Nx.BinaryBackend is accurate to the last bit;
        `erfc` is composed of `exp`. (`erf_inv` does not fall back: Nx.BinaryBackend's
        is itself a single-precision formula evaluated in f64, and Emily evaluates the
        same one in f64 on the CPU, bit for bit);
      * `reduce` and `window_reduce` when their function is not one `Nx.add/2`,
        `Nx.multiply/2`, `Nx.max/2` or `Nx.min/2` of its two arguments (the function is
        traced once with `Nx.Defn.Expr` parameters to find out).

    ## Blocks

    `block/4` is native for `Nx.Block.Take`, `TakeAlongAxis`, `TopK`,
    `Cumulative{Sum,Product,Min,Max}`, `LogicalNot`, `Phase`, `AllClose` (f32, f64),
    `FFT2`, `IFFT2`, `RFFT`, `IRFFT`, and for f32/f64 inputs `LinAlg.{Cholesky, Solve,
    QR, Eigh, SVD, LU, Determinant}` (eigh and svd also c64; QR's `:complete` mode for
    `m <= n`); other structs and input types run the block's default implementation, Nx
    ops that run on this backend.

    `Emily.Fast`'s blocks (norms, rope, attention) run MLX's fused kernels for f16, bf16
    and f32, and their default implementation for f64.

    ## Linear algebra

    LAPACK through MLX, on a CPU worker (MLX's linalg is CPU-only), in the input's type.
    Results follow Nx's conventions: QR's signs are those of Nx's Householder QR (R's
    diagonal non-negative where Nx reflects a column), eigenvalues come by decreasing
    magnitude, entries within the block's `eps` of zero are zeroed as Nx does, and the
    determinant past 3x3 comes from the LU (MLX's goes through `exp`). `triangular_solve`
    computes in f64 (as Nx.BinaryBackend does), complex inputs too, and raises on a zero
    on the diagonal, as Nx does.

    ## Memory

    An MLX array is freed when the last tensor holding it is garbage-collected, or at
    once by `Nx.backend_deallocate/1` (and by `Nx.backend_transfer/2` to another backend
    or device), after which the tensor raises `Emily.Error` if used (`Emily.release/1`).

    Op by op, each intermediate result therefore stays allocated until its tensor is
    collected: MLX cannot write the next result into a dropped intermediate's buffer, as
    it does for Python code, and every large result takes fresh memory. On
    `Emily.Compiler`'s native path no tensor holds a graph's intermediates, and MLX
    reuses them.

    ## Debug checks

    With `config :emily, debug_bounds_check: true` (compile time, `Emily.Debug`), the
    indices of `take`, `take_along_axis`, `gather`, `indexed_add` and `indexed_put` are
    checked before the op and an out-of-range one (negative, or not below its axis's
    size; gather's and the indexed ops' `{..., k}` indices column by column against the
    `k` axes they address) raises `Emily.Error`. Without it, read indices are clamped
    into range and writes at out-of-range indices are dropped. With
    `debug_detect_nan_inf: true`, a `dot`, or an `Emily.Fast` norm or attention, whose
    result holds NaN or an infinity raises `Emily.Error`. Both evaluate what they check
    (a round trip per op); off, they compile to nothing.

    ## Not supported

      * `Nx.to_pointer/2` and `Nx.from_pointer/5`: MLX's buffers are not shared out of
        the process; both raise `ArgumentError`.
    """

    @behaviour Nx.Backend
    @enforce_keys [:ref, :stream]
    defstruct [:ref, :stream]

    @type t :: %__MODULE__{ref: Emily.tensor(), stream: Emily.Stream.t()}

    alias Nx.Tensor, as: T
    alias Emily.Backend, as: B
    alias Emily.Backend.{Compose, Fallback, Storage}
    alias Emily.Backend.Compose.Eager
    alias Emily.Native, as: N

    require Emily.Debug

    @check? Application.compile_env(:emily, :check_shape_and_type, false)

    ## Dispatch
    #
    # Every Nx.Backend callback not written out below as a public function is generated
    # at the end of this module: it calls `n_<op>` (the native path) where that private
    # function exists, else it falls back to Nx.BinaryBackend. Giving an op a native path
    # is writing its `n_<op>`.

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
      ref = from_nx_binary(s, Nx.BinaryBackend.to_binary(t, Nx.size(shape)), type, shape)
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
      wrap(from_nx_binary(s, binary, type, shape), out, s)
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
        {ref, _} = Compose.iota({Eager, s}, shape, axis, type)
        wrap(ref, out, s)
      else
        creation_fallback(:iota, [out, axis, []], opts, type)
      end
    end

    defp creation_fallback(op, args, opts, type) do
      s = creation_stream(opts, type)
      Fallback.run(op, args, &from_binary_backend(&1, s))
    end

    ## Conversion and transfer

    @impl true
    def to_binary(%T{data: %B{ref: ref, stream: s}, type: {_, bits}} = t, limit) when bits < 8 do
      # Packed on the device, as Nx lays sub-byte types out: a bitstring.
      n = min(limit, Nx.size(t)) * bits
      <<packed::bitstring-size(^n), _::bitstring>> = Emily.to_binary(N.pack_bits(s, ref, bits))
      packed
    end

    def to_binary(%T{data: %B{ref: ref}, type: type}, limit) do
      ref |> Emily.to_binary() |> Storage.to_nx_binary(type, limit)
    end

    # Data in Nx's layout into an MLX array on `s`: sub-byte types arrive packed (a
    # bitstring) and are unpacked on the device, one element per byte.
    defp from_nx_binary(s, bin, {kind, bits}, shape) when bits < 8 do
      pad = rem(8 - rem(bit_size(bin), 8), 8)
      bytes = <<bin::bitstring, 0::size(pad)>>
      packed = N.from_binary(s, bytes, {byte_size(bytes)}, {:u, 8})
      N.reshape(s, N.unpack_bits(s, packed, bits, kind == :s, Nx.size(shape)), shape)
    end

    defp from_nx_binary(s, bin, type, shape),
      do: N.from_binary(s, bin, Storage.shape(type, shape), Storage.dtype(type))

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
    def backend_transfer(%T{data: %B{ref: ref}} = t, backend, opts) do
      copy = backend_copy(t, backend, opts)
      # A transfer gives the source up: free its array now, unless the copy is the source.
      unless match?(%T{data: %B{ref: ^ref}}, copy), do: Emily.release(ref)
      copy
    end

    @impl true
    def backend_deallocate(%T{data: %B{ref: ref}}) do
      case Emily.release(ref) do
        :ok -> :ok
        :already_released -> :already_deallocated
      end
    end

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
      slice0 = fn from, len -> slice_axis(s, x, 0, from, len, tuple_size(t.shape)) end

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
      {y, _} = Compose.cast({Eager, s}, ref(t, s), from, to)
      wrap(y, out, s)
    end

    defp n_bitcast(%T{type: to} = out, %T{} = t) do
      s = stream([t], to)
      wrap(N.view(s, ref(t, s), to), out, s)
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
      {lo, hi, interior} = unzip3(config)
      wrap(N.pad(s, ref(t, s, type), ref(value, s, type), lo, hi, interior), out, s)
    end

    defp n_reverse(out, %T{} = t, axes) do
      s = stream([t], t.type)
      wrap(N.flip(s, ref(t, s), axes), out, s)
    end

    ## Slicing, joining and selection

    # Start indices may be tensors (a slice inside a defn loop, say): they stay on the
    # device, clamped there like Nx clamps them.
    defp n_slice(out, %T{shape: shape} = t, starts, lengths, strides) do
      s = stream([t], t.type)
      x = ref(t, s)

      x =
        if Enum.all?(starts, &is_integer/1),
          do: static_slice(s, x, shape, starts, lengths, strides),
          else: dynamic_slice(s, x, shape, starts, lengths, strides)

      wrap(x, out, s)
    end

    defp static_slice(s, x, shape, starts, lengths, strides) do
      # Nx's lengths count input elements; the output has ceil(len / stride) of them.
      {starts, stops} = Emily.Backend.Ops.slice_bounds(shape, starts, lengths)
      N.slice(s, x, starts, stops, strides)
    end

    defp n_put_slice(%T{type: type} = out, %T{shape: shape} = t, starts, %T{} = update) do
      s = stream([t, update], type)
      x = ref(t, s, type)
      u = ref(update, s, type)

      cond do
        Nx.size(update.shape) == 0 ->
          wrap(x, out, s)

        Enum.all?(starts, &is_integer/1) ->
          lens = Tuple.to_list(update.shape)
          {starts, stops} = Emily.Backend.Ops.slice_bounds(shape, starts, lens)
          ones = List.duplicate(1, tuple_size(shape))
          wrap(N.slice_update(s, x, u, starts, stops, ones), out, s)

        true ->
          axes = Enum.to_list(0..(tuple_size(shape) - 1))
          wrap(N.slice_update_dynamic(s, x, u, starts_tensor(s, starts), axes), out, s)
      end
    end

    defp dynamic_slice(s, x, shape, starts, lengths, strides) do
      axes = Enum.to_list(0..(tuple_size(shape) - 1))
      N.slice_dynamic(s, x, starts_tensor(s, starts), axes, lengths, strides)
    end

    # One s64 vector of the start indices, integers and scalar tensors alike.
    defp starts_tensor(s, starts) do
      parts =
        Enum.map(starts, fn
          i when is_integer(i) -> scalar(s, i, {:s, 64}, {1})
          %T{} = t -> reshape(ref(t, s, {:s, 64}), s, {1})
        end)

      N.concatenate(s, parts, 0)
    end

    defp n_concatenate(%T{type: type} = out, tensors, axis) do
      s = stream(tensors, type)
      wrap(N.concatenate(s, Enum.map(tensors, &ref(&1, s, type)), axis), out, s)
    end

    defp n_stack(%T{type: type} = out, tensors, axis) do
      s = stream(tensors, type)
      wrap(N.stack(s, Enum.map(tensors, &ref(&1, s, type)), axis), out, s)
    end

    defp n_select(%T{type: type} = out, pred, on_true, on_false) do
      s = stream([pred, on_true, on_false], type)
      p = N.astype(s, ref(pred, s), :bool)
      # MLX broadcasts the three like Nx does: the result has `out`'s shape.
      wrap(N.where(s, p, ref(on_true, s, type), ref(on_false, s, type)), out, s)
    end

    defp n_clip(%T{type: type} = out, %T{} = t, %T{} = min, %T{} = max) do
      s = stream([t, min, max], type)
      wrap(N.clip(s, ref(t, s, type), ref(min, s, type), ref(max, s, type)), out, s)
    end

    ## Reductions

    for {name, mlx} <- Emily.Backend.Ops.reduce() do
      defp unquote(:"n_#{name}")(out, t, opts), do: reduction(unquote(mlx), out, t, opts)
    end

    defp n_all(out, t, opts), do: bool_reduction(:all, out, t, opts)
    defp n_any(out, t, opts), do: bool_reduction(:any, out, t, opts)

    defp bool_reduction(op, %T{type: type} = out, %T{} = t, opts) do
      s = stream([t], type)
      args = [ref(t, s), reduce_axes(t, opts[:axes]), opts[:keep_axes] || false]
      {x, _} = Compose.op_as({Eager, s}, op, args, type)
      wrap(x, out, s)
    end

    defp reduction(op, %T{type: type} = out, %T{} = t, opts) do
      s = stream([t], type)
      x = ref(t, s, type)
      x = apply(N, op, [s, x, reduce_axes(t, opts[:axes]), opts[:keep_axes] || false])
      wrap(x, out, s)
    end

    defp reduce_axes(%T{shape: shape}, nil), do: Enum.to_list(0..(tuple_size(shape) - 1)//1)
    defp reduce_axes(_t, axes), do: axes

    @arg_reduce Emily.Backend.Ops.arg_reduce()

    defp n_argmax(out, t, opts), do: arg_reduction(:argmax, out, t, opts)
    defp n_argmin(out, t, opts), do: arg_reduction(:argmin, out, t, opts)

    defp arg_reduction(nx_op, %T{type: type, shape: out_shape} = out, %T{shape: shape} = t, opts) do
      {first, last} = Map.fetch!(@arg_reduce, nx_op)
      op = if opts[:tie_break] == :high, do: last, else: first
      s = stream([t], type)
      x = ref(t, s)

      {x, axis} =
        case opts[:axis] do
          nil -> {reshape(x, s, {Nx.size(shape)}), 0}
          axis -> {x, axis}
        end

      idx = N.astype(s, apply(N, op, [s, x, axis, opts[:keep_axis] || false]), type)
      wrap(reshape(idx, s, out_shape), out, s)
    end

    ## Window reductions

    for op <- Emily.Backend.Ops.window() do
      defp unquote(:"n_#{op}")(%T{type: type} = out, %T{} = t, window, opts) do
        s = stream([t], type)
        args = [s, ref(t, s, type) | Emily.Backend.Ops.window_args(window, opts)]
        wrap(apply(N, unquote(op), args), out, s)
      end
    end

    ## reduce and window_reduce
    #
    # Both take an Elixir function of (element, accumulator), which Nx.BinaryBackend calls
    # once per element. Emily traces it once with Nx.Defn.Expr parameters: where it is one
    # of Nx.add/2, Nx.multiply/2, Nx.max/2 or Nx.min/2 of the two (either order), the
    # reduction is MLX's, combined with the accumulator (and, for window_reduce, padded
    # with it, as Nx pads). Any other function falls back.

    @traced Emily.Backend.Ops.reduce_funs()

    defp n_reduce(%T{type: type} = out, %T{} = t, %T{} = acc, opts, fun) do
      case traced(fun, t.type, acc.type) do
        {_reduce, _window, _combine} = ops ->
          s = stream([t, acc], type)
          axes = reduce_axes(t, opts[:axes])
          [x, acc] = [typed(t, s), typed(acc, s)]
          {y, _} = Compose.reduce({Eager, s}, ops, x, acc, axes, opts[:keep_axes] || false, type)
          wrap(y, out, s)

        nil ->
          fallback(:reduce, [out, t, acc, opts, fun])
      end
    end

    defp n_window_reduce(%T{type: type} = out, %T{} = t, %T{} = acc, window, opts, fun) do
      case traced(fun, t.type, acc.type) do
        {_reduce, _window, _combine} = ops ->
          # (On the stream for the type Nx pads in: the two types merged.)
          s = stream([t, acc], Nx.Type.merge(t.type, acc.type))
          [x, acc] = [typed(t, s), typed(acc, s)]
          {y, _} = Compose.window_reduce({Eager, s}, ops, x, acc, window, opts, type)
          wrap(y, out, s)

        nil ->
          fallback(:window_reduce, [out, t, acc, window, opts, fun])
      end
    end

    defp traced(fun, type, acc_type) do
      a = Nx.Defn.Expr.parameter(:emily, type, {}, 0)
      b = Nx.Defn.Expr.parameter(:emily, acc_type, {}, 1)

      case fun.(a, b) do
        %T{data: %Nx.Defn.Expr{op: op, args: [x, y]}} when is_map_key(@traced, op) ->
          if Enum.sort([parameter(x), parameter(y)]) == [0, 1], do: Map.fetch!(@traced, op)

        _ ->
          nil
      end
    rescue
      # (A function that does more than Nx ops on its arguments, e.g. reads a number.)
      _ -> nil
    end

    defp parameter(%T{data: %Nx.Defn.Expr{op: :parameter, args: [i]}}), do: i
    defp parameter(_), do: nil

    ## Elementwise binary ops

    @arith Emily.Backend.Ops.arith()

    for {name, mlx} <- @arith do
      defp unquote(:"n_#{name}")(out, l, r), do: binary(unquote(mlx), out, l, r)
    end

    @compare Emily.Backend.Ops.compare()

    for {name, mlx} <- @compare do
      defp unquote(:"n_#{name}")(%T{type: type} = out, l, r) do
        s = stream([l, r], type)
        {x, _} = Compose.compare({Eager, s}, unquote(mlx), typed(l, s), typed(r, s), type)
        wrap(x, out, s)
      end
    end

    for {name, mlx} <- Emily.Backend.Ops.logical() do
      defp unquote(:"n_#{name}")(%T{type: type} = out, l, r) do
        s = stream([l, r], type)
        {x, _} = Compose.logical({Eager, s}, unquote(mlx), [typed(l, s), typed(r, s)], type)
        wrap(x, out, s)
      end
    end

    defp binary(op, %T{type: type} = out, l, r) do
      s = stream([l, r], type)
      wrap(apply(N, op, [s, ref(l, s, type), ref(r, s, type)]), out, s)
    end

    ## Elementwise unary ops

    @unary Emily.Backend.Ops.unary()

    for {name, mlx} <- @unary do
      defp unquote(:"n_#{name}")(%T{type: type} = out, %T{} = t) do
        s = stream([t], type)
        wrap(N.unquote(mlx)(s, ref(t, s, type)), out, s)
      end
    end

    # On the CPU, Nx.BinaryBackend's formula, to the last bit (Compose.erf_inv/3); a GPU
    # runs MLX's erfinv in f32.
    defp n_erf_inv(%T{type: type} = out, %T{} = t) do
      s = stream([t], type)

      if Emily.Stream.device(s) == :cpu do
        {y, _} = Compose.erf_inv({Eager, s}, ref(t, s, {:f, 64}), type)
        wrap(y, out, s)
      else
        wrap(N.erfinv(s, ref(t, s, type)), out, s)
      end
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

    for {name, mlx} <- Emily.Backend.Ops.classify() do
      defp unquote(:"n_#{name}")(%T{type: type, shape: shape} = out, %T{} = t) do
        s = stream([t], type)
        {x, _} = Compose.classify({Eager, s}, unquote(mlx), typed(t, s), type, shape)
        wrap(x, out, s)
      end
    end

    ## Linear algebra

    # The table's dot is Nx's dot/7 (batch axes, then each side's free axes); MLX's
    # matmul being floating point only, integer dots multiply and sum, wrapping like Nx.
    defp n_dot(%T{type: type} = out, l, cl, bl, r, cr, br) do
      s = stream([l, r], type)
      x = N.dot(s, ref(l, s, type), cl, bl, ref(r, s, type), cr, br)
      Emily.Debug.check_finite(s, x, :dot)
      wrap(x, out, s)
    end

    ## Indexing, sorting and window scatters

    # :debug_bounds_check (Emily.Debug): raises Emily.Error where an index is outside the
    # axis of `t` it addresses, before the op (whose reads clamp and writes drop such
    # indices). `axes` is one axis, addressed by every index (take, take_along_axis), or a
    # list of k, one per column of the indices' last axis (gather, indexed ops). With the
    # flag off, this expands to `:ok`: not even the sizes are computed.
    defmacrop check_indices(s, indices, t, axes, op) do
      sizes =
        quote do
          case {unquote(t).shape, unquote(axes)} do
            {shape, axis} when is_integer(axis) -> elem(shape, axis)
            {shape, axes} -> Enum.map(axes, &elem(shape, &1))
          end
        end

      quote do
        Emily.Debug.check_bounds(unquote(s), unquote(indices), unquote(sizes), unquote(op))
      end
    end

    defp n_gather(%T{type: type} = out, t, indices, opts) do
      s = stream([t, indices], type)
      i = ref(indices, s)
      check_indices(s, i, t, opts[:axes], :gather)
      wrap(N.gather(s, ref(t, s), i, opts[:axes]), out, s)
    end

    defp n_indexed_put(out, t, indices, updates, opts),
      do: scatter(:indexed_put, out, t, indices, updates, opts)

    defp n_indexed_add(out, t, indices, updates, opts),
      do: scatter(:indexed_add, out, t, indices, updates, opts)

    @scatters Emily.Backend.Ops.scatter()

    defp scatter(op, %T{type: type} = out, t, indices, updates, opts) do
      s = stream([t, indices, updates], type)
      i = ref(indices, s)
      check_indices(s, i, t, opts[:axes], op)
      args = [s, ref(t, s, type), i, ref(updates, s, type), opts[:axes]]
      wrap(apply(N, Map.fetch!(@scatters, op), args), out, s)
    end

    # MLX's (Emily's) sorts are stable in both directions, so :stable needs nothing.
    defp n_sort(%T{type: type} = out, t, opts) do
      s = stream([t], type)
      wrap(N.sort(s, ref(t, s), opts[:axis], opts[:direction] == :desc), out, s)
    end

    defp n_argsort(%T{type: type} = out, t, opts) do
      s = stream([t], type)
      x = N.argsort(s, ref(t, s), opts[:axis], opts[:direction] == :desc)
      wrap(N.astype(s, x, type), out, s)
    end

    defp n_window_scatter_max(out, t, source, init, window, opts),
      do: window_scatter(:window_scatter_max, out, t, source, init, window, opts)

    defp n_window_scatter_min(out, t, source, init, window, opts),
      do: window_scatter(:window_scatter_min, out, t, source, init, window, opts)

    # (Compose.window_scatter/9.)
    defp window_scatter(op, %T{type: type} = out, t, source, init, window, opts) do
      s = stream([t, source, init], type)
      [x, source, init] = Enum.map([t, source, init], &typed(&1, s))
      b = {Eager, s}
      {y, _} = Compose.window_scatter(b, op, x, source, init, window, opts, t.shape, type)
      wrap(y, out, s)
    end

    # MLX convolves real types only; a complex convolution is four real ones (it is
    # bilinear, and Nx's does not conjugate the kernel).
    defp n_conv(%T{type: {:c, _} = type} = out, t, k, opts) do
      s = stream([t, k], type)
      x = ref(t, s, type)
      w = ref(k, s, type)
      {xr, xi, wr, wi} = {N.real(s, x), N.imag(s, x), N.real(s, w), N.imag(s, w)}
      re = N.subtract(s, convolve(s, xr, wr, opts), convolve(s, xi, wi, opts))
      im = N.add(s, convolve(s, xr, wi, opts), convolve(s, xi, wr, opts))
      i = scalar(s, Complex.new(0, 1), type, {})
      x = N.add(s, N.astype(s, re, type), N.multiply(s, N.astype(s, im, type), i))
      wrap(x, out, s)
    end

    defp n_conv(%T{type: type} = out, t, k, opts) do
      s = stream([t, k], type)
      wrap(convolve(s, ref(t, s, type), ref(k, s, type), opts), out, s)
    end

    defp convolve(s, x, w, opts),
      do: apply(N, :conv, [s, x, w | Emily.Backend.Ops.conv_args(opts)])

    ## Linear algebra (LAPACK through MLX)
    #
    # On a CPU worker: MLX's linalg is CPU-only. The LinAlg blocks run in their input's
    # type (f32, f64; eigh and svd also c64), as Nx's own algorithms do; other input types
    # run the block's default (Nx's algorithm, on this backend's ops). triangular_solve,
    # a callback Nx.BinaryBackend computes in f64, computes in f64 for every type and
    # rounds once.

    defp linalg_stream(inputs), do: cpu(stream(inputs, {:f, 64}))
    defp linalg_out(x, %T{type: type} = out, s), do: wrap(N.astype(s, x, type), out, s)

    # Nx's options map onto one lower/upper solve a x = b: a transposed a swaps lower
    # and upper; x a = b is a^T x^T = b^T. A zero on the diagonal raises, as in Nx. In
    # f64 (c64 as f64 parts), as Nx.BinaryBackend solves.
    defp n_triangular_solve(%T{type: type} = out, a, b, opts) do
      s = linalg_stream([a, b])
      rank = tuple_size(a.shape)
      n = elem(a.shape, rank - 1)
      compute = if match?({:c, _}, type), do: {:c, 64}, else: {:f, 64}
      x = ref(a, s, compute)
      y = ref(b, s, compute)
      singular = Emily.Backend.LinAlg.singular?(s, x, compute, rank, n)

      if Emily.to_binary(singular) == <<1>> do
        raise ArgumentError, "can't solve for singular matrix"
      end

      x = if opts[:transform_a] == :conjugate, do: N.conjugate(s, x), else: x
      lower? = opts[:lower]
      left? = opts[:left_side]
      transpose? = opts[:transform_a] == :transpose

      {x, lower?} =
        if transpose? != not left?, do: {swap_last(s, x, rank), not lower?}, else: {x, lower?}

      vector? = tuple_size(b.shape) == rank - 1

      y =
        cond do
          vector? -> N.expand_dims(s, y, [-1])
          left? -> y
          true -> swap_last(s, y, rank)
        end

      r =
        if compute == {:c, 64},
          do: Emily.Backend.LinAlg.complex_triangular_solve(s, x, y, lower?, rank, n),
          else: N.solve_triangular(s, x, y, not lower?)

      r =
        cond do
          vector? -> N.squeeze(s, r, [-1])
          left? -> r
          true -> swap_last(s, r, rank)
        end

      linalg_out(r, out, s)
    end

    defp swap_last(s, x, rank) do
      axes = Enum.to_list(0..(rank - 3)//1) ++ [rank - 1, rank - 2]
      N.transpose(s, x, axes)
    end

    defp n_fft(out, t, opts), do: fft(:fft, out, t, opts)
    defp n_ifft(out, t, opts), do: fft(:ifft, out, t, opts)

    defp fft(op, %T{type: type} = out, t, opts) do
      s = stream([t], type)
      x = apply(N, op, [s, ref(t, s, type), opts[:length], opts[:axis]])
      wrap(clean_fft(s, x, type, opts[:eps]), out, s)
    end

    # Nx.BinaryBackend zeroes the components of transform results within `eps` of zero;
    # so does Emily.
    defp clean_fft(s, x, type, eps) do
      {y, _} = Compose.clean_transform({Eager, s}, x, type, eps)
      y
    end

    # MLX's linalg runs on the CPU only; inputs on a GPU stream are evaluated there and
    # read here.
    defp cpu(s), do: if(Emily.Stream.device(s) == :cpu, do: s, else: Emily.Stream.default(:cpu))

    ## Blocks
    #
    # `block/4` runs a struct natively where `n_block/3` has a clause for it and
    # `native_block?/3` accepts the arguments (types MLX computes with, supported
    # options); anything else runs the struct's default implementation, `fun`.

    @kernel_blocks Map.new(
                     for mod <- [Emily.Fast, Emily.Quantization],
                         struct <- mod.blocks(),
                         do: {struct, mod}
                   )

    @impl true
    def block(struct, out, args, fun) do
      if native_block?(struct, out, args),
        do: n_block(struct, out, args),
        else: apply(fun, [struct | args])
    end

    defp native_block?(%Nx.Block.LogicalNot{}, out, [t]),
      do: native_type?(out) and native_type?(t)

    defp native_block?(%Nx.Block.Phase{}, out, [%T{type: {:c, 64}}]), do: native_type?(out)

    # MLX's isclose is Nx's test (|a - b| <= atol + rtol * |b|, infinities equal only to
    # themselves, NaN per equal_nan); its tolerances are f32 scalars, so half-precision and
    # integer inputs would compute the bound in another type than Nx: those run Nx's own.
    defp native_block?(%Nx.Block.AllClose{}, _out, [%T{type: type}, %T{type: type}]),
      do: type in [{:f, 32}, {:f, 64}]

    defp native_block?(%struct{}, out, [t, i])
         when struct in [Nx.Block.Take, Nx.Block.TakeAlongAxis],
         do: native_type?(out) and native_type?(t) and native_type?(i)

    defp native_block?(%Nx.Block.TopK{}, {v, i}, [%T{type: {kind, _}} = t]),
      do: native_type?(v) and native_type?(i) and native_type?(t) and kind != :c

    defp native_block?(%struct{}, out, [t])
         when struct in [
                Nx.Block.CumulativeSum,
                Nx.Block.CumulativeProduct,
                Nx.Block.CumulativeMin,
                Nx.Block.CumulativeMax
              ],
         do: native_type?(out) and native_type?(t)

    defp native_block?(%struct{}, %T{type: {kind, _}} = out, [t])
         when struct in [Nx.Block.FFT2, Nx.Block.IFFT2, Nx.Block.RFFT, Nx.Block.IRFFT],
         do: native_type?(out) and native_type?(t) and kind in [:c, :f]

    # LAPACK through MLX: real types (eigh and svd also c64). QR's :complete mode is
    # the reduced one for m <= n; MLX has no complete Q for m > n.
    defp native_block?(%Nx.Block.LinAlg.QR{mode: mode}, _out, [%T{shape: shape} = t]) do
      rank = tuple_size(shape)
      real?(t) and (mode == :reduced or elem(shape, rank - 2) <= elem(shape, rank - 1))
    end

    defp native_block?(%struct{}, _out, [t])
         when struct in [Nx.Block.LinAlg.Eigh, Nx.Block.LinAlg.SVD],
         do: real?(t) or t.type == {:c, 64}

    defp native_block?(%struct{}, _out, [t])
         when struct in [
                Nx.Block.LinAlg.Cholesky,
                Nx.Block.LinAlg.LU,
                Nx.Block.LinAlg.Determinant
              ],
         do: real?(t)

    defp native_block?(%Nx.Block.LinAlg.Solve{}, _out, [a, b]), do: real?(a) and real?(b)

    # Emily.Fast's fused kernels and Emily.Quantization's dequantize and quantized
    # matmul: their module's native_call/3 names the Native op and the casts of its
    # arguments (nil where the block runs its default).
    defp native_block?(%struct{} = block, out, args) when is_map_key(@kernel_blocks, struct),
      do:
        native_type?(out) and native_inputs?(args) and
          @kernel_blocks[struct].native_call(block, out, args) != nil

    defp native_block?(_struct, _out, _args), do: false

    defp n_block(%Nx.Block.LogicalNot{}, %T{type: type} = out, [t]) do
      s = stream([t], type)
      {x, _} = Compose.logical({Eager, s}, :logical_not, [typed(t, s)], type)
      wrap(x, out, s)
    end

    defp n_block(%Nx.Block.AllClose{} = o, %T{type: type} = out, [a, b]) do
      s = stream([a, b], a.type)
      args = [ref(a, s), ref(b, s), o.rtol, o.atol, !!o.equal_nan]
      {x, _} = Compose.op_as({Eager, s}, :allclose, args, type)
      wrap(x, out, s)
    end

    defp n_block(%Nx.Block.Phase{}, %T{type: type} = out, [t]) do
      s = stream([t], type)
      x = ref(t, s)
      wrap(N.arctan2(s, N.imag(s, x), N.real(s, x)), out, s)
    end

    defp n_block(%Nx.Block.Take{axis: axis}, %T{type: type} = out, [t, indices]) do
      s = stream([t, indices], type)
      i = ref(indices, s)
      check_indices(s, i, t, axis, :take)
      wrap(N.take(s, ref(t, s), i, axis), out, s)
    end

    defp n_block(%Nx.Block.TakeAlongAxis{axis: axis}, %T{type: type} = out, [t, indices]) do
      s = stream([t, indices], type)
      i = ref(indices, s)
      check_indices(s, i, t, axis, :take_along_axis)
      wrap(N.take_along_axis(s, ref(t, s), i, axis), out, s)
    end

    defp n_block(%Nx.Block.TopK{k: k}, {%T{type: vt} = v, %T{type: it} = i}, [t]) do
      s = stream([t], vt)
      [values, indices] = N.topk_sorted(s, ref(t, s, vt), k, -1)
      {wrap(values, v, s), wrap(N.astype(s, indices, it), i, s)}
    end

    @scans Emily.Backend.Ops.scan()

    defp n_block(%struct{axis: axis, reverse: reverse}, %T{type: type} = out, [t])
         when is_map_key(@scans, struct) do
      s = stream([t], type)
      scan = Map.fetch!(@scans, struct)
      {x, _} = Compose.scan({Eager, s}, scan, typed(t, s), axis, reverse, type)
      wrap(x, out, s)
    end

    defp n_block(%Nx.Block.FFT2{lengths: n, axes: axes, eps: eps}, out, [t]),
      do: fft_block(:fft2, out, t, [n, axes], eps)

    defp n_block(%Nx.Block.IFFT2{lengths: n, axes: axes, eps: eps}, out, [t]),
      do: fft_block(:ifft2, out, t, [n, axes], eps)

    defp n_block(%Nx.Block.RFFT{length: n, axis: axis, eps: eps}, out, [t]),
      do: fft_block(:rfft, out, t, [n, axis], eps)

    defp n_block(%Nx.Block.IRFFT{length: n, axis: axis, eps: eps}, out, [t]),
      do: fft_block(:irfft, out, t, [n, axis], eps)

    defp n_block(%Nx.Block.LinAlg.Cholesky{}, out, [t]) do
      s = linalg_stream([t])
      linalg_out(N.cholesky(s, ref(t, s), false), out, s)
    end

    defp n_block(%Nx.Block.LinAlg.Solve{}, out, [a, b]) do
      s = linalg_stream([a, b])
      linalg_out(N.solve(s, ref(a, s), ref(b, s)), out, s)
    end

    defp n_block(%Nx.Block.LinAlg.QR{eps: eps}, {q_out, r_out}, [t]) do
      s = linalg_stream([t])
      {q, r} = Emily.Backend.LinAlg.qr(s, ref(t, s), t.type, t.shape, eps)
      {linalg_out(q, q_out, s), linalg_out(r, r_out, s)}
    end

    defp n_block(%Nx.Block.LinAlg.Eigh{eps: eps}, {vals_out, vecs_out}, [t]) do
      s = linalg_stream([t])
      x = ref(t, s)
      {vals, vecs} = Emily.Backend.LinAlg.eigh(s, x, t.type, t.shape, eps)
      {linalg_out(vals, vals_out, s), linalg_out(vecs, vecs_out, s)}
    end

    defp n_block(%Nx.Block.LinAlg.SVD{full_matrices?: full?}, {u_out, s_out, vt_out}, [t]) do
      s = linalg_stream([t])
      [u, sv, vt] = Emily.Backend.LinAlg.svd(s, ref(t, s), t.type, t.shape)
      # MLX returns the full U and Vt; Nx's shapes say how much of them to keep.
      {u, vt} =
        if full?,
          do: {u, vt},
          else:
            Emily.Backend.LinAlg.reduced(
              s,
              crop(s, u, u_out.shape),
              sv,
              crop(s, vt, vt_out.shape),
              t.type,
              t.shape
            )

      {linalg_out(u, u_out, s), linalg_out(sv, s_out, s), linalg_out(vt, vt_out, s)}
    end

    # MLX gives pivots with a = (l @ u)[pivots]; Nx wants the matrix p with a = p.l.u.
    defp n_block(%Nx.Block.LinAlg.LU{}, {p_out, l_out, u_out}, [t]) do
      s = linalg_stream([t])
      [pivots, l, u] = N.lu(s, ref(t, s))
      n = elem(p_out.shape, tuple_size(p_out.shape) - 1)
      columns = N.arange(s, 0, n, 1, {:u, 32})
      p = N.equal(s, N.expand_dims(s, N.astype(s, pivots, {:u, 32}), [-1]), columns)
      {linalg_out(p, p_out, s), linalg_out(l, l_out, s), linalg_out(u, u_out, s)}
    end

    # MLX's det has closed forms up to 3x3 (as Nx), then goes through exp, which has
    # f32 accuracy on f64: from the LU instead.
    defp n_block(%Nx.Block.LinAlg.Determinant{}, out, [%T{shape: shape} = t]) do
      s = linalg_stream([t])
      rank = tuple_size(shape)
      n = elem(shape, rank - 1)
      x = ref(t, s)
      d = if n <= 3, do: N.det(s, x), else: Emily.Backend.LinAlg.det(s, x, rank, n)
      linalg_out(d, out, s)
    end

    # Emily.Fast's and Emily.Quantization's blocks: the MLX op their module's
    # native_call/3 names, with the casts of its arguments.
    defp n_block(%struct{} = block, %T{type: type} = out, args)
         when is_map_key(@kernel_blocks, struct) do
      {op, spec} = @kernel_blocks[struct].native_call(block, out, args)
      s = stream(args, type)
      inputs = List.to_tuple(args)

      call_args =
        Enum.map(spec, fn
          {:arg, i, arg_type} -> ref(elem(inputs, i), s, arg_type)
          other -> other
        end)

      x = apply(N, op, [s | call_args])
      if Emily.Debug.checks_finite?(op), do: Emily.Debug.assert_finite!(s, x, op)
      wrap(x, out, s)
    end

    defp fft_block(op, %T{type: type} = out, t, args, eps) do
      s = stream([t], type)
      input = if op in [:rfft], do: ref(t, s), else: ref(t, s, complex_of(t.type))
      x = apply(N, op, [s, input | args])
      wrap(clean_fft(s, x, type, eps), out, s)
    end

    defp complex_of({:c, _} = type), do: type
    defp complex_of(_), do: {:c, 64}

    defp real?(%T{type: type}), do: type in [{:f, 32}, {:f, 64}]

    defp crop(s, x, shape) do
      rank = tuple_size(shape)
      N.slice(s, x, List.duplicate(0, rank), Tuple.to_list(shape), List.duplicate(1, rank))
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

    # The MLX array of `t` usable on stream `s`. One lazy on another stream needs no
    # care here: Emily.Native evaluates it on its own stream first, without blocking
    # the caller.
    defp ref(%T{data: %B{ref: ref}}, _s), do: ref

    defp ref(%T{type: type, shape: shape} = t, s) do
      from_nx_binary(s, Nx.to_binary(t), type, shape)
    end

    # ... converted to `type` (a plain MLX cast: Nx's rules for non-finite values only
    # apply to `as_type/2`).
    defp ref(%T{type: type} = t, s, type), do: ref(t, s)
    defp ref(%T{} = t, s, type), do: N.astype(s, ref(t, s), type)

    # `t`'s array on `s` with its type, as Emily.Backend.Compose takes its values.
    defp typed(%T{type: type} = t, s), do: {ref(t, s), type}

    # (Counted for the process's collection: Emily.Memory.created/1.)
    defp wrap(ref, %T{} = out, s) do
      Emily.Memory.created(Nx.byte_size(out))
      %{out | data: %B{ref: check(ref, out), stream: s}}
    end

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

    defp scalar(s, value, type, shape), do: Eager.scalar(s, value, type, shape)

    defp reshape(x, s, shape), do: N.reshape(s, x, shape)
    defp broadcast_to(x, s, shape), do: N.broadcast_to(s, x, shape)

    defp unzip3(list) do
      {Enum.map(list, &elem(&1, 0)), Enum.map(list, &elem(&1, 1)), Enum.map(list, &elem(&1, 2))}
    end

    # [from, from + len) along `axis` of a rank-`rank` array, all of the other axes.
    defp slice_axis(s, x, axis, from, len, rank) do
      big = 2_147_483_647
      starts = List.duplicate(0, rank) |> List.replace_at(axis, from)
      stops = List.duplicate(big, rank) |> List.replace_at(axis, from + len)
      N.slice(s, x, starts, stops, List.duplicate(1, rank))
    end

    ## Generated callbacks (see "Dispatch" above)

    generated =
      for {name, arity} <- Enum.sort(Nx.Backend.behaviour_info(:callbacks)),
          not Module.defines?(__MODULE__, {name, arity}, :def),
          do: {name, arity, Module.defines?(__MODULE__, {:"n_#{name}", arity})}

    @fallbacks for {name, _, false} <- generated, do: {name, "no native path"}

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
    the reason (none: every callback has a native path; see "Fallbacks" in the module
    documentation for the types and arguments that still fall back).
    """
    @spec fallbacks() :: [{atom, String.t()}]
    def fallbacks, do: @fallbacks
  end
end
