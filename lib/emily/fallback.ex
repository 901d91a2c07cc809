defmodule Emily.Fallback do
  @moduledoc """
  Reporting ops that run off MLX.

  When `Emily.Backend` has no MLX path for an op it runs it on another backend. That is
  correct but slow (a copy out and back, and host arithmetic), so it should be visible:

    * with `config :emily, warn_on_fallback: true` a warning is logged the first time
      each op meets each combination of input shapes and types (once, not per call);
    * a `[:emily, :fallback, :start | :stop | :exception]` telemetry span is emitted
      around every fallback (see `Emily.Telemetry`).

  The backend wraps each fallback in `span/3`; `warn_once/2` is the warning alone.
  """

  require Logger
  require Emily.Telemetry

  @table __MODULE__

  @doc """
  Runs `fun` (the fallback itself) for `op` with `inputs` (a list describing the inputs,
  e.g. `[{{2, 3}, {:f, 32}}]`): warns once per op and inputs if configured, and emits
  the `[:emily, :fallback, *]` span. Returns what `fun` returns.
  """
  @spec span(atom, list, (-> result)) :: result when result: var
  def span(op, inputs, fun) when is_atom(op) and is_list(inputs) and is_function(fun, 0) do
    warn_once(op, inputs)

    Emily.Telemetry.span :fallback, Emily.Telemetry.fallback_metadata(op, inputs) do
      fun.()
    end
  end

  @doc """
  Logs a warning that `op` fell back for `inputs`, the first time this op meets these
  inputs, when `config :emily, warn_on_fallback: true` (read at each call, so it can be
  switched at run time). Returns `:ok`.
  """
  @spec warn_once(atom, list) :: :ok
  def warn_once(op, inputs) when is_atom(op) and is_list(inputs) do
    if Application.get_env(:emily, :warn_on_fallback, false) and first?({op, inputs}) do
      Logger.warning(
        "Emily: #{op} has no MLX path for inputs #{describe(inputs)}; it runs on another " <>
          "backend (slow). Logged once per op and inputs."
      )
    end

    :ok
  end

  @doc false
  def describe(inputs) do
    Enum.map_join(inputs, ", ", fn
      {shape, type} when is_tuple(shape) -> "#{type_name(type)}#{inspect(Tuple.to_list(shape))}"
      other -> inspect(other)
    end)
  end

  defp type_name({kind, bits}), do: "#{kind}#{bits}"
  defp type_name(other), do: inspect(other)

  @doc false
  # Owned by Emily.Stream.Defaults, which lives as long as the application.
  def create_table do
    :ets.new(@table, [:named_table, :public, :set, read_concurrency: true])
  end

  @doc false
  def reset do
    if :ets.whereis(@table) != :undefined, do: :ets.delete_all_objects(@table)
    :ok
  end

  defp first?(key) do
    :ets.insert_new(@table, {key})
  rescue
    # The application is not running: warn every time rather than never.
    ArgumentError -> true
  end
end
