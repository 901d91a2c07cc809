defmodule Mix.Tasks.Emily.Doctor do
  @shortdoc "Checks Emily's MLX install: version, devices, BLAS, and a short self-check"
  @moduledoc """
  Prints what Emily runs on and checks that it computes correctly and fast:

      mix emily.doctor

  See `Emily.Doctor` for what it reports. It exits non-zero if a check fails.

  Options: `--size N` (matmul size, default 2048).
  """
  use Mix.Task

  @impl true
  def run(args) do
    {opts, _} = OptionParser.parse!(args, strict: [size: :integer])
    Mix.Task.run("compile", ["--no-deps-check"])
    Mix.Task.run("app.start", ["--no-deps-check"])

    if Emily.Doctor.run(opts) != :ok do
      Mix.raise("emily.doctor: a self-check failed")
    end
  end
end
