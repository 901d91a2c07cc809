defmodule Emily.NxDocTest do
  @moduledoc false
  # `doctest/2` that skips single doctests rather than whole functions.
  #
  # ExUnit's `doctest` can leave out only whole functions (`:except`). This registers the
  # same tests as `doctest module` does (through ExUnit.DocTest's generator, as the
  # `doctest` macro itself does) and tags each listed one `skip: reason`, so it is
  # reported as skipped, with its reason, and every other doctest of the function runs.
  #
  # `skip` maps a doctest's name, as ExUnit numbers the module's doctests
  # ("Nx.LinAlg.pinv/2 (67)"), to the reason. A name that matches no doctest is a
  # compile error, so a list cannot go stale silently.

  defmacro doctest_skipping(module, skip) do
    quote bind_quoted: [module: module, skip: skip] do
      file = ExUnit.DocTest.__file__(module)
      tests = ExUnit.DocTest.__doctests__(module, [])

      names =
        for test <- tests, do: String.replace_prefix(elem(test, 0), inspect(module) <> ".", "")

      case Map.keys(skip) -- names do
        [] -> :ok
        stale -> raise ArgumentError, "no such doctests of #{inspect(module)}: #{inspect(stale)}"
      end

      for {name, test, tags} <- tests do
        short = String.replace_prefix(name, inspect(module) <> ".", "")
        tags = if reason = skip[short], do: tags ++ [skip: reason], else: tags
        @file file
        doc =
          ExUnit.Case.register_test(__MODULE__, __ENV__.file, __ENV__.line, :doctest, name, tags)

        def unquote(doc)(_), do: unquote(test)
      end
    end
  end
end
