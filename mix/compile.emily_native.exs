defmodule Mix.Tasks.Compile.EmilyNative do
  @moduledoc """
  Builds Emily's NIF (`native/emily`, a Rust crate) with cargo and installs it as
  `priv/native/libemily.so`.

  It rebuilds only when a Rust, C++ or op-table source changed, or when the MLX it links
  against changed (`EMILY_MLX_DIR`, else `scripts/setup`'s `$EMILY_CACHE/current`).
  Set `EMILY_CARGO_PROFILE=debug` for a debug build.
  """
  use Mix.Task.Compiler

  @crate "native/emily"

  @impl true
  def run(args) do
    root = Path.expand("..", __DIR__)
    crate = Path.join(root, @crate)
    lib = Path.join(root, "priv/native/libemily.so")
    stamp = Path.join(root, "priv/native/libemily.stamp")
    mlx = mlx_dir()

    sources =
      Path.wildcard(Path.join(crate, "{src,cpp,build,optable}/**/*")) ++
        Enum.map(~w(build.rs Cargo.toml Cargo.lock), &Path.join(crate, &1))

    fresh? =
      "--force" not in args and File.exists?(lib) and File.read(stamp) == {:ok, mlx} and
        Mix.Utils.stale?(sources, [lib]) == false

    if fresh? do
      {:noop, []}
    else
      build(crate, lib, stamp, mlx)
    end
  end

  defp build(crate, lib, stamp, mlx) do
    profile = System.get_env("EMILY_CARGO_PROFILE", "release")
    target_dir = Path.join(Mix.Project.build_path(), "native")

    args = [
      "build",
      "--manifest-path",
      Path.join(crate, "Cargo.toml"),
      "--target-dir",
      target_dir
    ]

    args = if profile == "release", do: args ++ ["--release"], else: args
    Mix.shell().info("Compiling Emily's NIF (cargo #{profile}) against #{mlx}")

    case System.cmd("cargo", args, stderr_to_stdout: true, into: IO.stream(:stdio, :line)) do
      {_, 0} ->
        ext = if match?({:unix, :darwin}, :os.type()), do: "dylib", else: "so"
        File.mkdir_p!(Path.dirname(lib))
        # Copy to a fresh inode: a running VM keeps the old one mapped.
        tmp = lib <> ".tmp"
        File.cp!(Path.join([target_dir, profile, "libemily.#{ext}"]), tmp)
        File.rename!(tmp, lib)
        File.write!(stamp, mlx)
        # Link _build's priv to priv/ in case it did not exist when Mix laid out _build.
        Mix.Project.build_structure()
        {:ok, []}

      {_, status} ->
        Mix.raise("cargo build of #{@crate} failed (exit #{status})")
    end
  end

  defp mlx_dir do
    dir =
      System.get_env("EMILY_MLX_DIR") ||
        Path.join(System.get_env("EMILY_CACHE", Path.expand("~/.cache/emily")), "current")

    case File.read_link(dir) do
      {:ok, target} -> Path.expand(target, Path.dirname(dir))
      _ -> Path.expand(dir)
    end
  end
end
