import Config

# Nx's doctests print tensors without a backend line: keep inspect's output in Nx's
# format under test, and check every op's result shape and dtype against Nx's.
config :emily,
  add_backend_on_inspect: config_env() != :test,
  check_shape_and_type: config_env() == :test

# What an op without a native MLX path does besides running on Nx.BinaryBackend:
# :silent, :warn (log a warning) or :raise. EMILY_FALLBACK=raise runs a suite with
# native paths only.
fallback =
  case System.get_env("EMILY_FALLBACK", "silent") do
    "warn" -> :warn
    "raise" -> :raise
    _ -> :silent
  end

config :emily, :fallback, fallback

# Compile-time debug checks (Emily.Debug), off unless named in EMILY_DEBUG, a
# comma-separated list: EMILY_DEBUG=bounds,nan_inf turns on :debug_bounds_check and
# :debug_detect_nan_inf. A project depending on Emily recompiles it when they change;
# Emily's own build notices only a changed config file: `touch config/config.exs` first.
debug =
  System.get_env("EMILY_DEBUG", "") |> String.split(",", trim: true) |> Enum.map(&String.trim/1)

config :emily,
  debug_bounds_check: "bounds" in debug,
  debug_detect_nan_inf: "nan_inf" in debug
