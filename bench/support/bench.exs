# Shared by the benchmarks: timing, and running the Python reference of a figure.
defmodule Bench do
  @moduledoc false

  @doc "Best mean time per call of `fun`, in microseconds, over `rounds` rounds of `reps` calls (after a warm-up)."
  def best(fun, reps, rounds \\ 5) do
    fun.()

    for _ <- 1..rounds do
      {us, _} = :timer.tc(fn -> Enum.each(1..reps, fn _ -> fun.() end) end)
      us / reps
    end
    |> Enum.min()
  end

  @doc """
  Runs a Python reference script with the `mlx` package that sits on Emily's own libmlx
  (`EMILY_PYTHONPATH`, default `$EMILY_CACHE/current`) and returns its `name value` lines
  as a map.
  """
  def python(script, args \\ [], env \\ []) do
    path =
      System.get_env("EMILY_PYTHONPATH") ||
        Path.join(System.get_env("EMILY_CACHE", Path.expand("~/.cache/emily")), "current")

    {out, 0} = System.cmd("python3", [script | args], env: [{"PYTHONPATH", path} | env])

    for line <- String.split(out, "\n", trim: true),
        [k, v] <- [String.split(line)],
        {x, ""} <- [Float.parse(v)],
        into: %{},
        do: {k, x}
  end
end
