# Suites that need Nx are tagged :nx and excluded when Nx is not loaded (Nx is an optional
# dependency; see the README for running them). Soak and fuzz suites run at bounded sizes.
nx? = Code.ensure_loaded?(Nx)
exclude = if nx?, do: [], else: [:nx]

ExUnit.start(exclude: exclude, formatters: [ExUnit.CLIFormatter, Emily.SkipReport])
