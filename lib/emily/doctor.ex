defmodule Emily.Doctor do
  @moduledoc """
  What Emily runs on, and a self-check: the engine of `mix emily.doctor`, callable
  without Mix (`Emily.Doctor.run/1`) where there is none, e.g. in a bundle.

  It reports the MLX version and variant (cpu, cuda13, cuda12, metal), the devices MLX
  can use, the BLAS that MLX's CPU matmuls go to, the folder MLX keeps the kernels it
  compiles in (`Emily.KernelCache`) and, on CUDA, the headers MLX compiles its kernels
  against and whether Emily's own CUDA kernels run; then runs on each device a matmul,
  an elementwise chain and a 4-bit quantized matmul, checks their values against ones
  computed in Elixir or by an equivalent op, and reports GFLOP/s and GB/s.

  On CUDA, MLX compiles kernels at run time with NVRTC (its quantized matmuls among
  them) against the CUDA headers of the `nvidia-*` wheels beside its own
  (`nvidia/cu13/include`). The CUDA 13 wheels that `mlx-cuda-13` depends on ship `mma.h`
  without the `crt/` headers it includes; those come in the `nvidia-cuda-crt` wheel.
  Without them a kernel that includes `mma.h` fails to compile (an `Emily.Error`): on an
  H200 with MLX 0.32.4, the sm90 quantized matmul, which Emily no longer calls (its
  results are wrong, see `native/emily/cpp/guards.h`). The doctor names the folder and
  whether it has `crt/`.
  """
  alias Emily.Native, as: N

  @doc """
  Prints the report and runs the self-checks. Returns `:ok` if every check passed,
  `:error` otherwise. Options: `:size` (matmul size, default 2048).
  """
  @spec run(keyword) :: :ok | :error
  def run(opts \\ []) do
    size = opts[:size] || 2048
    site = mlx_site()
    variant = variant(site)

    info(
      "Emily #{Application.spec(:emily, :vsn)} on MLX #{Emily.mlx_version()} (variant: #{variant})"
    )

    info("libmlx: #{loaded("libmlx") || "not loaded?"}")
    info("NIF: #{nif_origin()}")

    info(
      "devices: #{Enum.map_join(Emily.devices(), ", ", &to_string/1)} (default: #{Emily.default_device()})"
    )

    info("BLAS for MLX's CPU matmuls: #{blas()}")

    if String.starts_with?(variant, "cuda") do
      info("CUDA headers for MLX's JIT: #{cuda_headers(site, variant)}")

      info(
        "Emily's CUDA kernels (a decoding step's products, attention and cache updates): #{cuda_kernels()}"
      )
    end

    info("MLX's compiled kernels: #{Emily.KernelCache.dir()} (private; see Emily.KernelCache)")
    info("malloc for MLX's CPU buffers: #{malloc()}")
    info("polling after waited-for work: #{Emily.Stream.spin_us()} us (config :emily, spin_us)")

    results = for device <- Emily.devices(), do: check(device, size)

    if Enum.all?(List.flatten(results)) do
      info("all checks passed")
      :ok
    else
      info("a self-check FAILED")
      :error
    end
  end

  defp check(device, n) do
    stream = Emily.Stream.default(device)
    info("\n#{device}:")

    # ones(n, n) . b with b[i][j] = j: every row of the product is n * j.
    a = N.full(stream, {n, n}, 1.0, {:f, 32})
    b = N.broadcast_to(stream, N.arange(stream, 0, n, 1, {:f, 32}), {n, n})
    Emily.eval([a, b])
    warm = N.matmul(stream, a, b)
    Emily.eval(warm)
    {us, c} = time(fn -> N.matmul(stream, a, b) end)
    gflops = 2 * n * n * n / us / 1000
    row = N.slice(stream, c, [n - 1, 0], [n, n], [1, 1]) |> Emily.to_list()
    # Exact on the CPU; GPUs multiply f32 as TF32 by default (10-bit mantissa).
    tol = if device == :cpu, do: 0.0, else: 1.0e-2

    matmul_ok =
      Enum.zip(row, 0..(n - 1)) |> Enum.all?(fn {x, j} -> abs(x - j * n) <= tol * j * n end)

    tf32 = if device == :gpu, do: " (TF32)", else: ""
    report("matmul #{n}x#{n}x#{n} f32#{tf32}", matmul_ok, "#{round1(gflops)} GFLOP/s")

    # ((x * 3 + 1) - 1) / 3 == x, exactly, for x = 2.5: a chain of four elementwise ops.
    m = 16 * 1024 * 1024
    x = N.full(stream, {m}, 2.5, {:f, 32})
    three = N.full(stream, {}, 3.0, {:f, 32})
    one = N.full(stream, {}, 1.0, {:f, 32})
    Emily.eval([x, three, one])
    program = elementwise_chain()
    chain = fn -> hd(Emily.Program.eval(program, [x, three, one], stream: stream)) end
    Emily.eval(chain.())
    {us2, y} = time(chain)
    # Each of the four ops reads and writes m floats.
    gbs = 4 * 2 * m * 4 / us2 / 1000
    values = Emily.to_list(N.slice(stream, y, [0], [8], [1]))
    chain_ok = values == List.duplicate(2.5, 8)
    report("elementwise chain, #{m} f32, one program", chain_ok, "#{round1(gbs)} GB/s")
    [matmul_ok, chain_ok, quantized_matmul(stream, tol)]
  end

  # x . dequantize(quantize(w))^T computed two ways: by the quantized kernel (on CUDA one
  # that MLX compiles at run time) and by a plain matmul of the dequantized weights (TF32
  # on a GPU, hence the matmul check's tolerance).
  defp quantized_matmul(stream, tol) do
    # 16 rows: on CUDA, fewer take a kernel that is not compiled at run time.
    {m, k, n} = {16, 256, 64}

    x =
      N.divide(
        stream,
        N.arange(stream, 0, m * k, 1, {:f, 32}),
        N.full(stream, {}, 1.0 * m * k, {:f, 32})
      )

    x = N.reshape(stream, x, {m, k})
    w = N.reshape(stream, N.sin(stream, N.arange(stream, 0, n * k, 1, {:f, 32})), {n, k})
    [wq, scales, biases] = N.quantize(stream, w, 64, 4)
    y = N.quantized_matmul(stream, x, wq, scales, biases, true, 64, 4, "affine")
    dw = N.dequantize(stream, wq, scales, biases, 64, 4, "affine", nil, {:f, 32})
    ref = N.matmul(stream, x, N.transpose(stream, dw, [1, 0]))

    max_abs = &(N.max(stream, N.abs(stream, &1), [0, 1], false) |> Emily.to_list() |> hd())
    rel = max_abs.(N.subtract(stream, y, ref)) / max_abs.(ref)
    ok = rel <= max(tol, 1.0e-5)

    report(
      "quantized matmul 4-bit #{m}x#{k}x#{n}",
      ok,
      "max |diff| / max |result| #{Float.round(rel, 8)} against dequantize + matmul"
    )

    ok
  rescue
    e in Emily.Error ->
      report("quantized matmul 4-bit", false, Exception.message(e))
      false
  end

  # ((x * three) + one - one) / three, of inputs [x, three, one], as one program (what
  # defn's native path runs), whose intermediates no tensor handle holds: MLX then writes
  # each op's result into its input's buffer, as it does for Python code that drops them.
  # Op by op, each result would stay allocated until the VM collects its handle, and every
  # op would fault in 64 MiB of fresh pages.
  defp elementwise_chain do
    Emily.Program.new(
      [{:multiply, [0, 1]}, {:add, [3, 2]}, {:subtract, [4, 2]}, {:divide, [5, 1]}],
      inputs: 3
    )
  end

  # Collects first: the process's garbage from the warm-up still holds MLX buffers (a
  # tensor's memory is freed when the VM collects its handle), and fresh allocations
  # beside them would be timed as page faults.
  defp time(fun) do
    :erlang.garbage_collect()

    {us, t} =
      :timer.tc(fn ->
        t = fun.()
        Emily.eval(t)
        t
      end)

    {max(us, 1), t}
  end

  defp report(what, ok?, figure) do
    info("  #{if ok?, do: "ok  ", else: "FAIL"} #{what}: #{figure}")
  end

  # Whether the NIF was downloaded (a release tarball) or built here, from the stamp the
  # Mix compiler writes beside it.
  defp nif_origin do
    stamp = Path.join(:code.priv_dir(:emily), "native/libemily.stamp")

    case File.read(stamp) do
      {:ok, "precompiled " <> rest} -> "precompiled " <> String.trim(rest)
      {:ok, mlx} -> "built from source against #{String.trim(mlx)}"
      _ -> "unknown (no #{stamp})"
    end
  end

  # The site-packages folder of the wheel libmlx came from (`mlx/lib/libmlx.so` in it).
  defp mlx_site do
    if path = loaded("libmlx"), do: path |> Path.dirname() |> Path.join("../..") |> Path.expand()
  end

  # The wheel libmlx came from, read off the dist-info folder beside `mlx/`.
  defp variant(site) do
    with site when is_binary(site) <- site,
         {:ok, entries} <- File.ls(site),
         wheel when is_binary(wheel) <-
           Enum.find(entries, &(&1 =~ ~r/^mlx_(cpu|cuda_1\d|metal)-.*dist-info$/)) do
      case Regex.run(~r/^mlx_(cpu|cuda_1\d|metal)-/, wheel) do
        [_, "cuda_" <> v] -> "cuda#{v}"
        [_, other] -> other
      end
    else
      _ -> "unknown"
    end
  end

  # Compiled in where Emily was built against MLX's CUDA build with CUDA's headers; they
  # run where the GPU, NVRTC and MLX's device allocator are found.
  defp cuda_kernels do
    if N.cuda_kernels(),
      do: "available",
      else: "not available (MLX's own ops compute the same, with more host work a step)"
  end

  # The folder MLX 0.32 gives NVRTC for the CUDA runtime headers: the `nvidia-*` wheels'
  # beside its own, else $CUDA_HOME or $CUDA_PATH, else /usr/local/cuda.
  defp cuda_headers(site, variant) do
    wheel = if variant == "cuda12", do: "cuda_runtime", else: "cu13"
    home = System.get_env("CUDA_HOME") || System.get_env("CUDA_PATH") || "/usr/local/cuda"

    dir =
      Enum.find(
        [Path.join([site, "nvidia", wheel, "include"]), Path.join(home, "include")],
        &File.dir?/1
      )

    cond do
      dir == nil ->
        "none found (kernels compiled at run time will fail: install the CUDA runtime headers)"

      File.exists?(Path.join(dir, "crt/mma.h")) ->
        "#{dir} (with crt/)"

      true ->
        "#{dir}, without crt/ (kernels that include mma.h cannot compile: install the " <>
          "nvidia-cuda-crt wheel of the same CUDA version beside the nvidia-* wheels)"
    end
  end

  defp malloc do
    case :persistent_term.get({Emily.Memory, :malloc}, :untouched) do
      {true, opts} ->
        "tuned (#{Enum.map_join(opts, ", ", fn {k, v} -> "#{k} #{div(v, 1024 ** 2)} MiB" end)})"

      {false, _} ->
        "left as it is (not glibc)"

      :untouched ->
        "left as the VM set it (config :emily, malloc: false)"
    end
  end

  defp blas do
    cond do
      lib = loaded("libopenblas") ->
        "OpenBLAS (#{lib}), #{System.get_env("OPENBLAS_NUM_THREADS", "default")} threads"

      match?({:unix, :darwin}, :os.type()) ->
        "Accelerate"

      true ->
        "the wheel's bundled reference BLAS (slow: was the NIF linked against OpenBLAS?)"
    end
  end

  # The path of a loaded shared library whose name starts with `prefix`.
  defp loaded(prefix) do
    with {:ok, maps} <- File.read("/proc/self/maps") do
      maps
      |> String.split("\n")
      |> Enum.map(&(String.split(&1) |> List.last()))
      |> Enum.find(&(is_binary(&1) and String.starts_with?(Path.basename(&1), prefix)))
    else
      _ -> nil
    end
  end

  defp round1(x), do: Float.round(x * 1.0, 1)
  defp info(msg), do: IO.puts(msg)
end
