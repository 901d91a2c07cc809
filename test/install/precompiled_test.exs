defmodule Emily.Install.PrecompiledTest do
  # Not async: some tests set environment variables the installer reads.
  use ExUnit.Case, async: false

  alias Emily.LoopbackHTTP, as: HTTP
  alias Emily.ReleaseFixture, as: Fixture
  alias Mix.Emily.Precompiled, as: P

  @moduletag :install
  @moduletag timeout: 120_000

  setup_all do
    tarball = Fixture.tarball!()
    shared = Path.join(System.tmp_dir!(), "emily-install-#{System.unique_integer([:positive])}")
    File.mkdir_p!(shared)
    on_exit(fn -> File.rm_rf!(shared) end)

    # The same release, published again with one file changed: another real asset.
    other =
      Fixture.repack!(tarball, Path.join(shared, "other.tar.gz"), fn native ->
        File.write!(Path.join(native, "emily-nif.txt"), "republished\n", [:append])
      end)

    %{tarball: tarball, sha: P.sha256_file(tarball), name: Fixture.name(), other: other}
  end

  setup ctx do
    dir = Path.join(System.tmp_dir!(), "emily-install-#{System.unique_integer([:positive])}")
    File.mkdir_p!(dir)
    server = HTTP.start()
    HTTP.set(server, "/v/#{ctx.name}", {:file, ctx.tarball})
    HTTP.set(server, "/v/#{ctx.name}.sha256", {:body, File.read!(ctx.tarball <> ".sha256")})
    Mix.shell(Mix.Shell.Process)

    on_exit(fn ->
      Mix.shell(Mix.Shell.IO)
      HTTP.stop(server)
      File.rm_rf!(dir)
    end)

    %{
      server: server,
      priv: Path.join(dir, "priv"),
      cache: Path.join(dir, "cache"),
      dir: dir,
      asset: "/v/#{ctx.name}"
    }
  end

  defp install(ctx, opts \\ []) do
    P.install(
      Keyword.merge(
        [
          version: Fixture.version(),
          target: Fixture.target(),
          variant: Fixture.variant(),
          base_url: ctx.server.url <> "/v",
          priv: ctx.priv,
          cache_dir: ctx.cache
        ],
        opts
      )
    )
  end

  defp messages do
    receive do
      {:mix_shell, :info, [msg]} -> [msg | messages()]
    after
      0 -> []
    end
  end

  # Everything under `dir`, with each file's checksum: to show a failure changed nothing.
  defp snapshot(dir) do
    if File.exists?(dir) do
      Path.wildcard(Path.join(dir, "**"), match_dot: true)
      |> Enum.map(fn p ->
        {Path.relative_to(p, dir), if(File.regular?(p), do: P.sha256_file(p), else: :dir)}
      end)
      |> Enum.sort()
    else
      :absent
    end
  end

  defp linux?, do: :os.type() == {:unix, :linux}

  defp installed_manifest(ctx), do: File.read!(Path.join(ctx.priv, "native/emily-nif.txt"))

  describe "settings" do
    defp with_env(vars, fun) do
      saved = for {k, _} <- vars, do: {k, System.get_env(k)}

      try do
        Enum.each(vars, fn {k, v} ->
          if v, do: System.put_env(k, v), else: System.delete_env(k)
        end)

        fun.()
      after
        Enum.each(saved, fn {k, v} ->
          if v, do: System.put_env(k, v), else: System.delete_env(k)
        end)
      end
    end

    test "targets from OTP's system architecture" do
      assert P.target(~c"x86_64-pc-linux-gnu") == "x86_64-linux-gnu"
      assert P.target("aarch64-unknown-linux-gnu") == "aarch64-linux-gnu"
      assert P.target("aarch64-apple-darwin23.4.0") == "aarch64-apple-darwin"
      assert P.target("arm64-apple-darwin24.1.0") == "aarch64-apple-darwin"
      # musl is not published: the name keeps it apart, and install refuses it.
      assert P.target("x86_64-pc-linux-musl") == "x86_64-linux-musl"
      refute Map.has_key?(P.artifacts(), "x86_64-linux-musl")
    end

    test "EMILY_BUILD decides, else a git checkout builds and a package downloads", ctx do
      File.mkdir_p!(Path.join(ctx.dir, "pkg"))
      pkg = Path.join(ctx.dir, "pkg")
      git = Path.join(ctx.dir, "git")
      File.mkdir_p!(Path.join(git, ".git"))

      with_env([{"EMILY_BUILD", nil}], fn ->
        refute P.build_from_source?(pkg)
        assert P.build_from_source?(git)
      end)

      with_env([{"EMILY_BUILD", "1"}], fn -> assert P.build_from_source?(pkg) end)
      with_env([{"EMILY_BUILD", "0"}], fn -> refute P.build_from_source?(git) end)
    end

    test "variant and release URL: environment over config over defaults" do
      with_env([{"EMILY_VARIANT", nil}, {"EMILY_RELEASE_URL", nil}], fn ->
        assert P.variant("x86_64-linux-gnu") == "cpu"
        assert P.variant("aarch64-apple-darwin") == "metal"

        assert P.base_url("1.2.3") ==
                 "https://github.com/emily-ml/emily/releases/download/v1.2.3"

        Application.put_env(:emily, :variant, :cuda13)
        Application.put_env(:emily, :release_url, "https://mirror.example/emily/")

        try do
          assert P.variant("x86_64-linux-gnu") == "cuda13"
          assert P.base_url("1.2.3") == "https://mirror.example/emily"

          with_env(
            [{"EMILY_VARIANT", "cuda12"}, {"EMILY_RELEASE_URL", "http://h/v<version>"}],
            fn ->
              assert P.variant("x86_64-linux-gnu") == "cuda12"
              assert P.base_url("1.2.3") == "http://h/v1.2.3"
            end
          )
        after
          Application.delete_env(:emily, :variant)
          Application.delete_env(:emily, :release_url)
        end
      end)
    end

    test "the cache: EMILY_CACHE, else XDG_CACHE_HOME/emily, else ~/.cache/emily (Linux)" do
      with_env([{"EMILY_CACHE", "/x/cache"}], fn -> assert P.cache_dir() == "/x/cache" end)

      if match?({:unix, :darwin}, :os.type()) do
        with_env([{"EMILY_CACHE", nil}], fn ->
          assert P.cache_dir() == Path.expand("~/Library/Caches/emily")
        end)
      else
        with_env([{"EMILY_CACHE", nil}, {"XDG_CACHE_HOME", "/x/xdg"}], fn ->
          assert P.cache_dir() == "/x/xdg/emily"
        end)

        with_env([{"EMILY_CACHE", nil}, {"XDG_CACHE_HOME", nil}], fn ->
          assert P.cache_dir() == Path.expand("~/.cache/emily")
        end)
      end
    end

    @tag skip: if(:os.type() != {:unix, :linux}, do: "CUDA variants are Linux x86_64's")
    test "CUDA variants link the user's nvidia-* wheels beside libmlx", ctx do
      site = Path.join(ctx.dir, "site")
      File.mkdir_p!(Path.join(site, "nvidia/cu13/lib"))
      cuda = Fixture.repack!(ctx.tarball, Path.join(ctx.dir, "cuda.tar.gz"), fn _ -> :ok end)
      name = P.asset_name(Fixture.version(), "cuda13", "x86_64-linux-gnu")
      HTTP.set(ctx.server, "/v/#{name}", {:file, cuda})
      HTTP.set(ctx.server, "/v/#{name}.sha256", {:body, "#{P.sha256_file(cuda)}  #{name}\n"})

      assert install(ctx, variant: "cuda13", target: "x86_64-linux-gnu", nvidia_dir: site) ==
               :installed

      assert File.read_link!(Path.join(ctx.priv, "native/nvidia")) == Path.join(site, "nvidia")
      opts = [variant: "cuda13", target: "x86_64-linux-gnu"]
      assert install(ctx, opts ++ [nvidia_dir: site]) == :fresh

      # Another nvidia-* folder, or none (the system's CUDA), reinstalls and relinks.
      other = Path.join(ctx.dir, "other")
      File.mkdir_p!(Path.join(other, "nvidia"))
      assert install(ctx, opts ++ [nvidia_dir: other]) == :installed
      assert File.read_link!(Path.join(ctx.priv, "native/nvidia")) == Path.join(other, "nvidia")
      assert install(ctx, opts ++ [nvidia_dir: Path.join(ctx.dir, "none")]) == :installed
      refute File.exists?(Path.join(ctx.priv, "native/nvidia"))
      assert HTTP.hits(ctx.server, "/v/#{name}") == 1
    end
  end

  describe "a first install" do
    test "downloads, verifies, caches and extracts the real tarball into priv/native", ctx do
      assert install(ctx) == :installed
      native = Path.join(ctx.priv, "native")
      assert File.regular?(Path.join(native, "libemily.so"))
      assert File.regular?(Path.join(native, "mlx/lib/libmlx.so"))
      if linux?(), do: assert(File.regular?(Path.join(native, "libopenblas.so.0")))

      assert File.read!(Path.join(native, "libemily.stamp")) ==
               "precompiled #{ctx.name} #{ctx.sha}\n"

      assert installed_manifest(ctx) =~ "variant: #{Fixture.variant()}"
      assert P.sha256_file(Path.join(ctx.cache, "nif/#{ctx.name}")) == ctx.sha
      assert File.read!(Path.join(ctx.cache, "nif/#{ctx.name}.sha256")) =~ ctx.sha
      assert HTTP.hits(ctx.server, ctx.asset) == 1
      assert Enum.any?(messages(), &(&1 =~ "installed #{ctx.name}"))
      # No temporary folder or partial download is left behind.
      assert File.ls!(ctx.priv) == ["native"]

      assert File.ls!(Path.join(ctx.cache, "nif")) |> Enum.sort() == [
               ctx.name,
               ctx.name <> ".sha256"
             ]
    end

    @tag skip:
           if(:os.type() != {:unix, :linux},
             do: "ldd is Linux's; the consumer test loads the NIF on macOS"
           )
    test "the extracted NIF finds its libraries through relative rpaths alone", ctx do
      assert install(ctx) == :installed
      lib = Path.join(ctx.priv, "native/libemily.so")
      {ldd, 0} = System.cmd("ldd", [lib], env: [{"LD_LIBRARY_PATH", nil}])
      native = Path.join(ctx.priv, "native")

      for so <- ~w(libmlx.so libopenblas.so.0 libgfortran.so.5) do
        [line] = ldd |> String.split("\n") |> Enum.filter(&(&1 =~ ~r/^\s*#{Regex.escape(so)} /))
        assert line =~ native, "#{so} resolves outside the install: #{line}"
      end

      refute ldd =~ "not found"
    end
  end

  describe "later compiles" do
    test "re-fetch the sidecar; an unchanged asset is neither downloaded nor extracted again",
         ctx do
      assert install(ctx) == :installed
      before = snapshot(ctx.priv)
      assert install(ctx) == :fresh
      assert install(ctx) == :fresh
      assert HTTP.hits(ctx.server, ctx.asset <> ".sha256") == 3
      assert HTTP.hits(ctx.server, ctx.asset) == 1
      assert snapshot(ctx.priv) == before
    end

    test "reinstall from the verified cache when priv/ is gone", ctx do
      assert install(ctx) == :installed
      File.rm_rf!(ctx.priv)
      messages()
      assert install(ctx) == :installed
      assert HTTP.hits(ctx.server, ctx.asset) == 1
      assert File.regular?(Path.join(ctx.priv, "native/libemily.so"))
      assert Enum.any?(messages(), &(&1 =~ "using the cached"))
    end

    test "a republished asset replaces the stale cache and the install", ctx do
      assert install(ctx) == :installed

      republished = ctx.other
      new_sha = P.sha256_file(republished)
      refute new_sha == ctx.sha
      HTTP.set(ctx.server, ctx.asset, {:file, republished})
      HTTP.set(ctx.server, ctx.asset <> ".sha256", {:body, Fixture.sidecar(republished)})

      assert install(ctx) == :installed
      assert HTTP.hits(ctx.server, ctx.asset) == 2
      assert installed_manifest(ctx) =~ "republished"
      assert P.sha256_file(Path.join(ctx.cache, "nif/#{ctx.name}")) == new_sha
      assert File.read!(Path.join(ctx.priv, "native/libemily.stamp")) =~ new_sha
    end

    test "a cached tarball that no longer matches is downloaded again", ctx do
      assert install(ctx) == :installed
      File.rm_rf!(ctx.priv)
      File.write!(Path.join(ctx.cache, "nif/#{ctx.name}"), "damaged on disk")
      assert install(ctx) == :installed
      assert HTTP.hits(ctx.server, ctx.asset) == 2
      assert P.sha256_file(Path.join(ctx.cache, "nif/#{ctx.name}")) == ctx.sha
    end
  end

  describe "offline" do
    test "with a verified cache: keeps or reinstalls it, and says so", ctx do
      assert install(ctx) == :installed
      HTTP.stop(ctx.server)
      messages()
      assert install(ctx) == :offline
      assert [msg] = Enum.filter(messages(), &(&1 =~ "offline"))
      assert msg =~ "keeping #{ctx.name}"
      assert msg =~ ctx.sha

      File.rm_rf!(ctx.priv)
      assert install(ctx) == :offline
      assert Enum.any?(messages(), &(&1 =~ ~r/offline .*installed the cached #{ctx.name}/))
      assert File.regular?(Path.join(ctx.priv, "native/libemily.so"))
    end

    test "without a cache but installed: keeps the install, and says so", ctx do
      assert install(ctx) == :installed
      File.rm_rf!(ctx.cache)
      before = snapshot(ctx.priv)
      HTTP.stop(ctx.server)
      messages()
      assert install(ctx) == :offline
      assert Enum.any?(messages(), &(&1 =~ ~r/offline .*keeping the installed #{ctx.name}/))
      assert snapshot(ctx.priv) == before
    end

    test "without a cache: an error naming the URL, nothing installed", ctx do
      HTTP.stop(ctx.server)
      err = assert_raise Mix.Error, fn -> install(ctx) end
      assert err.message =~ "#{ctx.server.url}/v/#{ctx.name}.sha256 could not be reached"
      assert err.message =~ "EMILY_BUILD=1"
      assert snapshot(ctx.priv) == :absent
      assert snapshot(Path.join(ctx.cache, "nif")) in [:absent, []]
    end

    test "with a cached tarball that does not match its cached checksum: an error", ctx do
      assert install(ctx) == :installed
      File.rm_rf!(ctx.priv)
      File.write!(Path.join(ctx.cache, "nif/#{ctx.name}"), "damaged on disk")
      HTTP.stop(ctx.server)
      err = assert_raise Mix.Error, fn -> install(ctx) end
      assert err.message =~ "expected sha256: #{ctx.sha}"

      assert err.message =~
               "actual sha256:   #{P.sha256_file(Path.join(ctx.cache, "nif/#{ctx.name}"))}"

      assert snapshot(ctx.priv) == :absent
    end
  end

  describe "failures leave priv/ and the cache as they were" do
    # Each starts from an installed older asset, so "as they were" is not just "empty".
    setup ctx do
      HTTP.set(ctx.server, ctx.asset, {:file, ctx.other})
      HTTP.set(ctx.server, ctx.asset <> ".sha256", {:body, Fixture.sidecar(ctx.other)})
      assert install(ctx) == :installed
      HTTP.set(ctx.server, ctx.asset, {:file, ctx.tarball})
      HTTP.set(ctx.server, ctx.asset <> ".sha256", {:body, File.read!(ctx.tarball <> ".sha256")})
      %{before: {snapshot(ctx.priv), snapshot(ctx.cache)}}
    end

    defp assert_unchanged(ctx) do
      assert {snapshot(ctx.priv), snapshot(ctx.cache)} == ctx.before
      assert installed_manifest(ctx) =~ "republished"
    end

    defp assert_error(ctx, parts) do
      err = assert_raise Mix.Error, fn -> install(ctx) end

      for part <- parts,
          do: assert(err.message =~ part, "#{inspect(part)} not in:\n#{err.message}")

      assert err.message =~ "set EMILY_BUILD=1"
      assert_unchanged(ctx)
      err.message
    end

    test "tarball 404", ctx do
      HTTP.set(ctx.server, ctx.asset, {:status, 404})

      assert_error(ctx, [
        "GET #{ctx.server.url}#{ctx.asset} answered HTTP 404",
        "expected sha256: #{ctx.sha}"
      ])
    end

    test "sidecar 404", ctx do
      HTTP.set(ctx.server, ctx.asset <> ".sha256", {:status, 404})
      assert_error(ctx, ["#{ctx.server.url}#{ctx.asset}.sha256 answered HTTP 404"])
    end

    test "checksum mismatch", ctx do
      wrong = String.duplicate("ab", 32)
      HTTP.set(ctx.server, ctx.asset <> ".sha256", {:body, "#{wrong}  #{ctx.name}\n"})

      assert_error(ctx, [
        "URL:             #{ctx.server.url}#{ctx.asset}",
        "expected sha256: #{wrong}",
        "actual sha256:   #{ctx.sha}",
        "does not match its checksum"
      ])
    end

    test "truncated download", ctx do
      body = File.read!(ctx.tarball)
      HTTP.set(ctx.server, ctx.asset, {:truncate, body, div(byte_size(body), 2)})
      msg = assert_error(ctx, ["#{ctx.server.url}#{ctx.asset}", "expected sha256: #{ctx.sha}"])
      # Either the transfer fails, or its half fails the checksum.
      assert msg =~ "failed" or msg =~ "actual sha256: "
    end

    test "corrupt download (same length, other bytes)", ctx do
      size = File.stat!(ctx.tarball).size
      garbage = :binary.copy(<<0x5A>>, size)
      HTTP.set(ctx.server, ctx.asset, {:body, garbage})

      actual = :crypto.hash(:sha256, garbage) |> Base.encode16(case: :lower)
      assert_error(ctx, ["expected sha256: #{ctx.sha}", "actual sha256:   #{actual}"])
    end

    test "a published asset that matches its sidecar but is not a tarball", ctx do
      HTTP.set(ctx.server, ctx.asset, {:body, "not a tarball"})

      HTTP.set(
        ctx.server,
        ctx.asset <> ".sha256",
        {:body,
         "#{:crypto.hash(:sha256, "not a tarball") |> Base.encode16(case: :lower)}  #{ctx.name}"}
      )

      assert_error(ctx, ["matches its checksum but it is not a gzip'ed tar"])
    end

    test "a tarball with a path outside native/", ctx do
      evil = Path.join(ctx.dir, "evil.tar.gz")
      src = Path.join(ctx.dir, "x")
      File.write!(src, "x")

      :ok =
        :erl_tar.create(
          String.to_charlist(evil),
          [{~c"native/../../escape", String.to_charlist(src)}],
          [:compressed]
        )

      HTTP.set(ctx.server, ctx.asset, {:file, evil})
      HTTP.set(ctx.server, ctx.asset <> ".sha256", {:body, Fixture.sidecar(evil)})
      assert_error(ctx, ["only files under native/ are allowed"])
      refute File.exists?(Path.join(ctx.dir, "escape"))
    end

    test "a sidecar that holds no checksum", ctx do
      HTTP.set(ctx.server, ctx.asset <> ".sha256", {:body, "<html>sign in</html>"})
      assert_error(ctx, ["does not hold a SHA-256"])
    end

    test "a sidecar for another file", ctx do
      HTTP.set(
        ctx.server,
        ctx.asset <> ".sha256",
        {:body, "#{ctx.sha}  emily-nif-other.tar.gz\n"}
      )

      assert_error(ctx, ["is for emily-nif-other.tar.gz"])
    end

    test "unknown target: refused before any request", ctx do
      hits = HTTP.hits(ctx.server, ctx.asset <> ".sha256")
      err = assert_raise Mix.Error, fn -> install(ctx, target: "riscv64-linux-gnu") end
      assert err.message =~ "no precompiled NIF for this machine's target riscv64-linux-gnu"
      assert err.message =~ "x86_64-linux-gnu"
      assert err.message =~ "set EMILY_BUILD=1"
      assert HTTP.hits(ctx.server, ctx.asset <> ".sha256") == hits
      assert_unchanged(ctx)
    end

    test "unknown variant for the target: refused before any request", ctx do
      hits = HTTP.hits(ctx.server, ctx.asset <> ".sha256")
      err = assert_raise Mix.Error, fn -> install(ctx, variant: "metal") end
      assert err.message =~ "no precompiled `metal` NIF for #{Fixture.target()}"
      assert HTTP.hits(ctx.server, ctx.asset <> ".sha256") == hits
      assert_unchanged(ctx)
    end
  end
end
