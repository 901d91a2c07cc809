# Runs the cells of every Livebook in notebooks/ (test/support/code_blocks.ex): the
# ```elixir cells in order, in one binding, the Mix.install cell left out (the project's
# own dependencies stand in for it). Each notebook runs once per level its cells reach:
# the Nx-free cells everywhere, the rest where Nx (and Axon, Bumblebee) are loaded.
defmodule Emily.NotebooksTest do
  use ExUnit.Case, async: false

  alias Emily.CodeBlocks

  @root Path.expand("..", __DIR__)
  @notebooks Path.wildcard(Path.join(@root, "notebooks/*.livemd")) |> Enum.sort()

  @tag :mix_project
  test "the notebooks: each installs Emily first, and mix.exs's docs list each of them" do
    names = Enum.map(@notebooks, &Path.basename(&1, ".livemd"))

    for name <-
          ~w(getting_started defn_and_serving bumblebee_text bumblebee_vision quantized_decoder
             mixed_precision memory_and_telemetry),
        do: assert(name in names, name)

    extras =
      for extra <- Emily.MixProject.project()[:docs][:extras] do
        case extra do
          {path, _opts} -> to_string(path)
          path -> to_string(path)
        end
      end

    for path <- @notebooks do
      assert Path.relative_to(path, @root) in extras, path
      [first | _] = CodeBlocks.parse(path)
      assert first.skip == "Mix.install", "#{path}: the first cell should be Mix.install"
      assert first.code =~ ~r/\{:emily, "~> \d+\.\d+"\}/
    end
  end

  for path <- @notebooks,
      blocks = CodeBlocks.parse(path),
      level <- CodeBlocks.levels_of(blocks),
      level in [:none, :nx] or CodeBlocks.available?(level) do
    name = Path.relative_to(path, @root)

    @tag Enum.map(CodeBlocks.tags(level), &{&1, true})
    @tag timeout: 600_000
    test "#{name}: its cells up to level #{level} run" do
      assert CodeBlocks.run!(unquote(path), unquote(level), @root) > 0
    end
  end
end
