defmodule Emily.OpTableTest do
  # Not async: it sets a global trace pattern on File.
  use ExUnit.Case, async: false

  alias Emily.Native.Table

  test "the op table is compiled in: reading it touches no file" do
    # A bundle or a release carries no `native/emily/optable`; its tests read the table.
    # (A process's calls are traced to another process: this one.)
    parent = self()

    reader =
      spawn_link(fn ->
        receive do
          :go -> send(parent, {:read, Table.rows(), Table.not_exposed()})
        end
      end)

    :erlang.trace_pattern({File, :_, :_}, true, [:local])
    :erlang.trace(reader, true, [:call])

    try do
      send(reader, :go)
      assert_receive {:read, rows, not_exposed}, 5_000
      assert length(rows) > 100
      assert Enum.any?(rows, &(&1.name == :add and &1.kind == :generated))
      assert [_ | _] = not_exposed
    after
      :erlang.trace_pattern({File, :_, :_}, false, [:local])
    end

    refute_receive {:trace, ^reader, :call, {File, _, _}}, 200
  end

  test "the compiled-in rows are those of the table files, where they are there" do
    files = Table.files()

    if Enum.all?(files, &File.exists?/1) do
      assert Table.rows() == Table.Source.rows(files)
      assert Table.not_exposed() == Table.Source.not_exposed(files)
    else
      # A bundle: the checkout's table is not on this machine; the first test covers it.
      assert [_ | _] = Table.rows()
    end
  end
end
