defmodule Emily.Native.LinalgTest do
  use Emily.TestCase, async: true

  # MLX's linalg runs on a CPU stream only; these tests pin it.

  # Row-major nested lists, for oracles computed in plain Elixir.
  defp rows(flat, n), do: Enum.chunk_every(flat, n)
  defp mm(a, b), do: for(r <- a, do: for(c <- transpose(b), do: dotv(r, c)))
  defp transpose(m), do: Enum.zip_with(m, & &1)
  defp dotv(x, y), do: Enum.zip_with(x, y, &(&1 * &2)) |> Enum.sum()

  defp ident(n),
    do: for(i <- 0..(n - 1), do: for(j <- 0..(n - 1), do: if(i == j, do: 1.0, else: 0.0)))

  # The stream keeps working after an error.
  defp assert_alive(stream) do
    assert l(N.add(stream, t([1.0]), t([2.0]))) == [3.0]
  end

  defp assert_error(fun, pattern) do
    e = assert_raise Emily.Error, fun
    assert e.message =~ pattern
    assert_alive(cpu())
    e
  end

  describe "matmul" do
    test "f32" do
      a = t([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], {:f, 32}, {2, 3})
      b = t([7.0, 8.0, 9.0, 10.0, 11.0, 12.0], {:f, 32}, {3, 2})
      c = N.matmul(s(), a, b)
      assert Emily.shape(c) == {2, 2}
      assert l(c) == [58.0, 64.0, 139.0, 154.0]
    end

    test "batched matmul broadcasts batch dims" do
      a = t(Enum.map(1..8, &(&1 * 1.0)), {:f, 32}, {2, 2, 2})
      i = t([1.0, 0.0, 0.0, 1.0], {:f, 32}, {2, 2})
      assert l(N.matmul(s(), a, i)) == Enum.map(1..8, &(&1 * 1.0))
    end

    test "f16, bf16 matmul" do
      for dt <- [{:f, 16}, {:bf, 16}] do
        a = t([1.0, 2.0, 3.0, 4.0], dt, {2, 2})
        c = N.matmul(s(), a, a)
        assert Emily.dtype(c) == dt
        assert l(c) == [7.0, 10.0, 15.0, 22.0]
      end
    end

    test "f64 matmul on the CPU" do
      a = Emily.from_list([1.0, 2.0, 3.0, 4.0], {:f, 64}, shape: {2, 2}, device: :cpu)
      c = N.matmul(cpu(), a, a)
      assert Emily.dtype(c) == {:f, 64}
      assert l(c) == [7.0, 10.0, 15.0, 22.0]
    end

    @tag :gpu
    test "f64 on the GPU is a clear error, and the GPU stream goes on" do
      gpu = Emily.Stream.default(:gpu)
      a = Emily.from_list([1.0, 2.0], {:f, 64}, stream: gpu)

      assert_raise Emily.Error, ~r/float64 is not supported on the GPU/, fn ->
        l(N.multiply(gpu, a, a))
      end

      b = Emily.from_list([1.0, 2.0], {:f, 32}, stream: gpu)
      assert l(N.multiply(gpu, b, b)) == [1.0, 4.0]
    end

    test "a large matmul checked against Elixir arithmetic" do
      n = 128
      a = N.reshape(s(), N.arange(s(), 0, n * n, 1, {:f, 32}), {n, n})
      b = N.full(s(), {n, 1}, 1.0, {:f, 32})
      # Row i of a is i*n .. i*n + n - 1, so its sum is n*i*n + n(n-1)/2.
      expected = for i <- 0..(n - 1), do: n * i * n + div(n * (n - 1), 2) * 1.0
      assert_close(l(N.matmul(s(), a, b)), expected, 1.0e-6)
    end

    test "mismatched inner dims raise Emily.Error" do
      e =
        assert_raise Emily.Error, fn ->
          l(N.matmul(s(), t([1.0, 2.0], {:f, 32}, {1, 2}), t([1.0], {:f, 32}, {1, 1})))
        end

      assert e.message =~ "matmul:"
      assert e.message =~ "f32[1x2], f32[1x1]"
    end
  end

  describe "addmm / inner / outer / gather_mm" do
    test "addmm is beta * c + alpha * a @ b" do
      c = t([1.0, 1.0, 1.0, 1.0], {:f, 32}, {2, 2})
      a = t([1.0, 2.0, 3.0, 4.0], {:f, 32}, {2, 2})
      i = t([1.0, 0.0, 0.0, 1.0], {:f, 32}, {2, 2})
      assert l(N.addmm(s(), c, a, i, 2.0, 0.5)) == [2.5, 4.5, 6.5, 8.5]
      assert l(N.addmm(s(), c, a, a, 1, 1)) == [8.0, 11.0, 16.0, 23.0]
    end

    test "addmm rejects integers and bad shapes" do
      a = t([1, 2, 3, 4], {:s, 32}, {2, 2})
      assert_error(fn -> l(N.addmm(s(), a, a, a, 1, 1)) end, "addmm")
      f = t([1.0, 2.0], {:f, 32}, {1, 2})
      assert_error(fn -> l(N.addmm(s(), f, f, f, 1, 1)) end, "addmm")
    end

    test "inner and outer" do
      x = t([1.0, 2.0, 3.0])
      y = t([4.0, 5.0, 6.0])
      assert l(N.inner(s(), x, y)) == [32.0]
      o = N.outer(s(), t([1.0, 2.0]), y)
      assert Emily.shape(o) == {2, 3}
      assert l(o) == [4.0, 5.0, 6.0, 8.0, 10.0, 12.0]
      assert_error(fn -> l(N.inner(s(), x, t([1.0, 2.0]))) end, "inner")
      # outer flattens its inputs (any shapes) and multiplies, so integers work too
      assert l(N.outer(s(), t([1, 2], {:s, 32}), t([3], {:s, 32}))) == [3, 6]
      assert_raise ArgumentError, fn -> N.outer(s(), x, [1.0]) end
    end

    test "gather_mm picks the right-hand matrices by index" do
      a = t([1.0, 2.0], {:f, 32}, {1, 1, 2})
      # b[0] = I, b[1] = 2I
      b = t([1.0, 0.0, 0.0, 1.0, 2.0, 0.0, 0.0, 2.0], {:f, 32}, {2, 2, 2})
      idx = t([1, 0], {:u, 32})
      out = N.gather_mm(s(), a, b, nil, idx, false)
      assert Emily.shape(out) == {2, 1, 2}
      assert l(out) == [2.0, 4.0, 1.0, 2.0]
      assert_error(fn -> l(N.gather_mm(s(), a, b, nil, t([1.0, 0.0]), false)) end, "gather_mm")
    end
  end

  describe "dot (Nx dot/7)" do
    # Plain Elixir reference: sums over the contracted axes for every (batch, free_a,
    # free_b) index, in Nx's output layout.
    defp ref_dot(a, sa, ca, ba, b, sb, cb, bb) do
      ra = tuple_size(sa)
      rb = tuple_size(sb)
      fa = Enum.to_list(0..(ra - 1)) -- (ca ++ ba)
      fb = Enum.to_list(0..(rb - 1)) -- (cb ++ bb)
      at = List.to_tuple(a)
      bt = List.to_tuple(b)
      ranges = fn shape, axes -> Enum.map(axes, &Enum.to_list(0..(elem(shape, &1) - 1))) end

      for bi <- cartesian(ranges.(sa, ba)),
          fi <- cartesian(ranges.(sa, fa)),
          fj <- cartesian(ranges.(sb, fb)) do
        for ci <- cartesian(ranges.(sa, ca)), reduce: 0 do
          acc ->
            ia = place(ra, ba ++ fa ++ ca, bi ++ fi ++ ci)
            ib = place(rb, bb ++ fb ++ cb, bi ++ fj ++ ci)
            acc + elem(at, flat_index(ia, sa)) * elem(bt, flat_index(ib, sb))
        end
      end
    end

    defp cartesian([]), do: [[]]
    defp cartesian([r | rest]), do: for(x <- r, tail <- cartesian(rest), do: [x | tail])

    defp place(rank, axes, values) do
      m = Map.new(Enum.zip(axes, values))
      for i <- 0..(rank - 1), do: Map.fetch!(m, i)
    end

    defp flat_index(idx, shape) do
      Enum.zip(idx, Tuple.to_list(shape)) |> Enum.reduce(0, fn {i, d}, acc -> acc * d + i end)
    end

    test "hand-computed contraction of non-leading axes" do
      # a = [[1, 2], [3, 4]] contracted on axis 0 with b = [[5, 6], [7, 8]] on axis 1:
      # out[i][j] = sum_k a[k][i] * b[j][k]
      a = t([1.0, 2.0, 3.0, 4.0], {:f, 32}, {2, 2})
      b = t([5.0, 6.0, 7.0, 8.0], {:f, 32}, {2, 2})
      assert l(N.dot(s(), a, [0], [], b, [1], [])) == [23.0, 31.0, 34.0, 46.0]
    end

    test "hand-computed batch on a non-leading axis" do
      # a {3, 2} batched on axis 1, b {2, 3} batched on axis 0, contracted a0 with b1:
      # out[n] = sum_k a[k][n] * b[n][k]
      a = t([1, 2, 3, 4, 5, 6], {:s, 32}, {3, 2})
      b = t([1, 1, 1, 1, 2, 3], {:s, 32}, {2, 3})
      out = N.dot(s(), a, [0], [1], b, [1], [0])
      assert Emily.shape(out) == {2}
      assert Emily.dtype(out) == {:s, 32}
      # n=0: 1+3+5 = 9; n=1: 2*1 + 4*2 + 6*3 = 28
      assert l(out) == [9, 28]
    end

    test "outer product when nothing is contracted" do
      out = N.dot(s(), t([1, 2], {:s, 64}), [], [], t([3, 4, 5], {:s, 64}), [], [])
      assert Emily.shape(out) == {2, 3}
      assert l(out) == [3, 4, 5, 6, 8, 10]
    end

    test "integer dot wraps in its type" do
      a = t([200, 100], {:u, 8})
      b = t([2, 3], {:u, 8})
      out = N.dot(s(), a, [0], [], b, [0], [])
      assert Emily.dtype(out) == {:u, 8}
      # 400 + 300 = 700 = 188 (mod 256)
      assert l(out) == [188]
      out = N.dot(s(), t([100, 100], {:s, 8}), [0], [], t([2, 1], {:s, 8}), [0], [])
      # 300 = 44 (mod 256)
      assert l(out) == [44]
    end

    test "matches the Elixir reference for several axis layouts and types" do
      with_cpu(fn ->
        cases = [
          # {shape_a, contract_a, batch_a, shape_b, contract_b, batch_b}
          {{2, 3}, [1], [], {3, 4}, [0], []},
          {{2, 3, 4}, [2], [0], {2, 4, 3}, [1], [0]},
          {{4, 2, 3}, [0, 2], [], {3, 5, 4}, [2, 0], []},
          {{3, 2, 4}, [0], [2], {4, 3, 2}, [1], [0]},
          {{2, 2, 3, 2}, [2], [1, 3], {2, 3, 2, 2}, [1], [2, 0]},
          {{5}, [0], [], {5}, [0], []},
          # Already in matmul's layout (nothing moved), or transposed operands.
          {{2, 3, 4, 5}, [3], [0, 1], {2, 3, 5, 2}, [2], [0, 1]},
          {{3, 4}, [0], [], {3, 5}, [0], []},
          {{4, 3}, [1], [], {5, 3}, [1], []},
          # A side with no free axis.
          {{2, 3, 4}, [2], [0], {2, 4}, [1], [0]},
          {{2, 4}, [1], [0], {2, 4, 5}, [1], [0]}
        ]

        for {sa, ca, ba, sb, cb, bb} <- cases,
            dt <- [{:f, 32}, {:f, 64}, {:s, 32}, {:s, 64}, {:u, 16}] do
          na = Tuple.product(sa)
          nb = Tuple.product(sb)
          a = for i <- 0..(na - 1), do: rem(i * 7 + 3, 11)
          b = for i <- 0..(nb - 1), do: rem(i * 5 + 1, 9)
          cast = fn x -> if elem(dt, 0) == :f, do: x * 1.0, else: x end

          out =
            N.dot(s(), t(Enum.map(a, cast), dt, sa), ca, ba, t(Enum.map(b, cast), dt, sb), cb, bb)

          expected = ref_dot(a, sa, ca, ba, b, sb, cb, bb) |> Enum.map(cast)
          assert Emily.dtype(out) == dt
          assert l(out) == expected, "#{inspect({sa, ca, ba, sb, cb, bb, dt})}"
        end
      end)
    end

    test "mixed int and float promote like Nx" do
      out = N.dot(s(), t([1, 2], {:s, 32}), [0], [], t([0.5, 0.25]), [0], [])
      assert Emily.dtype(out) == {:f, 32}
      assert l(out) == [1.0]
    end

    test "a large integer dot sums in chunks" do
      # 256 x 512 x 256: the integer path splits the 512 contraction into chunks.
      {m, k, n} = {256, 512, 256}
      a = for i <- 0..(m - 1), _ <- 0..(k - 1), do: 1 + rem(i, 2)
      b = for kk <- 0..(k - 1), j <- 0..(n - 1), do: j + rem(kk, 3)
      out = N.dot(s(), t(a, {:s, 32}, {m, k}), [1], [], t(b, {:s, 32}, {k, n}), [0], [])
      # sum_k (j + k mod 3) = 512 j + 511 (171 ones and 170 twos among k mod 3)
      expected = for i <- 0..(m - 1), j <- 0..(n - 1), do: (1 + rem(i, 2)) * (512 * j + 511)
      assert l(out) == expected
    end

    test "contracting an empty axis gives zeros" do
      a = N.full(s(), {2, 0}, 1.0, {:s, 32})
      b = N.full(s(), {0, 3}, 1.0, {:s, 32})
      assert l(N.dot(s(), a, [1], [], b, [0], [])) == [0, 0, 0, 0, 0, 0]
    end

    test "bad axes raise Emily.Error and the stream stays usable" do
      a = t([1.0, 2.0, 3.0, 4.0], {:f, 32}, {2, 2})
      b = t([1.0, 2.0, 3.0], {:f, 32}, {3})

      assert_error(
        fn -> l(N.dot(s(), a, [1], [], b, [0], [])) end,
        "contraction axis 1 of size 2"
      )

      assert_error(fn -> l(N.dot(s(), a, [2], [], a, [0], [])) end, "invalid contraction axes")
      assert_error(fn -> l(N.dot(s(), a, [1], [], a, [0, 1], [])) end, "must pair up")

      assert_error(
        fn -> l(N.dot(s(), a, [0], [0], a, [0], [1])) end,
        "both contracted and batched"
      )

      assert_error(fn -> l(N.dot(s(), a, [1], [0], b, [0], [0])) end, "dot")
      assert_raise ArgumentError, fn -> N.dot(s(), a, [:x], [], a, [0], []) end
    end
  end

  # On a Linux CPU stream an f32 row times a matrix is one gemv call (cpp/gemv.cc), which
  # reads the matrix through its strides: every layout it takes, against the Elixir oracle.
  describe "dot of one row (gemv)" do
    setup do
      k = 37
      n = 23
      x = for i <- 1..k, do: :math.sin(i) * 1.0
      w = for i <- 1..(k * n), do: :math.cos(i * 0.7)
      %{k: k, n: n, x: x, w: w, expect: hd(mm([x], rows(w, n)))}
    end

    test "row-major and transposed matrices", %{k: k, n: n, x: x, w: w, expect: expect} do
      xs = t(x, {:f, 32}, {1, k})
      assert_close(l(N.dot(cpu(), xs, [1], [], t(w, {:f, 32}, {k, n}), [0], [])), expect, 1.0e-4)

      # The (N, K) layout checkpoints hold, contracted on its second axis.
      wt = N.transpose(cpu(), t(w, {:f, 32}, {k, n}), [1, 0])
      wt = t(l(wt), {:f, 32}, {n, k})
      assert_close(l(N.dot(cpu(), xs, [1], [], wt, [1], [])), expect, 1.0e-4)
      # A leading unit axis (a batch of one token) is a row too.
      out = N.dot(cpu(), t(x, {:f, 32}, {1, 1, k}), [2], [], wt, [1], [])
      assert Emily.shape(out) == {1, 1, n}
      assert_close(l(out), expect, 1.0e-4)
    end

    test "strided and broadcast operands", %{k: k, n: n, x: x, w: w, expect: expect} do
      # Every other column of a (K, 2N) matrix, and the row as every other element.
      wide = for r <- rows(w, n), v <- r, z <- [v, 99.0], do: z
      b = N.slice(cpu(), t(wide, {:f, 32}, {k, 2 * n}), [0, 0], [k, 2 * n], [1, 2])

      xs =
        N.slice(
          cpu(),
          t(Enum.flat_map(x, &[&1, -5.0]), {:f, 32}, {1, 2 * k}),
          [0, 0],
          [1, 2 * k],
          [1, 2]
        )

      assert_close(l(N.dot(cpu(), xs, [1], [], b, [0], [])), expect, 1.0e-4)

      # A broadcast row (stride 0) and a broadcast matrix.
      ones = N.broadcast_to(cpu(), t([1.0]), {1, k})
      sums = for c <- transpose(rows(w, n)), do: Enum.sum(c)
      assert_close(l(N.dot(cpu(), ones, [1], [], t(w, {:f, 32}, {k, n}), [0], [])), sums, 1.0e-4)
      col = N.broadcast_to(cpu(), t(Enum.take(w, k), {:f, 32}, {k, 1}), {k, n})
      dotx = dotv(x, Enum.take(w, k))

      assert_close(
        l(N.dot(cpu(), t(x, {:f, 32}, {1, k}), [1], [], col, [0], [])),
        List.duplicate(dotx, n),
        1.0e-4
      )
    end

    # Sizes that are not multiples of the kernel's blocks (4 rows, 8 lanes, 4 columns).
    test "a matrix large enough to split over the cores, in both layouts" do
      {k, n} = {301, 517}
      {w, expect, xs} = row_times_matrix(k, n, 0.011)
      assert_close(l(N.dot(cpu(), xs, [1], [], t(w, {:f, 32}, {k, n}), [0], [])), expect, 1.0e-4)

      wt = t(l(N.transpose(cpu(), t(w, {:f, 32}, {k, n}), [1, 0])), {:f, 32}, {n, k})
      full = N.dot(cpu(), xs, [1], [], wt, [1], [])
      assert_close(l(full), expect, 1.0e-4)

      # Read by columns, several columns go through the kernel at once, each summed as
      # alone: every output has the bits of its column's product by itself.
      alone =
        for j <- 0..(n - 1) do
          row = N.slice(cpu(), wt, [j, 0], [j + 1, k], [1, 1])
          N.dot(cpu(), xs, [1], [], row, [1], []) |> Emily.to_binary()
        end

      assert Emily.to_binary(full) == IO.iodata_to_binary(alone)
    end

    # Past 256K weights a matrix read by rows is split into blocks of whole rows, each
    # block's sums added in order: blocks of 236 rows (701 = 236 + 236 + 229) and a tail of
    # columns past the 8 lanes, in f32 and bf16. Read by columns, past 512K weights, into
    # blocks of whole columns (768 + 332).
    test "a matrix read by rows in several blocks" do
      {k, n} = {701, 1_100}
      {w, expect, xs} = row_times_matrix(k, n, 0.0013)
      ws = t(w, {:f, 32}, {k, n})
      out = N.dot(cpu(), xs, [1], [], ws, [0], [])
      assert_close(l(out), expect, 1.0e-3)
      assert Emily.to_binary(out) == Emily.to_binary(N.dot(cpu(), xs, [1], [], ws, [0], []))

      wt = t(l(N.transpose(cpu(), ws, [1, 0])), {:f, 32}, {n, k})
      assert_close(l(N.dot(cpu(), xs, [1], [], wt, [1], [])), expect, 1.0e-3)

      xb = N.astype(cpu(), xs, {:bf, 16})
      wb = N.astype(cpu(), ws, {:bf, 16})
      expect = hd(mm([l(xb)], rows(l(wb), n)))
      assert_bf16_sums(l(N.dot(cpu(), xb, [1], [], wb, [0], [])), expect)
    end

    # bf16 operands (on x86-64 with AVX2, Emily's kernel): sums in f32 over the bf16
    # values, rounded to bf16 once; against the oracle on the same bf16 values.
    test "bf16 operands, both layouts, a tail of 3 columns" do
      k = 301
      n = 515
      xb = t(for(i <- 1..k, do: :math.sin(i * 0.3)), {:bf, 16}, {1, k})
      wb = t(for(i <- 1..(k * n), do: :math.cos(i * 0.011)), {:bf, 16}, {k, n})
      expect = hd(mm([l(xb)], rows(l(wb), n)))
      out = N.dot(cpu(), xb, [1], [], wb, [0], [])
      assert Emily.dtype(out) == {:bf, 16}
      assert_bf16_sums(l(out), expect)

      wt = N.astype(cpu(), t(l(N.transpose(cpu(), wb, [1, 0])), {:f, 32}, {n, k}), {:bf, 16})
      assert_bf16_sums(l(N.dot(cpu(), xb, [1], [], wt, [1], [])), expect)
    end
  end

  # A row of k and a (k, n) matrix of cosines (`step` apart), as lists: the matrix, the
  # oracle's product, and the row as an f32 tensor.
  defp row_times_matrix(k, n, step) do
    x = for i <- 1..k, do: :math.sin(i * 0.3)
    w = for i <- 1..(k * n), do: :math.cos(i * step)
    {w, hd(mm([x], rows(w, n))), t(x, {:f, 32}, {1, k})}
  end

  # bf16 sums against the oracle's on the same bf16 values: bf16 keeps 8 bits, so half an
  # ulp of the largest sum, and the f32 sums' rounding.
  defp assert_bf16_sums(out, expect) do
    bound = Enum.max(Enum.map(expect, &abs/1)) / 256
    assert Enum.all?(Enum.zip(out, expect), fn {a, e} -> abs(a - e) <= bound end)
  end

  # On MLX's CUDA backend a few rows times a (K, N) weight are one Emily kernel
  # (cpp/cuda_gemv.cc), past 8 rows MLX's matmul; an (N, K) weight contracted on its
  # second axis is MLX's own gemv. Every case against the Elixir oracle on the same
  # values, with a column tail (515 is not a multiple of the kernel's 64-column tiles).
  describe "dot of a few rows on a GPU" do
    setup do
      k = 301
      n = 515
      %{k: k, n: n, gpu: Emily.Stream.default(:gpu)}
    end

    defp g(list, type, shape, gpu), do: Emily.from_list(list, type, shape: shape, stream: gpu)

    # The largest error a type's rounding of the result allows, plus f32's summation.
    # Emily's kernel sums f32 products in f32; cuBLAS (MLX's f32 matmul) uses TF32, whose
    # inputs keep 10 bits.
    defp bound({:f, 32}, expect), do: Enum.max(Enum.map(expect, &abs/1)) * 1.0e-4
    defp bound(:tf32, expect), do: Enum.max(Enum.map(expect, &abs/1)) / 128
    defp bound({:bf, 16}, expect), do: Enum.max(Enum.map(expect, &abs/1)) / 256
    defp bound({:f, 16}, expect), do: Enum.max(Enum.map(expect, &abs/1)) / 1024

    defp matmul({:f, 32}), do: :tf32
    defp matmul(type), do: type

    # {true, _} where every element is within the bound, else {false, the worst error}.
    defp within(out, expect, type) do
      b = bound(type, List.flatten(expect))
      errors = Enum.zip_with(l(out), List.flatten(expect), &abs(&1 - &2))
      {Enum.max(errors) <= b, %{worst: Enum.max(errors), bound: b}}
    end

    defp within?(out, expect, type), do: elem(within(out, expect, type), 0)

    @tag :gpu
    test "1 to 9 rows, f32, bf16 and f16, both weight layouts", %{k: k, n: n, gpu: gpu} do
      for type <- [{:f, 32}, {:bf, 16}, {:f, 16}], m <- [1, 3, 8, 9] do
        x = g(for(i <- 1..(m * k), do: :math.sin(i * 0.3)), type, {m, k}, gpu)
        w = g(for(i <- 1..(k * n), do: :math.cos(i * 0.011)), type, {k, n}, gpu)
        expect = mm(rows(l(x), k), rows(l(w), n))

        out = N.dot(gpu, x, [1], [], w, [0], [])
        assert Emily.shape(out) == {m, n} and Emily.dtype(out) == type
        kernel = if m <= 8, do: type, else: matmul(type)
        {ok, err} = within(out, expect, kernel)
        assert ok, "#{inspect(type)}, #{m} rows, (K, N) weight: #{inspect(err)}"

        # The kernel reads x where it lies: a transposed view gives the same bits.
        if m <= 8 do
          xt = N.transpose(gpu, g(l(N.transpose(gpu, x, [1, 0])), type, {k, m}, gpu), [1, 0])
          strided = N.dot(gpu, xt, [1], [], w, [0], [])

          assert Emily.to_binary(strided) == Emily.to_binary(out),
                 "#{inspect({type, m})}, x strided"
        end

        # MLX's gemv for one row, its matmul for more.
        wt = g(l(N.transpose(gpu, w, [1, 0])), type, {n, k}, gpu)
        mlx = if m == 1, do: type, else: matmul(type)
        {ok, err} = within(N.dot(gpu, x, [1], [], wt, [1], []), expect, mlx)
        assert ok, "#{inspect(type)}, #{m} rows, (N, K) weight: #{inspect(err)}"
      end
    end

    @tag :gpu
    test "a lazy weight, a strided row and a batch of one token", %{k: k, n: n, gpu: gpu} do
      x = g(for(i <- 1..k, do: :math.sin(i * 0.3)), {:f, 32}, {1, k}, gpu)
      w = g(for(i <- 1..(k * n), do: :math.cos(i * 0.011)), {:f, 32}, {k, n}, gpu)
      expect = mm(rows(l(x), k), rows(l(w), n))

      # Computed in the same graph: its layout is unknown when the product is built.
      lazy = N.multiply(gpu, w, N.full(gpu, {}, 1.0, {:f, 32}))
      assert within?(N.dot(gpu, x, [1], [], lazy, [0], []), expect, {:f, 32})

      # Every other element of a wider row: copied to rows before the kernel reads it.
      wide = g(Enum.flat_map(l(x), &[&1, -5.0]), {:f, 32}, {1, 2 * k}, gpu)
      xs = N.slice(gpu, wide, [0, 0], [1, 2 * k], [1, 2])
      assert within?(N.dot(gpu, xs, [1], [], w, [0], []), expect, {:f, 32})

      out = N.dot(gpu, N.reshape(gpu, x, {1, 1, k}), [2], [], w, [0], [])
      assert Emily.shape(out) == {1, 1, n}
      assert within?(out, expect, {:f, 32})
    end
  end

  # `dots2`/`dots3`: one input times several weights, each product as `dot` computes it
  # (on a CPU a decoding step's row is one node through Emily's kernel; elsewhere the
  # `dot`s themselves), so every output has the bits of its `dot`.
  describe "dots (the products of one input)" do
    defp bits(list), do: Enum.map(list, &Emily.to_binary/1)

    defp each_dot(stream, x, axis, ws),
      do: Enum.map(ws, &N.dot(stream, x, [axis], [], &1, [0], []))

    defp weights(k, ns, type) do
      for {n, j} <- Enum.with_index(ns) do
        t(for(i <- 1..(k * n), do: :math.cos(i * 0.011 + j)), type, {k, n})
      end
    end

    test "a row, f32 and bf16: split and unsplit weights, both layouts, a batch of one token" do
      k = 301

      for type <- [{:f, 32}, {:bf, 16}] do
        x = t(for(i <- 1..k, do: :math.sin(i * 0.3)), type, {1, k})
        [w0, w1, w2] = weights(k, [517, 23, 64], type)
        # The (N, K) layout, viewed as (K, N): read by columns.
        wt = N.transpose(cpu(), t(l(N.transpose(cpu(), w1, [1, 0])), type, {23, k}), [1, 0])

        for ws <- [[w0, w1], [w0, w1, w2], [w2, wt, w0]] do
          op = if length(ws) == 2, do: &N.dots2/5, else: &N.dots3/6
          out = apply(op, [cpu(), x, 1 | ws])
          assert bits(out) == bits(each_dot(cpu(), x, 1, ws)), inspect({type, length(ws)})
          assert Enum.map(out, &Emily.shape/1) == Enum.map(ws, &{1, elem(Emily.shape(&1), 1)})
        end

        x3 = N.reshape(cpu(), x, {1, 1, k})
        out = N.dots3(cpu(), x3, -1, w0, w1, w2)
        assert Enum.map(out, &Emily.shape/1) == [{1, 1, 517}, {1, 1, 23}, {1, 1, 64}]
        assert bits(out) == bits(each_dot(cpu(), x3, 2, [w0, w1, w2]))
      end
    end

    test "strided and broadcast weights, a strided row" do
      k = 37
      [w0, w1] = weights(k, [46, 23], {:f, 32})
      # Every other column of w0, and a broadcast column: read element by element.
      every_other = N.slice(cpu(), w0, [0, 0], [k, 46], [1, 2])
      col = N.broadcast_to(cpu(), N.slice(cpu(), w1, [0, 0], [k, 1], [1, 1]), {k, 5})
      wide = t(Enum.flat_map(1..k, &[:math.sin(&1), -5.0]), {:f, 32}, {1, 2 * k})
      x = N.slice(cpu(), wide, [0, 0], [1, 2 * k], [1, 2])
      ws = [every_other, w1, col]
      assert bits(N.dots3(cpu(), x, 1, every_other, w1, col)) == bits(each_dot(cpu(), x, 1, ws))
    end

    test "several rows, another axis, mixed types: the dots themselves" do
      k = 37
      [w0, w1] = weights(k, [29, 23], {:f, 32})
      rows4 = t(for(i <- 1..(4 * k), do: :math.sin(i * 0.3)), {:f, 32}, {4, k})
      assert bits(N.dots2(cpu(), rows4, 1, w0, w1)) == bits(each_dot(cpu(), rows4, 1, [w0, w1]))

      # x (K, 2) contracted on its first axis.
      cols = N.transpose(cpu(), N.slice(cpu(), rows4, [0, 0], [2, k], [1, 1]), [1, 0])
      assert bits(N.dots2(cpu(), cols, 0, w0, w1)) == bits(each_dot(cpu(), cols, 0, [w0, w1]))

      x = N.slice(cpu(), rows4, [0, 0], [1, k], [1, 1])
      half = N.astype(cpu(), w1, {:bf, 16})
      out = N.dots2(cpu(), x, 1, w0, half)
      assert bits(out) == bits(each_dot(cpu(), x, 1, [w0, half]))
      assert Enum.map(out, &Emily.dtype/1) == [{:f, 32}, {:f, 32}]
    end

    test "mismatched operands raise as dot does, and the stream goes on" do
      [w0, w1] = weights(37, [29, 23], {:f, 32})
      x = t(for(i <- 1..36, do: i * 1.0), {:f, 32}, {1, 36})
      assert_error(fn -> bits(N.dots2(cpu(), x, 1, w0, w1)) end, ~r/\[dot\] contraction axis/)
      assert_error(fn -> bits(N.dots2(cpu(), x, 2, w0, w1)) end, ~r/\[dot\] invalid contraction/)
      assert_error(fn -> bits(N.dots2(cpu(), t([1.0]), 0, w0, w1)) end, ~r/\[dot\]/)
    end

    # On a GPU up to eight rows times (K, N) weights are one kernel (cpp/cuda_gemv.cc),
    # three weights at most; each product as its `dot` computes it, to the bit.
    @tag :gpu
    test "a few rows on a GPU, f32, bf16 and f16" do
      gpu = Emily.Stream.default(:gpu)
      k = 301

      for type <- [{:f, 32}, {:bf, 16}, {:f, 16}], m <- [1, 3, 8, 9] do
        x =
          Emily.from_list(for(i <- 1..(m * k), do: :math.sin(i * 0.3)), type,
            shape: {m, k},
            stream: gpu
          )

        ws =
          for {n, j} <- Enum.with_index([515, 64, 1]) do
            Emily.from_list(for(i <- 1..(k * n), do: :math.cos(i * 0.011 + j)), type,
              shape: {k, n},
              stream: gpu
            )
          end

        [w0, w1, w2] = ws
        out = N.dots3(gpu, x, 1, w0, w1, w2)
        assert bits(out) == bits(each_dot(gpu, x, 1, ws)), inspect({type, m})
        assert bits(N.dots2(gpu, x, 1, w2, w0)) == bits(each_dot(gpu, x, 1, [w2, w0]))
      end
    end
  end

  # A CPU stream multiplies bf16 and f16 matrices through f32 (MLX's own half matmul has
  # no BLAS): the f32 sums of the half values, rounded once.
  test "bf16 and f16 products of several rows" do
    for type <- [{:bf, 16}, {:f, 16}] do
      a = t(for(i <- 1..(5 * 37), do: :math.sin(i * 0.7)), type, {5, 37})
      b = t(for(i <- 1..(37 * 23), do: :math.cos(i * 0.3)), type, {37, 23})
      out = N.dot(cpu(), a, [1], [], b, [0], [])
      assert Emily.dtype(out) == type
      expect = mm(rows(l(a), 37), rows(l(b), 23)) |> List.flatten()
      ulp = if type == {:bf, 16}, do: 1 / 128, else: 1 / 1024

      assert Enum.all?(Enum.zip(l(out), expect), fn {x, e} ->
               abs(x - e) <= ulp * max(abs(e), 1.0)
             end)
    end
  end

  # Axon's dense layer: x's last axis times w, plus a bias of w's columns, against the
  # plain-Elixir oracle, for a matrix product (addmm), one row (the row kernel), and none.
  test "dense: x · w + bias, batched, one row and no rows" do
    w = t(for(i <- 1..(37 * 23), do: :math.cos(i * 0.3)), {:f, 32}, {37, 23})
    bias = t(for(i <- 1..23, do: i * 0.25), {:f, 32}, {23})

    for shape <- [{2, 5, 37}, {1, 37}] do
      n = div(Tuple.product(shape), 37)
      x = t(for(i <- 1..(n * 37), do: :math.sin(i * 0.7)), {:f, 32}, shape)
      out = N.dense(cpu(), x, w, bias)
      assert Emily.shape(out) == put_elem(shape, tuple_size(shape) - 1, 23)

      expect =
        mm(rows(l(x), 37), rows(l(w), 23))
        |> Enum.map(fn r -> Enum.zip_with(r, l(bias), &+/2) end)
        |> List.flatten()

      assert_close(l(out), expect, 1.0e-5)
    end

    none = N.dense(cpu(), t([], {:f, 32}, {0, 37}), w, bias)
    assert Emily.shape(none) == {0, 23} and l(none) == []

    assert_error(fn -> l(N.dense(cpu(), t([1.0, 2.0], {:f, 32}, {1, 2}), w, bias)) end, ~r/dense/)
    assert_error(fn -> l(N.dense(cpu(), w, w, bias)) end, ~r/dense/)
  end

  # On a CPU in f32, dense's addmm is Emily's (cpp/addmm.cc): MLX's sgemm call on an
  # output filled with the bias row by row, so MLX's addmm's bits, for operands in rows,
  # transposed or strided, a bias broadcast from one value, and no columns.
  test "dense on a CPU: the bits of MLX's addmm, for any operand layout" do
    {m, k, n} = {300, 700, 129}
    x = t(for(i <- 1..(m * k), do: :math.sin(i * 0.7)), {:f, 32}, {m, k})
    w = t(for(i <- 1..(k * n), do: :math.cos(i * 0.3)), {:f, 32}, {k, n})
    bias = t(for(i <- 1..n, do: i * 0.25), {:f, 32}, {n})
    bits = &Emily.to_binary/1
    tr = &N.transpose(cpu(), &1, [1, 0])

    layouts = [
      {x, w, bias},
      {tr.(t(l(tr.(x)), {:f, 32}, {k, m})), w, bias},
      {x, tr.(t(l(tr.(w)), {:f, 32}, {n, k})), bias},
      {N.slice(cpu(), N.concatenate(cpu(), [x, x], 1), [0, 3], [m, k + 3], [1, 1]), w, bias},
      {x, w, N.broadcast_to(cpu(), t([1.5], {:f, 32}, {1}), {n})}
    ]

    for {{a, b, c}, i} <- Enum.with_index(layouts) do
      assert bits.(N.dense(cpu(), a, b, c)) == bits.(N.addmm(cpu(), c, a, b, 1.0, 1.0)),
             "layout #{i}"
    end

    empty = N.dense(cpu(), x, t([], {:f, 32}, {k, 0}), t([], {:f, 32}, {0}))
    assert Emily.shape(empty) == {m, 0} and l(empty) == []
  end

  describe "tensordot" do
    test "contracts explicit axes lists" do
      # a {2, 3}, b {3, 2}: contracting a1 with b0 is matmul
      a = t([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], {:f, 32}, {2, 3})
      b = t([7.0, 8.0, 9.0, 10.0, 11.0, 12.0], {:f, 32}, {3, 2})
      assert l(N.tensordot(s(), a, b, [1], [0])) == [58.0, 64.0, 139.0, 154.0]
      # full contraction over both axes (a0 with b1, a1 with b0): trace(a @ b) = 58 + 154
      assert l(N.tensordot(s(), a, b, [0, 1], [1, 0])) == [212.0]
    end

    test "integer tensordot" do
      a = t([1, 2, 3, 4, 5, 6], {:s, 32}, {2, 3})
      b = t([7, 8, 9, 10, 11, 12], {:s, 32}, {3, 2})
      assert l(N.tensordot(s(), a, b, [1], [0])) == [58, 64, 139, 154]
    end

    test "mismatched sizes raise" do
      a = t([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], {:f, 32}, {2, 3})
      assert_error(fn -> l(N.tensordot(s(), a, a, [1], [1, 0])) end, "tensordot")
      assert_error(fn -> l(N.tensordot(s(), a, a, [0], [1])) end, "does not match")
    end
  end

  describe "decompositions (CPU stream)" do
    # Eigenvectors are unique up to sign: make the first nonzero entry of each column
    # positive.
    defp normalize_columns(q) do
      signs =
        q
        |> transpose()
        |> Enum.map(fn col -> if Enum.find(col, &(abs(&1) > 1.0e-6)) < 0, do: -1, else: 1 end)

      Enum.map(q, fn row -> Enum.zip_with(row, signs, &(&1 * &2)) end)
    end

    # QR is unique up to the signs of r's diagonal: make them positive (flipping the
    # matching columns of q).
    defp normalize_qr(q, r) do
      signs =
        r
        |> Enum.with_index()
        |> Enum.map(fn {row, i} -> if Enum.at(row, i) < 0, do: -1, else: 1 end)

      q = Enum.map(q, fn row -> Enum.zip_with(row, signs, &(&1 * &2)) end)
      {q, Enum.zip_with(r, signs, fn row, sg -> Enum.map(row, &(&1 * sg)) end)}
    end

    test "qr of a 2x2, hand-computed" do
      # a = [[3, 1], [4, 2]]: q1 = [3, 4]/5, r = [[5, 11/5], [0, 2/5]], q2 = [-4, 3]/5
      [q, r] = N.qr(cpu(), t([3.0, 1.0, 4.0, 2.0], {:f, 32}, {2, 2}))
      {qn, rn} = normalize_qr(rows(l(q), 2), rows(l(r), 2))
      assert_close(List.flatten(qn), [0.6, -0.8, 0.8, 0.6], 1.0e-6)
      assert_close(List.flatten(rn), [5.0, 2.2, 0.0, 0.4], 1.0e-6)
    end

    test "qr of a tall f64 matrix reconstructs and is orthonormal" do
      a = [[1.0, 2.0], [3.0, 4.0], [5.0, 7.0]]
      [q, r] = N.qr(cpu(), t(List.flatten(a), {:f, 64}, {3, 2}))
      assert Emily.shape(q) == {3, 2}
      assert Emily.shape(r) == {2, 2}
      q = rows(l(q), 2)
      r = rows(l(r), 2)
      assert_close(List.flatten(mm(q, r)), List.flatten(a), 1.0e-12)
      assert_close(List.flatten(mm(transpose(q), q)), List.flatten(ident(2)), 1.0e-12)
      assert Enum.at(Enum.at(r, 1), 0) == 0.0
    end

    test "svd: singular values hand-computed, factors reconstruct" do
      # a = [[3, 0], [4, 5]]: a^T a = [[25, 20], [20, 25]], eigenvalues 45 and 5
      a = [[3.0, 0.0], [4.0, 5.0]]
      [u, sv, vt] = N.svd(cpu(), t(List.flatten(a), {:f, 32}, {2, 2}))
      assert_close(l(sv), [:math.sqrt(45), :math.sqrt(5)], 1.0e-6)
      [s0, s1] = l(sv)
      us = rows(l(u), 2) |> Enum.map(fn [x, y] -> [x * s0, y * s1] end)
      assert_close(List.flatten(mm(us, rows(l(vt), 2))), List.flatten(a), 1.0e-5)

      assert_close(l(N.svdvals(cpu(), t(List.flatten(a), {:f, 32}, {2, 2}))), [
        6.7082039,
        2.2360680
      ])
    end

    test "svd of a wide matrix gives full u and vt" do
      [u, sv, vt] = N.svd(cpu(), t([1.0, 0.0, 0.0, 0.0, 2.0, 0.0], {:f, 64}, {2, 3}))
      assert {Emily.shape(u), Emily.shape(sv), Emily.shape(vt)} == {{2, 2}, {2}, {3, 3}}
      assert_close(l(sv), [2.0, 1.0], 1.0e-12)
    end

    test "inv, tri_inv, pinv" do
      # [[4, 7], [2, 6]]^-1 = [[6, -7], [-2, 4]] / 10
      assert_close(l(N.inv(cpu(), t([4.0, 7.0, 2.0, 6.0], {:f, 32}, {2, 2}))), [
        0.6,
        -0.7,
        -0.2,
        0.4
      ])

      lower = t([2.0, 0.0, 1.0, 4.0], {:f, 64}, {2, 2})
      assert_close(l(N.tri_inv(cpu(), lower, false)), [0.5, 0.0, -0.125, 0.25], 1.0e-12)
      upper = t([2.0, 1.0, 0.0, 4.0], {:f, 64}, {2, 2})
      assert_close(l(N.tri_inv(cpu(), upper, true)), [0.5, -0.125, 0.0, 0.25], 1.0e-12)
      # rank one [[1, 2], [2, 4]] = u u^T with |u|^2 = 5: pinv = a / 25
      assert_close(l(N.pinv(cpu(), t([1.0, 2.0, 2.0, 4.0], {:f, 32}, {2, 2}))), [
        0.04,
        0.08,
        0.08,
        0.16
      ])
    end

    test "inv of a batch" do
      a = t([2.0, 0.0, 0.0, 2.0, 1.0, 1.0, 0.0, 1.0], {:f, 32}, {2, 2, 2})
      assert_close(l(N.inv(cpu(), a)), [0.5, 0.0, 0.0, 0.5, 1.0, -1.0, 0.0, 1.0])
    end

    test "cholesky lower and upper, cholesky_inv" do
      a = t([4.0, 2.0, 2.0, 3.0], {:f, 32}, {2, 2})
      assert_close(l(N.cholesky(cpu(), a, false)), [2.0, 0.0, 1.0, :math.sqrt(2)])
      assert_close(l(N.cholesky(cpu(), a, true)), [2.0, 1.0, 0.0, :math.sqrt(2)])
      # inv(a) = [[3, -2], [-2, 4]] / 8, from the factor
      lf = N.cholesky(cpu(), a, false)
      assert_close(l(N.cholesky_inv(cpu(), lf, false)), [0.375, -0.25, -0.25, 0.5])
      uf = N.cholesky(cpu(), a, true)
      assert_close(l(N.cholesky_inv(cpu(), uf, true)), [0.375, -0.25, -0.25, 0.5])
    end

    test "lu: a = (l @ u)[pivots]" do
      # a = [[4, 3], [6, 3]]: pivot row 1 first; l = [[1, 0], [2/3, 1]], u = [[6, 3], [0, 1]]
      [p, lo, up] = N.lu(cpu(), t([4.0, 3.0, 6.0, 3.0], {:f, 32}, {2, 2}))
      assert Emily.dtype(p) == {:u, 32}
      assert l(p) == [1, 0]
      assert_close(l(lo), [1.0, 0.0, 2 / 3, 1.0])
      assert_close(l(up), [6.0, 3.0, 0.0, 1.0])
    end

    test "lu of a 3x3 f64 reconstructs" do
      a = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 10.0]]
      [p, lo, up] = N.lu(cpu(), t(List.flatten(a), {:f, 64}, {3, 3}))
      # row i of a is row pivots[i] of l @ u
      lu = mm(rows(l(lo), 3), rows(l(up), 3))
      assert_close(List.flatten(Enum.map(l(p), &Enum.at(lu, &1))), List.flatten(a), 1.0e-12)
    end

    test "lu_factor: packed factors and LAPACK's sequential row swaps" do
      [luf, piv] = N.lu_factor(cpu(), t([4.0, 3.0, 6.0, 3.0], {:f, 32}, {2, 2}))
      assert_close(l(luf), [6.0, 3.0, 2 / 3, 1.0])
      assert l(piv) == [1, 1]
    end

    test "lu_factor's LU feeds elementwise ops, its buffer reused by their results" do
      # MLX's LU output recorded its size in bytes as elements: an op built on the lazy LU,
      # reusing its buffer once the handle was released, wrote four times past its end
      # (this crashed the VM).
      n = 512
      s = cpu()

      for _ <- 1..5 do
        ramp = N.reshape(s, N.arange(s, 0.0, n * n * 1.0, 1.0, {:f, 32}), {n, n})
        a = N.add(s, N.eye(s, n, n, 0, {:f, 32}), N.multiply(s, ramp, t([1.0e-6])))
        [lu, _pivots] = N.lu_factor(s, a)
        y = N.exp(s, lu)
        N.tensor_release(lu)
        [lu_again, _] = N.lu_factor(s, a)
        # Every 1009th entry, against Elixir's exp of the same factorization.
        sample = &Enum.take_every(l(&1), 1009)
        assert_close(sample.(y), Enum.map(sample.(lu_again), &:math.exp/1), 1.0e-5)
      end

      assert_alive(s)
    end

    test "solve with a vector and a matrix right-hand side" do
      # [[3, 1], [1, 2]] x = [9, 8] -> x = [2, 3]
      a = t([3.0, 1.0, 1.0, 2.0], {:f, 32}, {2, 2})
      assert_close(l(N.solve(cpu(), a, t([9.0, 8.0]))), [2.0, 3.0])
      b = t([9.0, 1.0, 8.0, 2.0], {:f, 32}, {2, 2})
      # second column: [[3, 1], [1, 2]] x = [1, 2] -> x = [0, 1]
      assert_close(l(N.solve(cpu(), a, b)), [2.0, 0.0, 3.0, 1.0], 1.0e-5)
    end

    test "solve_triangular lower and upper" do
      lower = t([2.0, 0.0, 1.0, 4.0], {:f, 32}, {2, 2})
      assert_close(l(N.solve_triangular(cpu(), lower, t([2.0, 9.0]), false)), [1.0, 2.0])
      upper = t([2.0, 1.0, 0.0, 4.0], {:f, 32}, {2, 2})
      assert_close(l(N.solve_triangular(cpu(), upper, t([4.0, 8.0]), true)), [1.0, 2.0])
    end

    test "eigh and eigvalsh; uplo picks the triangle" do
      a = t([2.0, 1.0, 1.0, 2.0], {:f, 32}, {2, 2})
      [w, v] = N.eigh(cpu(), a, "L")
      assert_close(l(w), [1.0, 3.0])
      r = :math.sqrt(0.5)
      assert_close(List.flatten(normalize_columns(rows(l(v), 2))), [r, r, -r, r], 1.0e-6)
      # only the named triangle is read: [[2, 100], [1, 2]]
      b = t([2.0, 100.0, 1.0, 2.0], {:f, 64}, {2, 2})
      assert_close(l(N.eigvalsh(cpu(), b, "L")), [1.0, 3.0], 1.0e-12)
      assert_close(l(N.eigvalsh(cpu(), b, "U")), [-98.0, 102.0], 1.0e-12)
    end

    test "eig and eigvals return complex64" do
      a = t([1.0, 2.0, 0.0, 3.0], {:f, 32}, {2, 2})
      [w, _v] = N.eig(cpu(), a)
      assert Emily.dtype(w) == {:c, 64}
      assert Enum.sort(l(w)) == [{1.0, 0.0}, {3.0, 0.0}]
      # a rotation has eigenvalues +-i
      rot = t([0.0, -1.0, 1.0, 0.0], {:f, 32}, {2, 2})
      ws = l(N.eigvals(cpu(), rot)) |> Enum.sort()
      assert_close(ws, [{0.0, -1.0}, {0.0, 1.0}], 1.0e-6)
    end

    test "eig and eigvals of a matrix with a NaN or an infinity are NaN, each matrix alone" do
      # Unguarded, LAPACK's geev ran on bounds its balancing step never set, and MLX's eig
      # wrote past its eigenvector buffer: heap corruption that surfaced later, in some
      # other free (eigvals of an all-infinite 3x3 did it every time). Many rounds give it
      # the chance.
      nan = {:nan, :nan}
      inf = :infinity

      for _ <- 1..100, type <- [{:f, 32}, {:f, 64}] do
        a =
          t(
            [1.0, 2.0, 0.0, 3.0, :nan, 2.0, 3.0, 4.0, inf, 2.0, 3.0, :neg_infinity],
            type,
            {3, 2, 2}
          )

        [w, v] = N.eig(cpu(), a)
        [good, with_nan, with_inf] = Enum.chunk_every(l(w), 2)
        assert Enum.sort(good) == [{1.0, 0.0}, {3.0, 0.0}]
        assert with_nan == [nan, nan] and with_inf == [nan, nan]
        assert l(v) |> Enum.drop(4) == List.duplicate(nan, 8)
        assert l(N.eigvals(cpu(), a)) |> Enum.drop(2) == List.duplicate(nan, 4)

        all_inf = t(List.duplicate(inf, 9), type, {3, 3})
        assert l(N.eigvals(cpu(), all_inf)) == List.duplicate(nan, 3)
        assert l(hd(N.eig(cpu(), all_inf))) == List.duplicate(nan, 3)
      end

      # complex64 input: a NaN in either part.
      c = t([{1.0, 0.0}, {:nan, 0.0}, {0.0, 0.0}, {2.0, inf}], {:c, 64}, {1, 2, 2})
      assert l(N.eigvals(cpu(), c)) == [nan, nan]
      assert_alive(cpu())
    end

    test "svd, svdvals and pinv of a matrix with a NaN or an infinity are NaN, each matrix alone" do
      # Unguarded, LAPACK's bidiagonal QR spun forever on an infinity (holding the CPU
      # worker, and at exit the VM), and failed on a NaN.
      for type <- [{:f, 32}, {:f, 64}] do
        a =
          t(
            [3.0, 0.0, 0.0, 2.0, :infinity, 1.0, 2.0, 3.0, 1.0, :nan, 0.0, 1.0],
            type,
            {3, 2, 2}
          )

        [u, sv, vt] = N.svd(cpu(), a)
        [good, with_inf, with_nan] = Enum.chunk_every(l(sv), 2)
        assert_close(good, [3.0, 2.0], 1.0e-6)
        assert with_inf == [:nan, :nan] and with_nan == [:nan, :nan]
        assert Enum.drop(l(u), 4) == List.duplicate(:nan, 8)
        assert Enum.drop(l(vt), 4) == List.duplicate(:nan, 8)
        assert Enum.drop(l(N.svdvals(cpu(), a)), 2) == List.duplicate(:nan, 4)

        p = l(N.pinv(cpu(), a))
        assert_close(Enum.take(p, 4), [1 / 3, 0.0, 0.0, 0.5], 1.0e-6)
        assert Enum.drop(p, 4) == List.duplicate(:nan, 8)
      end

      assert_alive(cpu())
    end

    test "det and slogdet: small and LU paths" do
      assert_close(l(N.det(cpu(), t([1.0, 2.0, 3.0, 4.0], {:f, 32}, {2, 2}))), [-2.0])
      # a row swap of diag(1, 2, 3, 4): det = -24
      a = [0, 2, 0, 0, 1, 0, 0, 0, 0, 0, 3, 0, 0, 0, 0, 4]
      x = t(Enum.map(a, &(&1 * 1.0)), {:f, 64}, {4, 4})
      # MLX 0.32's CPU exp runs at f32 precision even for f64, and det is
      # sign * exp(log|det|) past 3x3.
      assert_close(l(N.det(cpu(), x)), [-24.0], 1.0e-6)
      [sign, logabs] = N.slogdet(cpu(), x)
      assert l(sign) == [-1.0]
      assert_close(l(logabs), [:math.log(24)], 1.0e-12)
      # integers are promoted to f32
      d = N.det(cpu(), t([2, 0, 0, 3], {:s, 32}, {2, 2}))
      assert Emily.dtype(d) == {:f, 32}
      assert l(d) == [6.0]
    end

    test "norms and cross" do
      assert l(N.norm(cpu(), t([3.0, 4.0]), [], false)) == [5.0]
      m = t([1.0, -2.0, 3.0, 4.0], {:f, 32}, {2, 2})
      assert l(N.norm(cpu(), m, [1], false)) |> Enum.map(&Float.round(&1, 5)) == [2.23607, 5.0]
      # inf-norm: largest absolute row sum
      assert l(N.norm_ord(cpu(), m, :infinity, [0, 1], false)) == [7.0]
      assert l(N.norm_ord(cpu(), t([3.0, -4.0]), 1, [], true)) == [7.0]
      assert_close(l(N.norm_str(cpu(), m, "fro", [0, 1], false)), [:math.sqrt(30)])
      d = t([3.0, 0.0, 0.0, -4.0], {:f, 32}, {2, 2})
      assert_close(l(N.norm_str(cpu(), d, "nuc", [0, 1], false)), [7.0])
      assert l(N.cross(s(), t([1.0, 0.0, 0.0]), t([0.0, 1.0, 0.0]), 0)) == [0.0, 0.0, 1.0]
    end

    test "every op rejects bad shapes or dtypes with Emily.Error; the stream survives" do
      c = cpu()
      vec = t([1.0, 2.0])
      rect = t([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], {:f, 32}, {2, 3})
      half = t([1.0, 0.0, 0.0, 1.0], {:f, 16}, {2, 2})
      ints = t([1, 0, 0, 1], {:s, 32}, {2, 2})
      sq = t([1.0, 0.0, 0.0, 1.0], {:f, 32}, {2, 2})

      cases = [
        {"qr", fn -> N.qr(c, vec) end},
        {"qr", fn -> N.qr(c, half) end},
        {"svd", fn -> N.svd(c, ints) end},
        {"svd", fn -> N.svdvals(c, vec) end},
        {"inv", fn -> N.inv(c, rect) end},
        {"inv", fn -> N.tri_inv(c, ints, false) end},
        {"pinv", fn -> N.pinv(c, vec) end},
        {"cholesky", fn -> N.cholesky(c, rect, false) end},
        {"cholesky", fn -> N.cholesky(c, half, true) end},
        {"cholesky_inv", fn -> N.cholesky_inv(c, vec, false) end},
        {"lu", fn -> N.lu(c, ints) end},
        {"lu_factor", fn -> N.lu_factor(c, vec) end},
        {"solve", fn -> N.solve(c, rect, vec) end},
        {"solve", fn -> N.solve(c, sq, t([1.0, 2.0, 3.0])) end},
        {"solve_triangular", fn -> N.solve_triangular(c, sq, t([1.0, 2.0, 3.0]), true) end},
        {"eigh", fn -> N.eigh(c, rect, "L") end},
        {"eigvalsh", fn -> N.eigvalsh(c, half, "L") end},
        {"eig", fn -> N.eig(c, rect) end},
        {"eigvals", fn -> N.eigvals(c, vec) end},
        {"det", fn -> N.det(c, rect) end},
        {"slogdet", fn -> N.slogdet(c, vec) end},
        {"norm", fn -> N.norm(c, rect, [0, 1, 2], false) end},
        {"norm_ord", fn -> N.norm_ord(c, rect, 3, [0, 1], false) end},
        {"norm_str", fn -> N.norm_str(c, rect, "bogus", [0, 1], false) end},
        {"cross", fn -> N.cross(c, t([1.0, 2.0, 3.0, 4.0]), t([1.0, 2.0, 3.0, 4.0]), 0) end}
      ]

      for {name, fun} <- cases do
        e = eval_error(fun)

        assert e.message =~ name, "#{name}: #{e.message}"
        assert_alive(c)
      end
    end

    test "bad Elixir arguments raise ArgumentError at once" do
      assert_raise ArgumentError, fn -> N.cholesky(cpu(), t([1.0]), :yes) end
      assert_raise ArgumentError, fn -> N.eigh(cpu(), t([1.0]), :lower) end
    end
  end
end
