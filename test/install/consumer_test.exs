defmodule Emily.Install.ConsumerTest do
  # End to end, as a user installs Emily: the package as Hex ships it, a fresh project
  # depending on it, no Rust, no C++ compiler, no MLX; `mix compile` downloads the release
  # tarball (made by scripts/release) from a loopback server, then an op runs on it.
  # About a minute on two cores, most of it compiling Emily's Elixir in the new project.
  use ExUnit.Case, async: false

  alias Emily.LoopbackHTTP, as: HTTP
  alias Emily.ReleaseFixture, as: Fixture

  @moduletag :install
  @moduletag timeout: 600_000

  # Build tools a user without a toolchain lacks: none may be on the PATH.
  @toolchain ~w(cargo rustc rustup g++ c++ gcc cc clang clang++ ld make cmake python3 pip pip3)

  setup do
    dir = Path.join(System.tmp_dir!(), "emily-consumer-#{System.unique_integer([:positive])}")
    File.mkdir_p!(dir)
    server = HTTP.start()

    on_exit(fn ->
      HTTP.stop(server)
      File.rm_rf!(dir)
    end)

    %{dir: dir, server: server}
  end

  test "a project depending on the package compiles without a toolchain and runs an op", ctx do
    tarball = Fixture.tarball!()
    name = Fixture.name()
    HTTP.set(ctx.server, "/r/#{name}", {:file, tarball})
    HTTP.set(ctx.server, "/r/#{name}.sha256", {:body, File.read!(tarball <> ".sha256")})

    pkg = package!(Path.join(ctx.dir, "emily"))
    refute File.exists?(Path.join(pkg, ".git"))
    refute File.exists?(Path.join(pkg, "priv/native"))

    app = Path.join(ctx.dir, "consumer")
    File.mkdir_p!(Path.join(app, "config"))

    File.write!(Path.join(app, "mix.exs"), """
    defmodule Consumer.MixProject do
      use Mix.Project
      def project, do: [app: :consumer, version: "0.1.0", deps: [{:emily, path: #{inspect(pkg)}}]]
    end
    """)

    # The release URL and the variant through the application config, as a user sets them.
    File.write!(Path.join(app, "config/config.exs"), """
    import Config
    config :emily, variant: :#{Fixture.variant()}, release_url: "#{ctx.server.url}/r"
    """)

    env = env(ctx.dir)
    for tool <- @toolchain, do: assert(which(tool, env) == "", "#{tool} is on the PATH")

    {out, status} = mix(app, ["compile"], env)
    assert status == 0, out
    assert out =~ "downloading #{ctx.server.url}/r/#{name}"
    assert out =~ "installed #{name}"
    if System.get_env("EMILY_TEST_TRACE"), do: IO.puts(out)
    assert HTTP.hits(ctx.server, "/r/#{name}") == 1

    script = """
    x = Emily.from_list([1.0, 2.0, 3.0, 4.0], {:f, 32}, shape: {2, 2})
    y = Emily.Native.matmul(Emily.Stream.current(), x, x)
    z = Emily.Native.add(Emily.Stream.current(), y, Emily.from_list([0.5], {:f, 32}))
    maps = if File.exists?("/proc/self/maps"), do: File.read!("/proc/self/maps"), else: ""
    libs = for l <- String.split(maps, "\\n"), p = List.last(String.split(l)), p && p =~ ~r/lib(mlx|openblas|emily)\\.so/, uniq: true, do: p
    IO.puts("RESULT " <> inspect(Emily.to_list(z)))
    IO.puts("LIBS " <> Enum.join(libs, " "))
    """

    {out, status} = mix(app, ["run", "-e", script], env)
    assert status == 0, out
    # [[1, 2], [3, 4]]^2 = [[7, 10], [15, 22]], plus 0.5
    assert out =~ "RESULT [7.5, 10.5, 15.5, 22.5]"
    [libs] = Regex.run(~r/^LIBS ?(.*)$/m, out, capture: :all_but_first)
    libs = String.split(libs)
    # Linux: the NIF, libmlx and OpenBLAS, all from the install (macOS has no /proc).
    if :os.type() == {:unix, :linux}, do: assert(length(libs) == 3, out)

    for lib <- libs,
        do:
          assert(
            String.starts_with?(lib, Path.join(pkg, "priv/native")),
            "#{lib} not from the install"
          )

    # The doctor sees the installed MLX, its variant and (Linux) the carried OpenBLAS.
    {out, status} = mix(app, ["emily.doctor", "--size", "256"], env)
    assert status == 0, out
    assert out =~ "all checks passed"
    assert out =~ "(variant: #{Fixture.variant()})"

    if :os.type() == {:unix, :linux},
      do: assert(out =~ "OpenBLAS (#{Path.join(pkg, "priv/native/libopenblas.so.0")})", out)

    # Every compile re-checks the sidecar (`mix run` and the doctor compiled too) and
    # keeps the install.
    {out, status} = mix(app, ["compile"], env)
    assert status == 0, out
    assert HTTP.hits(ctx.server, "/r/#{name}.sha256") == 4
    assert HTTP.hits(ctx.server, "/r/#{name}") == 1
  end

  # The package as Hex builds it: exactly the files mix.exs's package lists.
  defp package!(dest) do
    {out, status} =
      System.cmd("mix", ["hex.build", "--unpack", "-o", dest],
        cd: Fixture.root(),
        stderr_to_stdout: true,
        env: [{"MIX_ENV", "prod"}]
      )

    assert status == 0, "mix hex.build --unpack failed (is Hex installed?):\n#{out}"
    dest
  end

  # A PATH of every command the user has, minus the toolchain; a fresh HOME and cache; none
  # of Emily's build settings.
  defp env(dir) do
    bin = Path.join(dir, "bin")
    File.mkdir_p!(bin)

    for d <- String.split(System.get_env("PATH"), ":"),
        d != "",
        File.dir?(d),
        {:ok, files} = File.ls(d),
        f <- files,
        f not in @toolchain,
        not String.match?(
          f,
          ~r/-(gcc|g\+\+|c\+\+|cc)(-\d+)?$|^(gcc|g\+\+|clang|cargo|rust|python)/
        ),
        exe = Path.join(d, f),
        not File.exists?(Path.join(bin, f)),
        File.regular?(exe) do
      File.ln_s!(exe, Path.join(bin, f))
    end

    home = Path.join(dir, "home")
    File.mkdir_p!(home)

    [
      {"PATH", bin},
      {"HOME", home},
      {"EMILY_CACHE", Path.join(dir, "cache")},
      {"MIX_ENV", "dev"}
    ] ++
      for(
        v <-
          ~w(EMILY_MLX_DIR EMILY_BUILD EMILY_VARIANT EMILY_RELEASE_URL EMILY_NVIDIA_DIR MIX_BUILD_PATH
              MIX_DEPS_PATH MIX_EXS MIX_TARGET ERL_LIBS LD_LIBRARY_PATH XDG_CACHE_HOME),
        do: {v, nil}
      )
  end

  defp which(tool, env) do
    {out, _} = System.cmd("sh", ["-c", "command -v #{tool} || true"], env: env)
    String.trim(out)
  end

  defp mix(app, args, env) do
    System.cmd(System.find_executable("mix"), args, cd: app, env: env, stderr_to_stdout: true)
  end
end
