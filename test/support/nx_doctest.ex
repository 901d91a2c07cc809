defmodule Emily.NxDocTest do
  @moduledoc false
  # `doctest/2` that skips single doctests rather than whole functions.
  #
  # ExUnit's `doctest` can leave out only whole functions (`:except`). This registers the
  # same tests as `doctest module` does (through ExUnit.DocTest's generator, as the
  # `doctest` macro itself does) and tags each listed one `skip: reason`, so it is
  # reported as skipped, with its reason, and every other doctest of the function runs.
  #
  # `skip` maps a doctest, named by its function and its place among that function's
  # doctests ("pinv/2 #3": the third), to the reason. ExUnit numbers the doctests of the
  # whole module ("Nx.LinAlg.pinv/2 (67)"), which shifts from one Nx release to the next
  # wherever any function gains or loses one; a function's own list does not. A name that
  # matches no doctest is a compile error, so a list cannot go stale silently.

  defmacro doctest_skipping(module, skip) do
    quote bind_quoted: [module: module, skip: skip] do
      file = ExUnit.DocTest.__file__(module)
      tests = Emily.NxDocTest.__named__(module, ExUnit.DocTest.__doctests__(module, []))

      case Map.keys(skip) -- Enum.map(tests, &elem(&1, 0)) do
        [] -> :ok
        stale -> raise ArgumentError, "no such doctests of #{inspect(module)}: #{inspect(stale)}"
      end

      for {short, {name, test, tags}} <- tests do
        tags = if reason = skip[short], do: tags ++ [skip: reason], else: tags
        @file file
        doc =
          ExUnit.Case.register_test(__MODULE__, __ENV__.file, __ENV__.line, :doctest, name, tags)

        def unquote(doc)(_), do: unquote(test)
      end
    end
  end

  @doc false
  # The Nx at hand: its release ("0.12.1", "0.13.1"), or "main" for Nx's unreleased
  # branch, which says 0.13.1 too but has `io_call/2`, which no release has.
  def nx_release do
    Code.ensure_loaded!(Nx.Defn.Kernel)

    if function_exported?(Nx.Defn.Kernel, :io_call, 2),
      do: "main",
      else: to_string(Application.spec(:nx, :vsn))
  end

  @doc false
  # Each doctest with its name here: "fun/arity #i", its place among the function's.
  def __named__(module, tests) do
    prefix = inspect(module) <> "."

    {named, _} =
      Enum.map_reduce(tests, %{}, fn {name, _test, _tags} = doctest, counts ->
        fun = name |> String.replace_prefix(prefix, "") |> String.replace(~r/ \(\d+\)$/, "")
        i = Map.get(counts, fun, 0) + 1
        {{"#{fun} ##{i}", doctest}, Map.put(counts, fun, i)}
      end)

    named
  end
end
