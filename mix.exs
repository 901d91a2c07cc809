Code.require_file("mix/precompiled.exs", __DIR__)
Code.require_file("mix/compile.emily_native.exs", __DIR__)

defmodule Emily.MixProject do
  use Mix.Project

  @version "0.3.0"
  @source_url "https://github.com/emily-ml/emily"

  def project do
    [
      app: :emily,
      version: @version,
      elixir: "~> 1.17",
      start_permanent: Mix.env() == :prod,
      compilers: [:emily_native | Mix.compilers()],
      elixirc_paths: elixirc_paths(Mix.env()),
      deps: deps(),
      aliases: aliases(),
      description:
        "MLX for Elixir: an Nx backend and defn compiler on Apple's MLX (Metal, CUDA, CPU)",
      package: package(),
      # ExDoc is not a dependency: with Debian's elixir-ex-doc (scripts/setup) it is in
      # Elixir's own lib path, and `mix do compile --no-deps-check + docs` builds the docs
      # without Hex (Nx's modules only where Nx is loaded).
      docs: [
        main: "readme",
        source_url: @source_url,
        source_ref: "v#{@version}",
        extras:
          ~w(README.md guides/getting_started.md guides/devices_and_variants.md
             guides/bumblebee_and_serving.md guides/concurrency_with_streams.md
             guides/memory.md guides/quantization.md guides/cuda_server.md
             guides/beyond_one_machine.md guides/fallbacks.md) ++
            for(
              nb <- ~w(getting_started defn_and_serving bumblebee_text bumblebee_vision
                       quantized_decoder mixed_precision memory_and_telemetry),
              do: {"notebooks/#{nb}.livemd", filename: "notebook_#{nb}"}
            ),
        groups_for_extras: [Guides: ~r"^guides/", Notebooks: ~r"^notebooks/"],
        groups_for_modules: [
          Nx: [Emily.Backend, Emily.Compiler, Emily.Fast],
          "Quantization and training": [
            Emily.Quantization,
            Emily.QuantizedWeight,
            Emily.Quantization.Layers,
            Emily.MixedPrecision
          ],
          Runtime: [
            Emily.Stream,
            Emily.Memory,
            Emily.Telemetry,
            Emily.Fallback,
            Emily.Debug,
            Emily.KernelCache,
            Emily.Doctor
          ],
          "Below Nx": [Emily, Emily.Native, Emily.Program, Emily.Error]
        ]
      ],
      test_coverage: [ignore_modules: [Emily.TestCase]]
    ]
  end

  def application do
    [extra_applications: [:logger], mod: {Emily.Application, []}]
  end

  defp elixirc_paths(:test), do: ["lib", "test/support"]
  defp elixirc_paths(_), do: ["lib"]

  defp deps do
    [
      {:nx, "~> 0.12.1 or ~> 0.13.1", optional: true},
      {:telemetry, "~> 1.0", optional: true}
    ]
  end

  # Nx and telemetry are optional: without them (no package registry, say) Mix's dependency
  # check would stop the build, so the doctor compiles past it like `mix test --no-deps-check`.
  defp aliases do
    ["emily.doctor": ["compile --no-deps-check", "emily.doctor"]]
  end

  defp package do
    [
      licenses: ["Apache-2.0"],
      links: %{"GitHub" => @source_url},
      files: ~w(lib mix native/emily/src native/emily/cpp native/emily/build native/emily/optable
                native/emily/build.rs native/emily/Cargo.toml native/emily/Cargo.lock scripts
                mix.exs README.md)
    ]
  end
end
