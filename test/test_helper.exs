# Suites that need Nx are tagged :nx and excluded when Nx is not loaded (Nx is an optional
# dependency; see the README for running them). Soak and fuzz suites run at bounded sizes.
# Tests tagged :non_finite compute NaN or infinities on purpose; a build with
# EMILY_DEBUG=nan_inf rejects those results (as it is meant to), so it excludes them.
# With a GPU, a test may wait for minutes the first time the suite runs on a machine: each
# kernel's first use compiles it (NVRTC, cached on disk afterwards), and tests share the
# default GPU stream, so one waits behind the others' compiles (test/GPU.md).
# Suites tagged :training need Axon, and :conformance needs Bumblebee (both with Nx):
# where they are absent those suites are excluded and counted like the :nx ones.
nx? = Code.ensure_loaded?(Nx)
Application.ensure_all_started(:emily)
gpu? = :gpu in Emily.devices()
exclude = if nx?, do: [], else: [:nx]
exclude = if Code.ensure_loaded?(Axon), do: exclude, else: [:training | exclude]
exclude = if gpu?, do: exclude, else: [:gpu | exclude]
# Suites that read Emily's Mix project (mix.exs, mix/, scripts/release) run from a
# checkout under Mix, not from a bundle (scripts/bundle), which has none.
mix_project? = Code.ensure_loaded?(Emily.MixProject)
exclude = if mix_project?, do: exclude, else: [:install, :mix_project | exclude]
exclude = if Emily.Debug.detect_nan_inf?(), do: [:non_finite | exclude], else: exclude
# The conformance suites (test/conformance/README.md) are also opt-in where Bumblebee is
# loaded, as they load and compile a dozen models: `mix test --only conformance`; the
# full-size lanes (tagged :full) by their own tags, `mix test --only qwen3_full`.
exclude = [:conformance, :full | exclude]

ExUnit.start(
  exclude: exclude,
  timeout: if(gpu?, do: 300_000, else: 60_000),
  formatters: [ExUnit.CLIFormatter, Emily.SkipReport]
)
