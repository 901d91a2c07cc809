defmodule Mix.Emily.Precompiled do
  @moduledoc """
  Installs a precompiled NIF: `emily-nif-<version>-<variant>-<target>.tar.gz` from the
  release URL, checked against its `.sha256` sidecar, cached under `$EMILY_CACHE/nif` and
  extracted into `priv/native`.

  The sidecar is fetched on every run, so a republished asset replaces a stale cache. When
  the release URL cannot be reached at all, a cached tarball that matches the sidecar
  cached beside it is installed (and the output says so). Every failure leaves `priv/` and
  the cache as they were and names the URL, the checksums and `EMILY_BUILD=1`.

  Only OTP is used (`:httpc` with peer verification, `:crypto`, `:erl_tar`): the package
  has no build-time dependency.
  """

  # What the release workflow publishes: target => variants, the first the default.
  @artifacts %{
    "x86_64-linux-gnu" => ~w(cpu cuda13 cuda12),
    "aarch64-linux-gnu" => ~w(cpu),
    "aarch64-apple-darwin" => ~w(metal)
  }

  @default_url "https://github.com/emily-ml/emily/releases/download/v<version>"

  # A CUDA libmlx looks for cuBLAS, cuDNN, NVRTC... in `../../nvidia/*/lib`, and NVRTC's
  # CUDA headers in `../nvidia/...`, relative to itself: the layout of the nvidia-* wheels
  # in one site-packages folder. The tarball does not carry them (gigabytes); the install
  # links priv/native/nvidia to the user's copy when there is one.
  @cuda_variants ~w(cuda13 cuda12)

  def artifacts, do: @artifacts

  @doc "The release target of this machine (`x86_64-linux-gnu`, `aarch64-apple-darwin`...)."
  def target(arch \\ :erlang.system_info(:system_architecture)) do
    arch = to_string(arch)

    case String.split(arch, "-") do
      [cpu | rest] ->
        cpu = if cpu == "arm64", do: "aarch64", else: cpu

        cond do
          Enum.any?(rest, &String.starts_with?(&1, "darwin")) ->
            "#{cpu}-apple-darwin"

          Enum.any?(rest, &(&1 == "linux")) and Enum.any?(rest, &(&1 =~ ~r/^gnu/)) ->
            "#{cpu}-linux-gnu"

          Enum.any?(rest, &(&1 == "linux")) ->
            "#{cpu}-linux-#{List.last(rest)}"

          true ->
            arch
        end
    end
  end

  @doc "The variant asked for: `EMILY_VARIANT`, else `config :emily, variant:`, else the target's default."
  def variant(target) do
    v = env("EMILY_VARIANT") || Application.get_env(:emily, :variant)

    case v do
      nil -> @artifacts |> Map.get(target, ["cpu"]) |> hd()
      v -> to_string(v)
    end
  end

  defp env(name) do
    case System.get_env(name) do
      "" -> nil
      v -> v
    end
  end

  def asset_name(version, variant, target), do: "emily-nif-#{version}-#{variant}-#{target}.tar.gz"

  @doc "`EMILY_RELEASE_URL`, else `config :emily, release_url:`, else the GitHub release of `version`."
  def base_url(version) do
    url =
      env("EMILY_RELEASE_URL") || Application.get_env(:emily, :release_url) ||
        @default_url

    url |> String.replace("<version>", version) |> String.trim_trailing("/")
  end

  @doc """
  `$EMILY_CACHE`, else `${XDG_CACHE_HOME:-~/.cache}/emily` (Linux) or
  `~/Library/Caches/emily` (macOS): the same folder `scripts/setup` installs MLX into.
  """
  def cache_dir do
    case System.get_env("EMILY_CACHE") do
      dir when dir not in [nil, ""] ->
        Path.expand(dir)

      _ ->
        if match?({:unix, :darwin}, :os.type()) do
          Path.expand("~/Library/Caches/emily")
        else
          base = System.get_env("XDG_CACHE_HOME")
          base = if base in [nil, ""], do: Path.expand("~/.cache"), else: base
          Path.join(Path.expand(base), "emily")
        end
    end
  end

  @doc """
  Whether to build from source: `EMILY_BUILD=1` (or `true`) forces it, `EMILY_BUILD=0`
  (or `false`) forbids it, otherwise a git checkout of Emily builds and a package
  (as Hex ships it, no `.git`) downloads.
  """
  def build_from_source?(root) do
    case System.get_env("EMILY_BUILD") do
      v when v in ~w(1 true) -> true
      v when v in ~w(0 false) -> false
      _ -> File.exists?(Path.join(root, ".git"))
    end
  end

  @doc """
  Installs the NIF for `opts` into `opts[:priv]/native` unless it is already there.
  Returns `:installed`, `:fresh` (nothing to do) or `:offline` (installed or kept from
  the verified cache without reaching the release URL). Raises `Mix.Error` otherwise.

  Options: `:version`, `:priv` (required); `:target`, `:variant`, `:base_url`,
  `:cache_dir`, `:nvidia_dir` (default from the environment, see the functions above).
  """
  def install(opts) do
    version = Keyword.fetch!(opts, :version)
    target = Keyword.get_lazy(opts, :target, &target/0)
    variant = Keyword.get_lazy(opts, :variant, fn -> variant(target) end)
    name = asset_name(version, variant, target)
    base = Keyword.get_lazy(opts, :base_url, fn -> base_url(version) end)
    cache = Path.join(Keyword.get_lazy(opts, :cache_dir, &cache_dir/0), "nif")
    priv = Keyword.fetch!(opts, :priv)

    ctx = %{
      name: name,
      url: "#{base}/#{name}",
      sha_url: "#{base}/#{name}.sha256",
      tarball: Path.join(cache, name),
      sidecar: Path.join(cache, name <> ".sha256"),
      priv: priv,
      variant: variant,
      nvidia_dir: Keyword.get_lazy(opts, :nvidia_dir, fn -> nvidia_dir(variant) end),
      expected: nil,
      actual: nil
    }

    check_target!(ctx, target, variant)

    case fetch_sidecar(ctx) do
      {:ok, expected} ->
        ctx = %{ctx | expected: expected}

        if installed?(ctx) do
          :fresh
        else
          File.mkdir_p!(cache)
          install_verified(ctx)
          info("installed #{name} (sha256 #{expected}) into #{Path.join(priv, "native")}")
          :installed
        end

      {:offline, reason} ->
        offline(ctx, reason)
    end
  end

  defp check_target!(ctx, target, variant) do
    case Map.fetch(@artifacts, target) do
      {:ok, variants} ->
        if variant not in variants do
          fail(
            ctx,
            "there is no precompiled `#{variant}` NIF for #{target} (variants: #{Enum.join(variants, ", ")})",
            url: false
          )
        end

      :error ->
        known = @artifacts |> Map.keys() |> Enum.sort() |> Enum.join(", ")

        fail(
          ctx,
          "there is no precompiled NIF for this machine's target #{target} (targets: #{known})",
          url: false
        )
    end
  end

  # Installed from this very asset already: the stamp names it and its checksum.
  defp installed?(ctx) do
    native = Path.join(ctx.priv, "native")

    File.read(Path.join(native, "libemily.stamp")) == {:ok, stamp(ctx)} and
      File.exists?(Path.join(native, "libemily.so"))
  end

  # A CUDA install also records the nvidia-* folder it links: pointing EMILY_NVIDIA_DIR
  # elsewhere reinstalls.
  defp stamp(ctx) do
    case nvidia_link(ctx) do
      nil -> "precompiled #{ctx.name} #{ctx.expected}\n"
      nvidia -> "precompiled #{ctx.name} #{ctx.expected} #{nvidia}\n"
    end
  end

  defp nvidia_link(%{variant: variant, nvidia_dir: dir}) when variant in @cuda_variants do
    nvidia = dir && Path.join(dir, "nvidia")
    if nvidia && File.dir?(nvidia), do: nvidia
  end

  defp nvidia_link(_), do: nil

  defp fetch_sidecar(ctx) do
    case get(ctx.sha_url, 60_000) do
      {:ok, body} ->
        case String.split(body) do
          [sha | rest] ->
            sha = String.downcase(sha)
            named = List.first(rest)

            cond do
              not (sha =~ ~r/\A[0-9a-f]{64}\z/) ->
                fail(
                  ctx,
                  "the checksum file #{ctx.sha_url} does not hold a SHA-256 (it starts #{inspect(String.slice(body, 0, 40))})"
                )

              named not in [nil, ctx.name, "*" <> ctx.name] ->
                fail(ctx, "the checksum file #{ctx.sha_url} is for #{named}, not #{ctx.name}")

              true ->
                {:ok, sha}
            end

          [] ->
            fail(ctx, "the checksum file #{ctx.sha_url} is empty")
        end

      {:status, status} ->
        fail(ctx, "GET #{ctx.sha_url} answered HTTP #{status}")

      {:error, reason} ->
        {:offline, reason}
    end
  end

  defp offline(ctx, reason) do
    cached =
      with {:ok, text} <- File.read(ctx.sidecar),
           [sha | _] <- String.split(text),
           true <- File.exists?(ctx.tarball) do
        {:ok, sha}
      else
        _ -> :none
      end

    stamp = File.read(Path.join([ctx.priv, "native", "libemily.stamp"]))

    case cached do
      :none when elem(stamp, 0) == :ok ->
        # No cache (cleared?) but this asset is installed: keep it rather than fail.
        if String.starts_with?(elem(stamp, 1), "precompiled #{ctx.name} ") and
             File.exists?(Path.join([ctx.priv, "native", "libemily.so"])) do
          info(
            "offline (#{format_reason(reason)}): keeping the installed #{ctx.name} (no cached copy to re-verify)"
          )

          :offline
        else
          fail(
            ctx,
            "#{ctx.sha_url} could not be reached (#{format_reason(reason)}) and no verified copy is cached in #{Path.dirname(ctx.tarball)}"
          )
        end

      :none ->
        fail(
          ctx,
          "#{ctx.sha_url} could not be reached (#{format_reason(reason)}) and no verified copy is cached in #{Path.dirname(ctx.tarball)}"
        )

      {:ok, sha} ->
        ctx = %{ctx | expected: sha}

        case sha256_file(ctx.tarball) do
          ^sha ->
            where = Path.join(ctx.priv, "native")

            if installed?(ctx) do
              info(
                "offline (#{format_reason(reason)}): keeping #{ctx.name} in #{where}, verified against the cached checksum #{sha}"
              )
            else
              extract_and_swap(ctx, ctx.tarball)

              info(
                "offline (#{format_reason(reason)}): installed the cached #{ctx.name} into #{where}, verified against the cached checksum #{sha}"
              )
            end

            :offline

          actual ->
            fail(
              %{ctx | actual: actual},
              "#{ctx.sha_url} could not be reached (#{format_reason(reason)}) and the cached #{ctx.tarball} does not match its cached checksum"
            )
        end
    end
  end

  # A cached tarball is used if it matches the sidecar just fetched. Otherwise (absent, or
  # stale after a republish) it is downloaded beside it, verified and installed, and only
  # then replaces the cached one: a failure leaves the cache as it was.
  defp install_verified(ctx) do
    if File.exists?(ctx.tarball) and sha256_file(ctx.tarball) == ctx.expected do
      info("using the cached #{ctx.tarball} (matches #{ctx.sha_url})")
      extract_and_swap(ctx, ctx.tarball)
    else
      part = "#{ctx.tarball}.part-#{System.unique_integer([:positive])}"
      info("downloading #{ctx.url}")

      try do
        case get_to_file(ctx.url, part, 900_000) do
          :ok -> :ok
          {:status, status} -> fail(ctx, "GET #{ctx.url} answered HTTP #{status}")
          {:error, reason} -> fail(ctx, "GET #{ctx.url} failed: #{format_reason(reason)}")
        end

        case sha256_file(part) do
          expected when expected == ctx.expected ->
            extract_and_swap(ctx, part)
            File.rename!(part, ctx.tarball)
            File.write!(ctx.sidecar, "#{ctx.expected}  #{ctx.name}\n")

          actual ->
            size = File.stat!(part).size

            fail(
              %{ctx | actual: actual},
              "the download (#{size} bytes) does not match its checksum: corrupt, truncated or republished"
            )
        end
      after
        File.rm(part)
      end
    end
  end

  # Extracts beside priv/native, checks what came out, then swaps the folders, so priv/
  # holds either the old install or the whole new one.
  defp extract_and_swap(ctx, tarball) do
    File.mkdir_p!(ctx.priv)
    tmp = Path.join(ctx.priv, ".native-#{System.unique_integer([:positive])}")
    native = Path.join(ctx.priv, "native")
    old = native <> ".old-#{System.unique_integer([:positive])}"

    try do
      File.mkdir_p!(tmp)
      check_entries!(ctx, tarball)

      case :erl_tar.extract(String.to_charlist(tarball), [
             :compressed,
             {:cwd, String.to_charlist(tmp)}
           ]) do
        :ok -> :ok
        {:error, reason} -> broken!(ctx, tarball, "it cannot be extracted: #{inspect(reason)}")
      end

      new = Path.join(tmp, "native")

      if not File.regular?(Path.join(new, "libemily.so")) do
        broken!(ctx, tarball, "it holds no native/libemily.so")
      end

      link_nvidia(ctx, new)
      File.write!(Path.join(new, "libemily.stamp"), stamp(ctx))

      if File.exists?(native), do: File.rename!(native, old)
      File.rename!(new, native)
    after
      File.rm_rf(tmp)
      File.rm_rf(old)
    end
  end

  # Every entry under native/, plain files and folders only: nothing can land outside
  # priv/native, nor link out of it.
  defp check_entries!(ctx, tarball) do
    case :erl_tar.table(String.to_charlist(tarball), [:compressed, :verbose]) do
      {:ok, entries} ->
        Enum.each(entries, fn entry ->
          {name, type} = {to_string(elem(entry, 0)), elem(entry, 1)}
          parts = Path.split(name)

          if type not in [:regular, :directory] or hd(parts) != "native" or ".." in parts do
            broken!(
              ctx,
              tarball,
              "it holds #{inspect(name)} (#{type}): only files under native/ are allowed"
            )
          end
        end)

      {:error, reason} ->
        broken!(ctx, tarball, "it is not a gzip'ed tar: #{inspect(reason)}")
    end
  end

  # The asset matched its checksum but is unusable: a cached copy goes too.
  defp broken!(ctx, tarball, why) do
    if tarball == ctx.tarball do
      File.rm(ctx.tarball)
      File.rm(ctx.sidecar)
    end

    fail(%{ctx | actual: ctx.expected}, "#{ctx.name} matches its checksum but #{why}")
  end

  defp nvidia_dir(variant) when variant in @cuda_variants do
    case System.get_env("EMILY_NVIDIA_DIR") do
      dir when dir not in [nil, ""] ->
        Path.expand(dir)

      _ ->
        # What `scripts/setup cuda13` installs: the mlx-cuda wheel beside its nvidia-* wheels.
        Path.join(cache_dir(), "current")
    end
  end

  defp nvidia_dir(_), do: nil

  defp link_nvidia(%{variant: variant, nvidia_dir: dir} = ctx, new)
       when variant in @cuda_variants do
    if nvidia = nvidia_link(ctx) do
      File.ln_s!(nvidia, Path.join(new, "nvidia"))
      info("CUDA libraries: #{nvidia}")
    else
      info(
        "CUDA libraries: none in #{dir || "EMILY_NVIDIA_DIR"}/nvidia; libmlx will look on the system library path (CUDA #{String.trim_leading(variant, "cuda")}, cuDNN 9, NCCL) and CUDA_HOME"
      )
    end
  end

  defp link_nvidia(_, _), do: :ok

  defp fail(ctx, reason, opts \\ []) do
    lines =
      if Keyword.get(opts, :url, true) do
        ["  URL:             #{ctx.url}", "  checksum file:   #{ctx.sha_url}"] ++
          if(ctx.expected, do: ["  expected sha256: #{ctx.expected}"], else: []) ++
          if(ctx.actual, do: ["  actual sha256:   #{ctx.actual}"], else: [])
      else
        []
      end

    Mix.raise(
      Enum.join(
        ["Emily: cannot install the precompiled NIF #{ctx.name}: #{reason}." | lines] ++
          [
            "Nothing was installed. To build the NIF from source instead (Rust, a C++20 compiler and MLX: see scripts/setup), set EMILY_BUILD=1."
          ],
        "\n"
      )
    )
  end

  defp info(msg), do: Mix.shell().info("Emily: " <> msg)

  defp format_reason({:failed_connect, [{:to_address, _}, {_, _, reason}]}),
    do: format_reason(reason)

  defp format_reason({:failed_connect, _} = r), do: inspect(r)
  defp format_reason(reason) when is_atom(reason), do: Atom.to_string(reason)
  defp format_reason(reason), do: inspect(reason)

  def sha256_file(path) do
    ensure_app(:crypto)

    path
    |> File.stream!(1_048_576)
    |> Enum.reduce(:crypto.hash_init(:sha256), &:crypto.hash_update(&2, &1))
    |> :crypto.hash_final()
    |> Base.encode16(case: :lower)
  end

  # --- HTTP through OTP's :httpc -------------------------------------------------------

  @profile :emily_precompiled

  defp get(url, timeout) do
    case request(url, timeout, body_format: :binary) do
      {:ok, {{_, 200, _}, _headers, body}} -> {:ok, body}
      {:ok, {{_, status, _}, _headers, _body}} -> {:status, status}
      {:error, reason} -> {:error, reason}
    end
  end

  defp get_to_file(url, path, timeout) do
    case request(url, timeout, stream: String.to_charlist(path)) do
      {:ok, :saved_to_file} -> :ok
      {:ok, {{_, status, _}, _headers, _body}} -> {:status, status}
      {:error, reason} -> {:error, reason}
    end
  end

  defp request(url, timeout, opts) do
    start_httpc()
    uri = URI.parse(url)

    http_opts =
      [timeout: timeout, connect_timeout: 30_000, autoredirect: true] ++
        if uri.scheme == "https", do: [ssl: ssl_opts()], else: []

    :httpc.request(
      :get,
      {String.to_charlist(url), [{~c"user-agent", ~c"emily-mix"}]},
      http_opts,
      opts,
      @profile
    )
  end

  defp ssl_opts do
    [
      verify: :verify_peer,
      cacerts: :public_key.cacerts_get(),
      depth: 4,
      customize_hostname_check: [match_fun: :public_key.pkix_verify_hostname_match_fun(:https)]
    ]
  end

  # Mix prunes OTP applications a project does not depend on from the code path.
  defp ensure_app(app) do
    if Process.whereis(Mix.State), do: Mix.ensure_application!(app)
  end

  defp start_httpc do
    for app <- [:crypto, :public_key, :ssl, :inets] do
      ensure_app(app)
      {:ok, _} = Application.ensure_all_started(app)
    end

    case :inets.start(:httpc, profile: @profile) do
      {:ok, _} -> set_proxies()
      {:error, {:already_started, _}} -> :ok
    end
  end

  # HTTP_PROXY / HTTPS_PROXY as curl reads them; loopback and NO_PROXY hosts go direct.
  defp set_proxies do
    no_proxy =
      (System.get_env("NO_PROXY") || System.get_env("no_proxy") || "")
      |> String.split(",", trim: true)
      |> Enum.map(&(&1 |> String.trim() |> String.to_charlist()))

    no_proxy = [~c"localhost", ~c"127.0.0.1" | no_proxy]

    for {key, vars} <- [
          proxy: ~w(HTTP_PROXY http_proxy),
          https_proxy: ~w(HTTPS_PROXY https_proxy)
        ],
        url = Enum.find_value(vars, &System.get_env/1),
        url not in [nil, ""],
        %URI{host: host, port: port} when is_binary(host) <- [URI.parse(url)] do
      :httpc.set_options([{key, {{String.to_charlist(host), port}, no_proxy}}], @profile)
    end

    :ok
  end

  # --- for scripts/release and the release workflow ------------------------------------

  @doc false
  def main(["target"]), do: IO.puts(target())
  def main(["variant"]), do: IO.puts(variant(target()))
  def main(["name", version, variant, target]), do: IO.puts(asset_name(version, variant, target))

  def main(["list"]) do
    for {target, variants} <- Enum.sort(@artifacts),
        variant <- variants,
        do: IO.puts("#{target} #{variant}")
  end

  def main(["check", target, variant]) do
    if variant not in Map.get(@artifacts, target, []) do
      IO.puts(:stderr, "no release artifact #{variant} for #{target}: #{inspect(@artifacts)}")
      System.halt(1)
    end
  end
end
