defmodule Emily.SkipReport do
  @moduledoc false
  # An ExUnit formatter that reports, by count and reason, the tests a run excluded:
  # the `:nx` suites when Nx is not loaded, say.
  use GenServer

  def init(_opts), do: {:ok, %{}}

  # (ExUnit names the filter that excluded a test: "due to nx filter".)
  def handle_cast({:test_finished, %ExUnit.Test{state: {:excluded, why}, tags: tags}}, counts) do
    tag =
      Enum.find(
        [
          :nx,
          :conformance,
          :full,
          :training,
          :install,
          :mix_project,
          :gpu,
          :non_finite,
          :soak,
          :fuzz
        ],
        :other,
        fn tag ->
          tags[tag] && why =~ "due to #{tag} filter"
        end
      )

    {:noreply, Map.update(counts, tag, 1, &(&1 + 1))}
  end

  def handle_cast({:suite_finished, _}, counts) do
    for {tag, n} <- counts do
      IO.puts("Excluded #{n} test(s) tagged #{inspect(tag)}#{reason(tag)}")
    end

    {:noreply, counts}
  end

  def handle_cast(_event, counts), do: {:noreply, counts}

  defp reason(:nx), do: " (Nx is not loaded: run them where Nx is available, see README)"

  defp reason(:conformance) do
    if Code.ensure_loaded?(Bumblebee),
      do: " (opt-in: run them with mix test --only conformance)",
      else:
        " (Bumblebee is not loaded: run them where Hex is reachable, see test/conformance/README.md)"
  end

  defp reason(:training), do: " (Axon is not loaded: run them where Hex is reachable, see README)"
  defp reason(:gpu), do: " (no GPU device in this MLX build)"

  defp reason(:non_finite),
    do: " (they compute NaN or infinities, which EMILY_DEBUG=nan_inf rejects by design)"

  defp reason(tag) when tag in [:install, :mix_project],
    do: " (they read Emily's Mix project, which a bundle does not carry: run them with mix test)"

  defp reason(:full),
    do: " (full-size checkpoints, opt-in by tag: see test/conformance/README.md)"

  defp reason(_), do: ""
end
