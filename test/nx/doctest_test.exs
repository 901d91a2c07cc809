# Nx's own doctests (Nx, Nx.LinAlg, Nx.Random) with Emily.Backend as the default backend,
# as EXLA and Torchx run them. Inspect output is compared as Nx prints it
# (`add_backend_on_inspect` is off under test: config/config.exs). Every exclusion says
# why. Ops without a native MLX path run through the Nx.BinaryBackend fallback here;
# `EMILY_FALLBACK=raise` runs the same suites with native paths only.
if Code.ensure_loaded?(Nx) do
  defmodule Emily.Nx.DoctestTest do
    use ExUnit.Case, async: true
    @moduletag :nx

    setup do
      Nx.default_backend(Emily.Backend)
      :ok
    end

    # Within an ulp or two, but the doctest compares printed digits.
    @rounding_error [
      # MLX's f64 log1p(2.0) is 1.0986122886681096, the correctly rounded value (C's
      # log1p agrees); the doctest prints Erlang's 1.0986122886681098.
      log1p: 1
    ]

    doctest Nx, except: @rounding_error
  end

  defmodule Emily.Nx.LinAlgDoctestTest do
    use ExUnit.Case, async: true
    @moduletag :nx

    setup do
      Nx.default_backend(Emily.Backend)
      :ok
    end

    # f32 results that differ from Nx.BinaryBackend's in the last printed digit: MLX
    # computes f32 in f32, BinaryBackend computes in f64 and rounds once at the end.
    @rounding_error [
      cholesky: 1,
      pinv: 2,
      lu: 1,
      matrix_power: 2,
      least_squares: 3
    ]

    # Where the op table has MLX's linear algebra (LAPACK), Emily solves with it instead
    # of Nx's own algorithms: solve, triangular_solve and svd then differ in the last f32
    # digit, qr's Q can differ in the sign of a column (with R's row), and a singular
    # triangular system gives inf/NaN instead of raising.
    @lapack [solve: 2, triangular_solve: 3, svd: 2, qr: 2]

    doctest Nx.LinAlg, except: @rounding_error ++ @lapack
  end

  defmodule Emily.Nx.RandomDoctestTest do
    use ExUnit.Case, async: true
    @moduletag :nx

    setup do
      Nx.default_backend(Emily.Backend)
      :ok
    end

    # The same keys give the same bits; the normal samples then differ from
    # Nx.BinaryBackend's in the last printed f32 digit (f32 vs f64-then-rounded
    # arithmetic in the Box-Muller/erf_inv steps).
    @rounding_error [
      normal: 4,
      multivariate_normal: 4
    ]

    doctest Nx.Random, except: @rounding_error
  end

  # Nx's backend documentation guides, where the Nx dependency ships them.
  nx_dir = Mix.Project.deps_paths()[:nx]

  guides =
    if nx_dir, do: Path.wildcard(Path.join(nx_dir, "guides/backend_documentation/*.md")), else: []

  if guides != [] do
    defmodule Emily.Nx.GuidesDoctestTest do
      use ExUnit.Case, async: true
      @moduletag :nx

      setup do
        Nx.default_backend(Emily.Backend)
        :ok
      end

      for guide <- guides, do: doctest_file(guide)
    end
  end
else
  for {name, what} <- [
        {Emily.Nx.DoctestTest, "Nx"},
        {Emily.Nx.LinAlgDoctestTest, "Nx.LinAlg"},
        {Emily.Nx.RandomDoctestTest, "Nx.Random"}
      ] do
    defmodule name do
      use ExUnit.Case, async: true
      @moduletag :nx

      test "#{what}'s doctests (need Nx)" do
        flunk("Nx is not loaded")
      end
    end
  end
end
