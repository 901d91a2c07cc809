defmodule Emily.Soak do
  @moduledoc false
  # Sizes of the soak and fuzz suites. CI runs them at scale 1 (bounded, seconds);
  # EMILY_SOAK_SCALE=10 runs the full sizes the suites state.

  def scale do
    case Float.parse(System.get_env("EMILY_SOAK_SCALE", "1")) do
      {x, ""} when x > 0 -> x
      _ -> raise ArgumentError, "EMILY_SOAK_SCALE must be a positive number"
    end
  end

  def n(base), do: max(1, round(base * scale()))
end
