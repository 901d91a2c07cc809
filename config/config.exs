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
