# Suites that need Nx are tagged :nx and excluded when Nx is not loaded (Nx is an optional
# dependency; see the README for running them). Soak and fuzz suites run at bounded sizes.
nx? = Code.ensure_loaded?(Nx)
Application.ensure_all_started(:emily)
exclude = if nx?, do: [], else: [:nx]
exclude = if :gpu in Emily.devices(), do: exclude, else: [:gpu | exclude]

ExUnit.start(exclude: exclude, formatters: [ExUnit.CLIFormatter, Emily.SkipReport])
