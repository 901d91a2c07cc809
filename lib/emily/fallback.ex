defmodule Emily.Fallback do
  @moduledoc """
  Reporting ops that run off MLX.

  When `Emily.Backend` has no MLX path for an op (see "Fallbacks" in its docs) it runs
  the op on `Nx.BinaryBackend`. That is correct but slow (a copy out and back, and host
  arithmetic), so one setting chooses what else happens:

      config :emily, :fallback, :silent   # the default: run it, say nothing
      config :emily, :fallback, :warn     # also log a warning, once per op and inputs
      config :emily, :fallback, :raise    # raise ArgumentError instead of running it

  The setting is read at each fallback, so it can be changed at run time
  (`Application.put_env/3`). `:warn` logs the first time each op meets each combination
  of input types and shapes, not at every call. `:raise` runs a program with native
  paths only, to find what still falls back.

  Every fallback that runs is a `[:emily, :fallback, :start | :stop | :exception]`
  telemetry span (see `Emily.Telemetry`), whatever the setting.

  `config :emily, warn_on_fallback: true` is deprecated: it reads as `:fallback, :warn`
  (unless `:fallback` is `:raise`) and logs a deprecation warning once.
  """

  require Logger
  require Emily.Telemetry

  @table __MODULE__
  @modes [:silent, :warn, :raise]

  @typedoc "An input of the op: its shape and its Nx type, e.g. `{{2, 3}, {:f, 32}}`."
  @type input :: {tuple, tuple}

  @doc """
  Runs `fun` (the fallback itself) for `op` with `inputs` (the shape and type of each
  tensor input, e.g. `[{{2, 3}, {:f, 32}}]`) as `config :emily, :fallback` says: raises,
  or warns once per op and inputs, or neither; then runs `fun` in the
  `[:emily, :fallback, *]` span. Returns what `fun` returns.
  """
  @spec span(atom, [input], (-> result)) :: result when result: var
  def span(op, inputs, fun) when is_atom(op) and is_list(inputs) and is_function(fun, 0) do
    case mode() do
      :raise ->
        raise ArgumentError,
              "Emily.Backend has no native path for #{op} on #{describe(inputs)} " <>
                "(config :emily, :fallback is :raise)"

      :warn ->
        warn_once(op, inputs)

      :silent ->
        :ok
    end

    Emily.Telemetry.span :fallback, Emily.Telemetry.fallback_metadata(op, inputs) do
      fun.()
    end
  end

  @doc """
  What a fallback does besides running: `:silent`, `:warn` or `:raise`, from
  `config :emily, :fallback` (default `:silent`).
  """
  @spec mode() :: :silent | :warn | :raise
  def mode do
    case Application.get_env(:emily, :fallback, :silent) do
      :raise ->
        :raise

      mode when mode in @modes ->
        if mode == :silent and Application.get_env(:emily, :warn_on_fallback, false) == true do
          deprecated_warn_on_fallback()
          :warn
        else
          mode
        end

      other ->
        raise ArgumentError,
              "config :emily, :fallback must be one of #{inspect(@modes)}, got: " <>
                inspect(other)
    end
  end

  @doc false
  # The warning alone, once per op and inputs.
  def warn_once(op, inputs) when is_atom(op) and is_list(inputs) do
    if first?({op, inputs}) do
      Logger.warning(
        "Emily.Backend: #{op} on #{describe(inputs)} falls back to Nx.BinaryBackend " <>
          "(slow: a copy out of MLX and back). Logged once per op and input types and shapes."
      )
    end

    :ok
  end

  defp deprecated_warn_on_fallback do
    if first?(:warn_on_fallback) do
      Logger.warning(
        "config :emily, warn_on_fallback: true is deprecated: use config :emily, :fallback, :warn"
      )
    end
  end

  @doc false
  # Types and shapes as Nx prints them: "f32{2, 3}, s64{3}".
  def describe([]), do: "no tensor inputs"

  def describe(inputs) do
    Enum.map_join(inputs, ", ", fn
      {shape, type} when is_tuple(shape) -> type_name(type) <> inspect(shape)
      other -> inspect(other)
    end)
  end

  defp type_name({:f8_e4m3fn, 8}), do: "f8_e4m3fn"
  defp type_name({kind, bits}) when is_atom(kind) and is_integer(bits), do: "#{kind}#{bits}"
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
