defmodule Emily.Backend.LinAlg do
  @moduledoc false
  # Nx's linear algebra conventions on top of MLX's (LAPACK's) decompositions, for
  # Emily.Backend. Every function takes MLX arrays on a CPU stream `s` (MLX's linalg is
  # CPU-only) in the type to compute in, and returns MLX arrays.

  alias Emily.Native, as: N

  @doc """
  `{q, r}` of the reduced QR decomposition of `a` (`{..., m, n}`), with Nx's signs.

  Nx's Householder QR (Nx.LinAlg.QR) reflects each column `x` onto `+|x| e_i`, so R's
  diagonal is positive, except where it does not reflect: a column whose part below the
  diagonal is already zero (sum of squares below `eps`) keeps its sign, and so does the
  last column of a square or wide matrix (never reflected). LAPACK reflects onto
  `-sign(x_i) |x| e_i` and skips the same zero columns. QR being unique up to the signs
  of R's rows (and Q's columns), the signs are moved to Nx's:

    * the leading columns that are already upper triangular are not reflected by either
      and keep their signs;
    * every later column is taken as reflected: its R diagonal is made non-negative;
    * for `m <= n`, the last column gets the sign that makes det(Q) that of Nx's Q, a
      product of one reflection (det -1) per reflected column.

  (Columns that only become upper triangular after earlier reflections are taken as
  reflected, which Nx may not do: their signs can differ from Nx's.) Entries within
  `eps` of zero become 0, as in Nx.
  """
  def qr(s, a, type, shape, eps) do
    rank = tuple_size(shape)
    m = elem(shape, rank - 2)
    n = elem(shape, rank - 1)
    k = min(m, n)
    [q, r] = N.qr(s, a)

    # Sum of squares below the diagonal, per column: < eps means nothing to reflect.
    rows = N.reshape(s, N.arange(s, 0, m, 1, {:s, 32}), {m, 1})
    cols = N.reshape(s, N.arange(s, 0, n, 1, {:s, 32}), {1, n})
    sq = N.where(s, N.greater(s, rows, cols), N.multiply(s, a, a), num(s, 0, type))
    flat = N.less(s, first(s, N.sum(s, sq, [-2], false), rank - 1, k), num(s, eps, type))
    kept = N.cumprod(s, N.astype(s, flat, type), -1, false, true)

    # Kept columns: R's diagonal with the input's sign (LAPACK may still reflect a
    # column whose part below the diagonal is tiny but not zero). Reflected columns:
    # R's diagonal non-negative.
    want =
      N.where(
        s,
        N.astype(s, kept, :bool),
        signs(s, diagonal(s, a, rank, k), type),
        num(s, 1, type)
      )

    d = N.multiply(s, want, signs(s, diagonal(s, r, rank, k), type))

    d =
      if m <= n and k > 1 do
        # The last column: the sign making det(Q) that of Nx's Q, which has one
        # reflection (det -1) per reflected column among the first k - 1.
        head = first(s, d, rank - 1, k - 1)

        reflected =
          N.subtract(
            s,
            num(s, k - 1, type),
            N.sum(s, first(s, kept, rank - 1, k - 1), [-1], true)
          )

        two = num(s, 2, type)

        parity =
          N.subtract(s, num(s, 1, type), N.multiply(s, two, N.remainder(s, reflected, two)))

        det_q = N.expand_dims(s, signs(s, N.det(s, q), type), [-1])
        last = N.multiply(s, N.multiply(s, parity, det_q), N.prod(s, head, [-1], true))
        N.concatenate(s, [head, last], -1)
      else
        d
      end

    q = N.multiply(s, q, N.expand_dims(s, d, [-2]))
    r = N.multiply(s, r, N.expand_dims(s, d, [-1]))
    {zap(s, q, eps, type), zap(s, r, eps, type)}
  end

  @doc """
  `{eigenvalues, eigenvectors}` of the Hermitian `a` (`{..., n, n}`, its lower triangle)
  in Nx's order: by decreasing magnitude (LAPACK's is ascending), entries within `eps`
  of zero set to 0, as Nx.LinAlg.BlockEigh does. Real eigenvectors have the signs of
  `canonical_signs/4`, which `svd/4` gives its singular vectors too.
  """
  def eigh(s, a, type, shape, eps) do
    [vals, vecs] = N.eigh(s, a, "L")
    order = N.argsort(s, N.abs(s, vals), -1, true)
    vals = N.take_along_axis(s, vals, order, -1)
    columns = N.broadcast_to(s, N.expand_dims(s, order, [-2]), shape)
    vecs = N.take_along_axis(s, vecs, columns, -1)

    {real, vecs} =
      case type do
        {:c, _} -> {{:f, 32}, vecs}
        _ -> {type, N.multiply(s, vecs, canonical_signs(s, vecs, -2, type))}
      end

    {zap(s, vals, eps, real), zap(s, vecs, eps, type)}
  end

  @doc """
  `[u, s, vt]` of the SVD of the real `a` (`{..., m, n}`; MLX's full U and Vt), each
  pair of singular vectors signed so that the vectors of the smaller side (Vt's rows for
  m >= n, U's columns for m < n) have `canonical_signs/4`.

  Nx differentiates an SVD through its default algorithm, which takes those vectors
  from an eigendecomposition (`eigh/5` here, on this backend) and the others from them,
  while the forward result comes from LAPACK's SVD: a sign fixed by the vectors alone,
  the same in both, keeps the gradient about the singular vectors the forward pass
  reports. The remaining columns of a full U (rows of a full Vt) keep LAPACK's signs.
  """
  def svd(s, a, type, shape) do
    [u, sv, vt] = N.svd(s, a)
    rank = tuple_size(shape)
    m = elem(shape, rank - 2)
    n = elem(shape, rank - 1)
    k = min(m, n)

    d =
      if m >= n,
        do: N.squeeze(s, canonical_signs(s, first(s, vt, rank, k, 2), -1, type), [-1]),
        else: N.squeeze(s, canonical_signs(s, u, -2, type), [-2])

    u = N.multiply(s, u, N.expand_dims(s, pad_ones(s, d, rank - 1, m - k, type), [-2]))
    vt = N.multiply(s, vt, N.expand_dims(s, pad_ones(s, d, rank - 1, n - k, type), [-1]))
    [u, sv, vt]
  end

  @doc """
  The reduced SVD's `{u, vt}` (`{..., m, k}`, `{..., k, n}`) as Nx's reduced SVD gives
  them: the vectors of the larger side (U's columns for m >= n, Vt's rows for m < n)
  are zero where their singular value is at most k * 1.1920929e-7 * the largest one.
  Nx computes those vectors as a v / s with 1 / s taken as 0 there, and
  Nx.LinAlg.pinv/2, whose cutoff (1e-10) is below LAPACK's f32 rounding of a zero
  singular value, relies on it.
  """
  def reduced(s, u, sv, vt, type, shape) do
    rank = tuple_size(shape)
    m = elem(shape, rank - 2)
    n = elem(shape, rank - 1)
    k = min(m, n)
    top = first(s, sv, rank - 1, 1)
    cutoff = N.multiply(s, top, num(s, k * 1.1920929e-7, type))
    keep = N.astype(s, N.greater(s, sv, cutoff), type)

    if m >= n,
      do: {N.multiply(s, u, N.expand_dims(s, keep, [-2])), vt},
      else: {u, N.multiply(s, vt, N.expand_dims(s, keep, [-1]))}
  end

  # Per vector along `axis` of the real `x`: the sign (1 or -1, keeping `axis` as size
  # 1) that makes its entry of largest magnitude positive. Of entries within a relative
  # 1e-3 of that magnitude the first counts, so that two computations of one vector,
  # equal up to rounding, pick the same entry (vectors such as [1, -1] / sqrt(2)).
  defp canonical_signs(s, x, axis, type) do
    mag = N.abs(s, x)
    top = N.max(s, mag, [axis], true)
    near = N.greater_equal(s, mag, N.multiply(s, top, num(s, 1 - 1.0e-3, type)))
    at = N.argmax(s, N.astype(s, near, {:s, 32}), axis, true)
    signs(s, N.take_along_axis(s, x, at, axis), type)
  end

  # `x` (rank `rank`) with `extra` ones appended along its last axis.
  defp pad_ones(_s, x, _rank, 0, _type), do: x

  defp pad_ones(s, x, rank, extra, type) do
    zeros = List.duplicate(0, rank)
    N.pad(s, x, num(s, 1, type), zeros, List.replace_at(zeros, rank - 1, extra), zeros)
  end

  @doc "det(a) from LAPACK's LU: the product of U's diagonal, negated per row swap."
  def det(s, a, rank, n) do
    [lu, pivots] = N.lu_factor(s, a)
    swaps = N.not_equal(s, pivots, N.arange(s, 0, n, 1, {:u, 32}))
    swaps = N.sum(s, N.astype(s, swaps, {:s, 32}), [-1], false)
    odd = N.astype(s, N.remainder(s, swaps, num(s, 2, {:s, 32})), :bool)
    d = N.prod(s, diagonal(s, lu, rank, n), [-1], false)
    N.where(s, odd, N.negative(s, d), d)
  end

  @doc "Whether a diagonal of `a` (`{..., n, n}`) has a zero, as a boolean scalar."
  def singular?(s, a, type, rank, n),
    do:
      N.any(
        s,
        N.equal(s, diagonal(s, a, rank, n), num(s, 0, type)),
        Enum.to_list(0..(rank - 2)),
        false
      )

  @doc """
  Solves a x = b for a complex lower (or upper) triangular `a` (`{..., n, n}`, the other
  triangle ignored) and `b` (`{..., n, k}`): MLX's solvers are real only, so through the
  real system [[re a, -im a], [im a, re a]] (2n x 2n) in f64, with the parts of b
  stacked. The result is complex64.
  """
  def complex_triangular_solve(s, a, b, lower?, rank, n) do
    f64 = {:f, 64}
    rows = N.reshape(s, N.arange(s, 0, n, 1, {:s, 32}), {n, 1})
    cols = N.reshape(s, N.arange(s, 0, n, 1, {:s, 32}), {1, n})
    keep = if lower?, do: N.greater_equal(s, rows, cols), else: N.less_equal(s, rows, cols)
    a = N.where(s, keep, a, num(s, 0, {:c, 64}))
    {ar, ai} = {N.astype(s, N.real(s, a), f64), N.astype(s, N.imag(s, a), f64)}
    {br, bi} = {N.astype(s, N.real(s, b), f64), N.astype(s, N.imag(s, b), f64)}
    top = N.concatenate(s, [ar, N.negative(s, ai)], -1)
    bottom = N.concatenate(s, [ai, ar], -1)
    m = N.concatenate(s, [top, bottom], -2)
    x = N.solve(s, m, N.concatenate(s, [br, bi], -2))
    xr = first(s, x, rank, n, 2)

    xi =
      N.slice(
        s,
        x,
        List.duplicate(0, rank - 2) ++ [n, 0],
        List.duplicate(2_147_483_647, rank),
        List.duplicate(1, rank)
      )

    i = N.from_binary(s, <<0.0::float-32-native, 1.0::float-32-native>>, {}, {:c, 64})
    N.add(s, N.astype(s, xr, {:c, 64}), N.multiply(s, N.astype(s, xi, {:c, 64}), i))
  end

  # The diagonals of the last two axes of a rank-`rank` array (its first k rows and
  # columns), `{..., k}`.
  defp diagonal(s, x, rank, k) do
    ids =
      N.reshape(
        s,
        N.arange(s, 0, k, 1, {:s, 32}),
        List.to_tuple(List.duplicate(1, rank - 2) ++ [k, 1])
      )

    N.squeeze(s, N.take_along_axis(s, first(s, x, rank, k, 2), ids, -1), [-1])
  end

  # 1 where x >= 0 (and NaN), -1 where x < 0.
  defp signs(s, x, type),
    do: N.where(s, N.less(s, x, num(s, 0, type)), num(s, -1, type), num(s, 1, type))

  # The first k entries along the last axis (`from_end` 1) or the one before (2) of a
  # rank-`rank` array; MLX clamps the other stops.
  defp first(s, x, rank, k, from_end \\ 1) do
    big = 2_147_483_647
    stops = List.duplicate(big, rank) |> List.replace_at(rank - from_end, k)
    N.slice(s, x, List.duplicate(0, rank), stops, List.duplicate(1, rank))
  end

  defp zap(s, x, eps, type),
    do: N.where(s, N.less_equal(s, N.abs(s, x), num(s, eps, type)), num(s, 0, type), x)

  defp num(s, v, type), do: N.full(s, {}, v, type)
end
