defmodule Emily.NxAbsent do
  @moduledoc false
  # Stands in for a suite that needs Nx when Nx is not loaded: one excluded `:nx` test per
  # test of the real suite, named after it (read from the suite's source), so a run
  # without Nx reports by count what it skipped.

  defmacro placeholders do
    __CALLER__.file
    |> File.read!()
    |> then(&Regex.scan(~r/^\s*test\s+"((?:[^"\\]|\\.)*)"/m, &1))
    |> Enum.map(fn [_, name] -> name end)
    |> Enum.with_index(1)
    |> Enum.map(fn {name, i} ->
      quote do
        test unquote("#{i}: #{name}"), do: flunk("needs Nx")
      end
    end)
  end
end
