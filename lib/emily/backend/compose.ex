if Code.ensure_loaded?(Nx) do
  defmodule Emily.Backend.Compose do
    @moduledoc false
    # The Nx ops MLX computes as several ops, each composition written once for both
    # Emily.Backend (which runs it op by op on a stream) and Emily.Compiler's native path
    # (which emits it as a program's instructions), so that both compute the same MLX
    # ops. A composition takes a builder, `{module, state}`, and returns
    # `{value, builder}`; the module makes each op, scalar and type limit:
    # Emily.Backend.Compose.Eager (the state a stream, values arrays) and
    # Emily.Compiler.Native.Ops (the lowering's state, values slots). Ops are the op
    # table's, with its arguments after the stream.

    @type builder :: {module, term}

    @doc "The op table's op `name` on `args`."
    @callback op(state, name :: atom, args :: list) :: {value :: term, state} when state: term

    @doc "A scalar of `type` that holds `value` (a number, `Complex`, or a non-finite atom) exactly."
    @callback scalar(state, value :: term, Nx.Type.t()) :: {value :: term, state} when state: term

    @doc "The least or greatest finite value of an integer `type`, as a scalar."
    @callback limit(state, :min | :max, Nx.Type.t()) :: {value :: term, state} when state: term

    # Giles' single-precision erf_inv (Nx.BinaryBackend's, Complex.erf_inv): the
    # polynomials for w < 5 and for w >= 5, highest power first.
    @erf_inv_small [2.81022636e-08, 3.43273939e-07, -3.5233877e-06, -4.39150654e-06] ++
                     [0.00021858087, -0.00125372503, -0.00417768164, 0.246640727, 1.50140941]
    @erf_inv_large [-0.000200214257, 0.000100950558, 0.00134934322, -0.00367342844] ++
                     [0.00573950773, -0.0076224613, 0.00943887047, 1.00167406, 2.83297682]

    defp op({mod, state}, name, args), do: rebuild(mod, mod.op(state, name, args))

    defp scalar({mod, state}, value, type), do: rebuild(mod, mod.scalar(state, value, type))

    defp limit({mod, state}, which, type), do: rebuild(mod, mod.limit(state, which, type))

    defp rebuild(mod, {value, state}), do: {value, {mod, state}}

    # Nx's `as_type` of `x` from `from` to `to`: floats to integers truncate, NaN becomes
    # 0 and infinities the type's limits; complex to integer takes the real part (complex
    # to float too, which MLX's cast does).
    def cast(b, x, type, type), do: {x, b}

    def cast(b, x, {:c, _}, {k, _} = to) when k in [:u, :s] do
      {re, b} = op(b, :real, [x])
      cast(b, re, {:f, 32}, to)
    end

    def cast(b, x, {k, _} = from, {ik, _} = to) when k in [:f, :bf] and ik in [:u, :s] do
      {y, b} = op(b, :astype, [x, to])
      {nan, b} = op(b, :isnan, [x])
      {zero, b} = scalar(b, 0, to)
      {y, b} = op(b, :where, [nan, zero, y])
      {inf, b} = scalar(b, :infinity, from)
      {above, b} = op(b, :equal, [x, inf])
      {max, b} = limit(b, :max, to)
      {y, b} = op(b, :where, [above, max, y])
      {neg_inf, b} = op(b, :negative, [inf])
      {below, b} = op(b, :equal, [x, neg_inf])
      {min, b} = limit(b, :min, to)
      op(b, :where, [below, min, y])
    end

    def cast(b, x, _from, to), do: op(b, :astype, [x, to])

    # Nx.BinaryBackend's `erf_inv` of `z` (f64), as `type`: Giles' single-precision
    # approximation (Complex.erf_inv) evaluated in f64 and rounded once, so that it agrees
    # with Nx.BinaryBackend to the last bit, on f64 too (where MLX's `erfinv` has f32
    # accuracy). For streams that compute f64 (the CPU).
    def erf_inv(b, z, type) do
      f64 = {:f, 64}
      {one, b} = scalar(b, 1, f64)
      {below_one, b} = op(b, :subtract, [one, z])
      {above_minus_one, b} = op(b, :add, [one, z])
      {product, b} = op(b, :multiply, [below_one, above_minus_one])
      {log, b} = op(b, :log, [product])
      {w, b} = op(b, :negative, [log])
      {c, b} = scalar(b, 2.5, f64)
      {w_small, b} = op(b, :subtract, [w, c])
      {small, b} = horner(b, @erf_inv_small, w_small)
      {sqrt_w, b} = op(b, :sqrt, [w])
      {c, b} = scalar(b, 3, f64)
      {w_large, b} = op(b, :subtract, [sqrt_w, c])
      {large, b} = horner(b, @erf_inv_large, w_large)
      {c, b} = scalar(b, 5, f64)
      {small_w, b} = op(b, :less, [w, c])
      {poly, b} = op(b, :where, [small_w, small, large])
      {y, b} = op(b, :multiply, [poly, z])
      {y, b} = at(b, y, z, 1, :infinity)
      {y, b} = at(b, y, z, -1, :neg_infinity)
      op(b, :astype, [y, type])
    end

    # Nx.BinaryBackend's cleaning of a transform's result `x` of `type` with its `:eps`:
    # each component within `eps` of zero set to zero (which also turns -0.0 into 0.0).
    def clean_transform(b, x, _type, nil), do: {x, b}

    def clean_transform(b, x, {:c, bits} = type, eps) do
      real = {:f, div(bits, 2)}
      {re, b} = op(b, :real, [x])
      {re, b} = clean(b, re, real, eps)
      {re, b} = op(b, :astype, [re, type])
      {im, b} = op(b, :imag, [x])
      {im, b} = clean(b, im, real, eps)
      {im, b} = op(b, :astype, [im, type])
      {i, b} = scalar(b, Complex.new(0, 1), type)
      {im, b} = op(b, :multiply, [im, i])
      op(b, :add, [re, im])
    end

    def clean_transform(b, x, type, eps), do: clean(b, x, type, eps)

    defp clean(b, x, type, eps) do
      {magnitude, b} = op(b, :abs, [x])
      {tol, b} = scalar(b, eps, type)
      {small, b} = op(b, :less_equal, [magnitude, tol])
      {zero, b} = scalar(b, 0, type)
      op(b, :where, [small, zero, x])
    end

    # `x` (a `{value, type}`) as `to`: MLX's cast where the types differ, the cast both
    # paths apply to an op's operands.
    def operand(b, {x, to}, to), do: {x, b}
    def operand(b, {x, _from}, to), do: op(b, :astype, [x, to])

    # The op table's ops whose result is MLX's bool.
    @bool_ops Map.values(Emily.Backend.Ops.compare()) ++
                Map.values(Emily.Backend.Ops.logical()) ++
                Map.values(Emily.Backend.Ops.classify()) ++
                [:logical_not, :all, :any, :allclose]

    @doc "The op table's ops whose result is MLX's bool."
    def bool_ops, do: @bool_ops

    # `op` (the op table's) on `args`, cast to Nx's `type`: MLX answers comparisons and
    # logical ops in bool (Nx in u8), and keeps 8- and 16-bit integers in its scans. (A
    # bool result wanted as bool, a predicate's, needs no cast.)
    def op_as(b, name, args, :bool) when name in @bool_ops, do: op(b, name, args)

    def op_as(b, name, args, type) do
      {y, b} = op(b, name, args)
      op(b, :astype, [y, type])
    end

    # A comparison (`name`, the op table's) of `l` and `r` in their two types merged.
    def compare(b, name, {_, lt} = l, {_, rt} = r, type) do
      common = Nx.Type.merge(lt, rt)
      {l, b} = operand(b, l, common)
      {r, b} = operand(b, r, common)
      op_as(b, name, [l, r], type)
    end

    # A logical op (`name`, the op table's) of its `args` read as booleans.
    def logical(b, name, args, type) do
      {args, b} = Enum.map_reduce(args, b, &operand(&2, &1, :bool))
      op_as(b, name, args, type)
    end

    # `is_nan` or `is_infinity` (`name`: MLX's isnan or isinf) of `x` as `type` and
    # `shape`: no integer is either.
    def classify(b, _name, {_x, {k, _}}, type, shape) when k in [:u, :s],
      do: op(b, :full, [shape, 0, type])

    def classify(b, name, {x, _}, type, _shape), do: op_as(b, name, [x], type)

    # A cumulative op (`name`, the op table's scan) of `x` along `axis`, inclusive, in
    # and as `type`.
    def scan(b, name, x, axis, reverse, type) do
      {x, b} = operand(b, x, type)
      op_as(b, name, [x, axis, reverse, true], type)
    end

    # Nx's `iota` of `type` and `shape`, counting along `axis` (or, with nil, through the
    # whole shape). MLX's arange steps in its dtype, where 16-bit floats lose integers
    # early: they count in s32 and round once, as Nx does; complex counts in f32.
    def iota(b, shape, axis, type) do
      n = if axis == nil, do: Tuple.product(shape), else: elem(shape, axis)

      {x, b} =
        case type do
          {k, 16} when k in [:f, :bf] -> count(b, n, {:s, 32}, type)
          {:c, _} -> count(b, n, {:f, 32}, type)
          _ -> op(b, :arange, [0, n, 1, type])
        end

      if axis == nil do
        op(b, :reshape, [x, shape])
      else
        along = 1 |> Tuple.duplicate(tuple_size(shape)) |> put_elem(axis, n)
        {x, b} = op(b, :reshape, [x, along])
        op(b, :broadcast_to, [x, shape])
      end
    end

    defp count(b, n, counter, type), do: op_as(b, :arange, [0, n, 1, counter], type)

    # Nx's `reduce` whose function is one op of its two arguments (`ops`, from
    # Emily.Backend.Ops.reduce_funs/0): MLX's reduction over `axes`, combined with the
    # accumulator. `x` and `acc` are `{value, type}`.
    def reduce(b, {reduce, _window, combine}, x, acc, axes, keep_axes, type) do
      {x, b} = operand(b, x, type)
      {y, b} = op(b, reduce, [x, axes, keep_axes])
      {y, b} = op(b, :astype, [y, type])
      {acc, b} = operand(b, acc, type)
      op(b, combine, [y, acc])
    end

    # The same over windows: the tensor padded with the accumulator (in the two types
    # merged, as Nx pads), MLX's window reduction, combined with the accumulator.
    def window_reduce(b, {_reduce, window_op, combine}, x, acc, window, opts, type) do
      padded = Nx.Type.merge(elem(x, 1), elem(acc, 1))
      {lo, hi} = Enum.unzip(opts[:padding])
      zeros = List.duplicate(0, tuple_size(window))
      {init, b} = operand(b, acc, padded)
      {x, b} = operand(b, x, padded)
      {x, b} = op(b, :pad, [x, init, lo, hi, zeros])
      args = [x, Tuple.to_list(window), opts[:strides], zeros, zeros, opts[:window_dilations]]
      {y, b} = op(b, window_op, args)
      {y, b} = op(b, combine, [y, init])
      op(b, :astype, [y, type])
    end

    # `window_scatter_max` and `_min` (`scatter`) of `x` of `shape`: Nx pads the tensor
    # with the init value, and a padded place can win a window (its update then dropped),
    # while MLX's op never selects its own padding; so the tensor is padded as Nx pads it
    # and the result cropped back. `x`, `source` and `init` are `{value, type}`.
    def window_scatter(b, scatter, x, source, init, window, opts, shape, type) do
      rank = tuple_size(window)
      {lo, hi} = Enum.unzip(opts[:padding])
      zeros = List.duplicate(0, rank)
      padded? = Enum.any?(opts[:padding], &(&1 != {0, 0}))

      {x, b} =
        if padded? do
          pad_type = window_scatter_pad_type(elem(x, 1), elem(init, 1))
          {x, b} = operand(b, x, pad_type)
          {value, b} = operand(b, init, pad_type)
          op(b, :pad, [x, value, lo, hi, zeros])
        else
          {elem(x, 0), b}
        end

      {source, b} = operand(b, source, type)
      {init, b} = operand(b, init, type)
      args = [x, source, init, Tuple.to_list(window), opts[:strides], zeros, zeros]
      {y, b} = op(b, scatter, args)

      if padded? do
        stops = Enum.zip_with(lo, Tuple.to_list(shape), &(&1 + &2))
        op(b, :slice, [y, lo, stops, List.duplicate(1, rank)])
      else
        {y, b}
      end
    end

    # The type a window scatter pads its tensor in: an integer tensor with a float init
    # value compares in floating point.
    defp window_scatter_pad_type({k, _} = type, {f, _}) when k in [:u, :s] and f in [:f, :bf],
      do: Nx.Type.merge_number(type, 0.0)

    defp window_scatter_pad_type(type, _init_type), do: type

    # The polynomial of `coefficients` (highest power first) at `x`, in f64.
    defp horner(b, [first | rest], x) do
      Enum.reduce(rest, scalar(b, first, {:f, 64}), fn coefficient, {acc, b} ->
        {product, b} = op(b, :multiply, [acc, x])
        {c, b} = scalar(b, coefficient, {:f, 64})
        op(b, :add, [product, c])
      end)
    end

    # `y`, with `value` where `z` is `point` (both f64).
    defp at(b, y, z, point, value) do
      {p, b} = scalar(b, point, {:f, 64})
      {hit, b} = op(b, :equal, [z, p])
      {v, b} = scalar(b, value, {:f, 64})
      op(b, :where, [hit, v, y])
    end
  end

  defmodule Emily.Backend.Compose.Eager do
    @moduledoc false
    # Emily.Backend.Compose's builder for Emily.Backend: each op an Emily.Native call on
    # the stream, each scalar its exact bytes.
    @behaviour Emily.Backend.Compose

    alias Emily.Native, as: N

    @impl true
    def op(s, name, args), do: {apply(N, name, [s | args]), s}

    @impl true
    def scalar(s, value, type), do: {scalar(s, value, type, {}), s}

    @impl true
    def limit(s, :max, type), do: {N.from_binary(s, Nx.Type.max_finite_binary(type), {}, type), s}
    def limit(s, :min, type), do: {N.from_binary(s, Nx.Type.min_finite_binary(type), {}, type), s}

    # A constant of `type` and `shape` on `s`: one `full` where a double holds the value,
    # else its exact bytes (broadcast).
    def scalar(s, value, {kind, _} = type, shape) when kind in [:u, :s] do
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

    def scalar(s, value, {:c, _} = type, shape) do
      value =
        case value do
          %Complex{} -> value
          v -> Complex.new(v, 0.0)
        end

      x = N.from_binary(s, Emily.Codec.pack([value], type), {}, type)
      if shape == {}, do: x, else: N.broadcast_to(s, x, shape)
    end

    def scalar(s, value, type, shape) do
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
  end
end
