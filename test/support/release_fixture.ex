defmodule Emily.ReleaseFixture do
  @moduledoc """
  A real release tarball for the install tests: `scripts/release` packs this checkout's
  built NIF (priv/native/libemily.so) with the MLX it was built against. Made once and
  reused while the NIF and the script are unchanged.
  """

  @root Path.expand("../..", __DIR__)

  def root, do: @root
  # Emily's, also where another project (a harness) runs these tests.
  def version, do: to_string(Application.spec(:emily, :vsn))
  def target, do: Mix.Emily.Precompiled.target()
  @doc "The target's default variant: cpu on Linux, metal on macOS."
  def variant, do: Mix.Emily.Precompiled.artifacts() |> Map.get(target(), ["cpu"]) |> hd()
  def name, do: Mix.Emily.Precompiled.asset_name(version(), variant(), target())

  @doc "The tarball's path (its `.sha256` sidecar beside it)."
  def tarball! do
    out = Path.join(@root, "_build/test/release")
    tarball = Path.join(out, name())
    lib = Path.join(@root, "priv/native/libemily.so")
    inputs = [lib, Path.join(@root, "scripts/release"), Path.join(@root, "mix/precompiled.exs")]

    if Mix.Utils.stale?(inputs, [tarball, tarball <> ".sha256"]) do
      {log, status} =
        System.cmd(Path.join(@root, "scripts/release"), ["--lib", lib, "--out", out],
          cd: @root,
          stderr_to_stdout: true,
          env: [{"EMILY_VARIANT", variant()}]
        )

      if status != 0, do: raise("scripts/release failed (#{status}):\n#{log}")
    end

    tarball
  end

  @doc "`tarball` unpacked and packed again with `change` applied to its folder: another real asset."
  def repack!(tarball, dest, change) do
    tmp = Path.join(System.tmp_dir!(), "emily-repack-#{System.unique_integer([:positive])}")
    File.mkdir_p!(tmp)

    try do
      :ok =
        :erl_tar.extract(String.to_charlist(tarball), [
          :compressed,
          {:cwd, String.to_charlist(tmp)}
        ])

      change.(Path.join(tmp, "native"))

      {_, 0} = System.cmd("tar", ["-C", tmp, "-czf", dest, "native"])
      dest
    after
      File.rm_rf!(tmp)
    end
  end

  def sidecar(path), do: "#{Mix.Emily.Precompiled.sha256_file(path)}  #{name()}\n"
end
