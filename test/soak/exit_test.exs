defmodule Emily.Soak.ExitTest do
  # A VM that halts while MLX is still computing must exit cleanly. At exit, C++ and
  # shared-library destructors (OpenBLAS unmaps its buffers) would otherwise run under
  # MLX's threads: without Emily's exit guard most of these runs crash or hang.
  use ExUnit.Case, async: false
  @moduletag :soak
  @moduletag timeout: 300_000

  @script """
  {:ok, _} = Application.ensure_all_started(:emily)
  alias Emily.Native, as: N

  for _ <- 1..8 do
    Task.async(fn ->
      st = Emily.Stream.new(:cpu)
      x = N.full(st, {384, 384}, 1.0e-3, {:f, 32})
      Emily.async_eval(Enum.reduce(1..8, x, fn _, acc -> N.matmul(st, acc, x) end))
    end)
  end
  |> Task.await_many()

  System.halt(0)
  """

  test "halting the VM while streams compute exits with status 0" do
    # The code path's ebin directories: its "." would name the working directory as an
    # app (a bundle unpacked as emily-bundle reads as emily-<version>, whose priv/ the
    # NIF would be looked for in).
    paths =
      for path <- :code.get_path(),
          Path.basename(to_string(path)) == "ebin",
          arg <- ["-pa", to_string(path)],
          do: arg

    elixir = [System.find_executable("elixir") | paths ++ ["-e", @script]]

    # Without the guard a VM can also hang in its exit: bound each run.
    [cmd | args] =
      case System.find_executable("timeout") do
        nil -> elixir
        timeout -> [timeout, "-s", "KILL", "120" | elixir]
      end

    for _ <- 1..Emily.Soak.n(3) do
      {out, status} = System.cmd(cmd, args, stderr_to_stdout: true)
      assert status == 0, "exit status #{status}: #{out}"
    end
  end
end
