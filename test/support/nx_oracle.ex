if Code.ensure_loaded?(Nx) do
  defmodule Emily.NxOracle do
    @moduledoc false
    # Compares Emily.Backend with Nx.BinaryBackend: random inputs (seeded by ExUnit's
    # seed), the same Nx call on both backends, results equal within a tolerance that
    # depends on the result's type.

    import ExUnit.Assertions

    @float_types [{:f, 16}, {:bf, 16}, {:f, 32}, {:f, 64}]
    @int_types [{:u, 8}, {:u, 16}, {:u, 32}, {:u, 64}, {:s, 8}, {:s, 16}, {:s, 32}, {:s, 64}]

    def float_types, do: @float_types
    def int_types, do: @int_types
    def real_types, do: @int_types ++ @float_types
    def all_types, do: real_types() ++ [{:c, 64}]

    @doc "A random shape of rank `min..max`, dims 1..4."
    def shape(min \\ 0, max \\ 3) do
      rank = Enum.random(min..max)
      List.to_tuple(for _ <- 1..rank//1, do: Enum.random(1..4))
    end

    @doc "A shape broadcastable with `shape` (scalar, suffix, or with dims set to 1)."
    def broadcastable(shape) do
      dims = Tuple.to_list(shape)

      case Enum.random(1..4) do
        1 -> shape
        2 -> {}
        3 -> dims |> Enum.drop(Enum.random(0..length(dims))) |> List.to_tuple()
        4 -> dims |> Enum.map(&if(:rand.uniform() < 0.5, do: 1, else: &1)) |> List.to_tuple()
      end
    end

    @doc """
    A random Nx.BinaryBackend tensor. `domain`: `:any`, `:positive`, `:unit` (-0.9..0.9),
    `:ge1`, `:halves` (multiples of 0.5), `:small` (small integers, so ties occur),
    `:nonzero`, `{:range, lo, hi}` (integers), `:special` (with NaN and infinities).
    """
    def tensor(shape, type, domain \\ :any) do
      n = Tuple.product(shape)
      values = for _ <- 1..n//1, do: value(type, domain)
      Nx.tensor(values, type: type, backend: Nx.BinaryBackend) |> Nx.reshape(shape)
    end

    defp value({:c, _}, domain), do: Complex.new(value({:f, 32}, domain), value({:f, 32}, domain))

    defp value({kind, bits}, domain) when kind in [:u, :s] do
      {lo, hi} =
        case domain do
          {:range, lo, hi} -> {lo, hi}
          :small -> {-3, 3}
          :positive -> {1, 9}
          :nonzero -> {-20, 20}
          _ -> {-50, 50}
        end

      {min, max} =
        if kind == :u, do: {0, 2 ** bits - 1}, else: {-(2 ** (bits - 1)), 2 ** (bits - 1) - 1}

      v = Enum.random(max(lo, min)..min(hi, max))
      if domain == :nonzero and v == 0, do: 1, else: v
    end

    defp value(_float, domain) do
      case domain do
        :any -> :rand.uniform() * 6 - 3
        :positive -> :rand.uniform() * 4 + 0.1
        :unit -> :rand.uniform() * 1.8 - 0.9
        :ge1 -> :rand.uniform() * 3 + 1
        :halves -> Enum.random(-8..8) / 2
        :small -> Enum.random(-3..3) * 1.0
        :nonzero -> Enum.random([-1, 1]) * (:rand.uniform() * 3 + 0.25)
        {:range, lo, hi} -> Enum.random(lo..hi) * 1.0
        :special -> Enum.random([:nan, :infinity, :neg_infinity, 1.5, -2.5, 0.0])
      end
    end

    @doc "Copies a container of tensors to Emily.Backend."
    def emily(container), do: Nx.backend_copy(container, Emily.Backend)

    @doc """
    Runs `fun` on `args` (BinaryBackend tensors and other terms) once on each backend,
    with that backend as the default, and asserts the results agree.
    """
    def check(fun, args, opts \\ []) do
      expected = Nx.with_default_backend(Nx.BinaryBackend, fn -> apply(fun, args) end)

      actual =
        Nx.with_default_backend(Emily.Backend, fn ->
          apply(fun, Enum.map(args, &to_emily/1))
        end)

      assert_same(actual, expected, opts)
      actual
    end

    defp to_emily(%Nx.Tensor{} = t), do: emily(t)
    defp to_emily(list) when is_list(list), do: Enum.map(list, &to_emily/1)

    defp to_emily(tuple) when is_tuple(tuple) and is_struct(elem(tuple, 0), Nx.Tensor),
      do: tuple |> Tuple.to_list() |> Enum.map(&to_emily/1) |> List.to_tuple()

    defp to_emily(other), do: other

    @doc "Asserts `actual` (Emily) and `expected` (BinaryBackend) agree."
    def assert_same(actual, expected, opts \\ [])

    def assert_same(%Nx.Tensor{} = actual, %Nx.Tensor{} = expected, opts) do
      assert %Emily.Backend{} = actual.data
      assert actual.shape == expected.shape
      assert actual.type == expected.type
      assert actual.names == expected.names

      a = Nx.to_flat_list(actual)
      e = Nx.to_flat_list(expected)
      {rtol, atol} = Keyword.get(opts, :tol, tol(expected.type))

      for {x, y} <- Enum.zip(a, e) do
        assert close?(x, y, rtol, atol),
               "#{inspect(x)} != #{inspect(y)} (#{inspect(expected.type)})\n" <>
                 "Emily:  #{inspect(actual, limit: 20)}\nBinary: #{inspect(expected, limit: 20)}"
      end
    end

    def assert_same(actual, expected, opts) when is_tuple(actual) and is_tuple(expected) do
      assert tuple_size(actual) == tuple_size(expected)

      Enum.zip(Tuple.to_list(actual), Tuple.to_list(expected))
      |> Enum.each(fn {a, e} -> assert_same(a, e, opts) end)
    end

    def tol({:f, 16}), do: {1.0e-2, 2.0e-2}
    def tol({:bf, 16}), do: {2.0e-2, 5.0e-2}
    def tol({:f, 32}), do: {2.0e-5, 1.0e-5}
    def tol({:c, 64}), do: {2.0e-5, 1.0e-5}
    def tol({:f, 64}), do: {1.0e-12, 1.0e-12}
    def tol(_int), do: {0, 0}

    defp close?(x, x, _, _), do: true

    defp close?(%Complex{} = x, %Complex{} = y, r, a),
      do: close?(x.re, y.re, r, a) and close?(x.im, y.im, r, a)

    defp close?(x, y, r, a) when is_number(x) and is_number(y),
      do: abs(x - y) <= a + r * abs(y)

    defp close?(_, _, _, _), do: false
  end
end
