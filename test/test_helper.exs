# Suites that need Nx are tagged :nx and excluded when Nx is not loaded (Nx is an optional
# dependency; see the README for running them). Soak and fuzz suites run at bounded sizes.
# Tests tagged :non_finite compute NaN or infinities on purpose; a build with
# EMILY_DEBUG=nan_inf rejects those results (as it is meant to), so it excludes them.
nx? = Code.ensure_loaded?(Nx)
Application.ensure_all_started(:emily)
exclude = if nx?, do: [], else: [:nx]
exclude = if :gpu in Emily.devices(), do: exclude, else: [:gpu | exclude]
exclude = if Emily.Debug.detect_nan_inf?(), do: [:non_finite | exclude], else: exclude

ExUnit.start(exclude: exclude, formatters: [ExUnit.CLIFormatter, Emily.SkipReport])
