# Nx's own doctests (Nx, Nx.LinAlg, Nx.Random) with Emily.Backend as the default backend,
# as EXLA and Torchx run them. Inspect output is compared as Nx prints it
# (`add_backend_on_inspect` is off under test: config/config.exs). Ops without a native
# MLX path run through the Nx.BinaryBackend fallback here; `EMILY_FALLBACK=raise` runs
# the same suites with native paths only.
#
# Exclusions are single doctests, not whole functions (Emily.NxDocTest), each with its
# reason, named by function and place among the function's doctests ("pinv/2 #5"), which
# holds across Nx releases where the module's numbering does not. Those for one release
# only (its doctests print other values) are keyed by it.
if Code.ensure_loaded?(Nx) do
  defmodule Emily.Nx.DoctestTest do
    use ExUnit.Case, async: true
    import Emily.NxDocTest
    @moduletag :nx

    setup do
      Nx.default_backend(Emily.Backend)
      :ok
    end

    doctest_skipping(Nx, %{
      "log1p/1 #2" =>
        "rounding: MLX's f64 log1p(2.0) is 1.0986122886681096 (as glibc's log1p), one ulp " <>
          "below the doctest's 1.0986122886681098, the correctly rounded ln 3 " <>
          "(1.09861228866810969...)"
    })
  end

  defmodule Emily.Nx.LinAlgDoctestTest do
    use ExUnit.Case, async: true
    import Emily.NxDocTest
    @moduletag :nx

    setup do
      Nx.default_backend(Emily.Backend)
      :ok
    end

    # These doctests print the f32 rounding errors of Nx's own algorithms (Householder
    # QR, Jacobi SVD, Cholesky-Banachiewicz, ...), which Emily replaces with LAPACK's
    # (through MLX): both results are within a few f32 ulps of the exact one, but the
    # printed last digits differ. The exact values are noted.
    @rounding %{
      "cholesky/1 #2" =>
        "L's second row: Nx prints [2.1213205, 0.7071065], Emily [2.1213202, 0.7071071]; " <>
          "exact 3/sqrt(2) = 2.1213203..., sqrt(1/2) = 0.7071067...",
      "cholesky/1 #5" => "as cholesky/1 #2, vectorized",
      "pinv/2 #5" =>
        "the exact inverse is [[4, -1], [-3, 1]]; Nx prints -1.0000169 and 1.000013, Emily -1.0000144 and 1.0000111 (both via an SVD)",
      "pinv/2 #6" => "exact entries 1.0; Nx prints 0.99999994 twice, Emily once",
      "lu/1 #3" =>
        "p.l.u reconstructs the input exactly here (4.0, 1.0); Nx prints 3.9999998 and 0.9999999",
      "matrix_power/2 #6" =>
        "exact -110.375, 76.875, 92.25, -64.25; Nx prints -110.37471 etc., Emily -110.375015 etc.",
      "least_squares/3 #2" => "exact -0.95; Nx prints -0.95000035, Emily -0.95000017"
    }

    # Nx's releases print the f32 rounding of their own QR; later Nx prints what LAPACK
    # gives.
    releases_qr = %{
      "qr/2 #4" =>
        "R's last entry: Nx prints 1.4142137, Emily 1.4142135, the f32 nearest " <>
          "sqrt(2) = 1.41421356..."
    }

    @by_release %{"0.12.1" => releases_qr, "0.13.1" => releases_qr}

    doctest_skipping(Nx.LinAlg, Map.merge(@rounding, Map.get(@by_release, nx_release(), %{})))
  end

  defmodule Emily.Nx.RandomDoctestTest do
    use ExUnit.Case, async: true
    import Emily.NxDocTest
    @moduletag :nx

    setup do
      Nx.default_backend(Emily.Backend)
      :ok
    end

    # The same keys give the same bits and the same samples as Nx.BinaryBackend.
    doctest_skipping(Nx.Random, %{
      "normal/4 #4" =>
        "rounding: the mean of 1000 f32 samples prints 9.700221 (MLX sums f32 in f32) " <>
          "where Nx.BinaryBackend (which sums in f64) prints 9.700222"
    })
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
