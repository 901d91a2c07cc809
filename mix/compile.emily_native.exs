defmodule Mix.Tasks.Compile.EmilyNative do
  @moduledoc """
  Installs Emily's NIF as `priv/native/libemily.so`: precompiled, or built from source.

  A package (Emily as a dependency from Hex) downloads the precompiled NIF for its target
  and variant (`Mix.Emily.Precompiled`). A git checkout builds `native/emily` (a Rust
  crate) with cargo. `EMILY_BUILD=1` forces the source build, `EMILY_BUILD=0` the download.

  The source build reruns only when a Rust, C++ or op-table source changed, or when the
  MLX it links against changed (`EMILY_MLX_DIR`, else `scripts/setup`'s
  `$EMILY_CACHE/current`). Set `EMILY_CARGO_PROFILE=debug` for a debug build.
  """
  use Mix.Task.Compiler

  @crate "native/emily"

  @impl true
  def run(args) do
    root = Path.expand("..", __DIR__)

    if Mix.Emily.Precompiled.build_from_source?(root) do
      build_from_source(root, args)
    else
      install_precompiled(root)
    end
  end

  defp install_precompiled(root) do
    priv = Path.join(root, "priv")
    version = Mix.Project.config()[:version]

    case Mix.Emily.Precompiled.install(version: version, priv: priv) do
      :fresh ->
        {:noop, []}

      _ ->
        Mix.Project.build_structure()
        {:ok, []}
    end
  end

  defp build_from_source(root, args) do
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

    if System.find_executable("cargo") == nil or not File.exists?(Path.join(crate, "Cargo.toml")) do
      Mix.raise(
        "Emily: building the NIF from source needs cargo (a Rust toolchain) and the crate #{crate}; " <>
          "unset EMILY_BUILD to install the precompiled NIF instead"
      )
    end

    # build.rs falls back to ~/.cache/emily; where this platform's cache is elsewhere
    # (macOS, XDG_CACHE_HOME) it is told. Left alone otherwise: a changed variable reruns
    # the build script, and with it the whole C++ bridge.
    cache = Mix.Emily.Precompiled.cache_dir()

    env =
      if System.get_env("EMILY_CACHE") == nil and cache != Path.expand("~/.cache/emily"),
        do: [{"EMILY_CACHE", cache}],
        else: []

    opts = [stderr_to_stdout: true, into: IO.stream(:stdio, :line), env: env]

    case System.cmd("cargo", args, opts) do
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
        Path.join(Mix.Emily.Precompiled.cache_dir(), "current")

    case File.read_link(dir) do
      {:ok, target} -> Path.expand(target, Path.dirname(dir))
      _ -> Path.expand(dir)
    end
  end
end
