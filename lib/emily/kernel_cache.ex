defmodule Emily.KernelCache do
  @moduledoc """
  Where MLX keeps the kernels it compiles at run time, and why that folder is private.

  MLX compiles code while it runs: on the CPU, a compiled program (`compile: true`,
  `Emily.Compiler`'s native path) becomes C++ that MLX builds with the system's C++
  compiler into a shared library and loads; on CUDA, NVRTC compiles kernels whose results
  MLX keeps on disk. MLX names each file after the graph it computes, and loads a
  library it finds under that name without asking who wrote it. Left to itself it uses
  the system's temp folder (`/tmp/mlx/<version>/...`), which every user of the machine
  can write to: whoever creates that folder first could plant a library that an Emily
  VM then loads and runs.

  So Emily keeps those files in a folder of the user's own, checked when the `:emily`
  application starts, before MLX can compile anything:

    * the folder is `config :emily, :kernel_cache_dir` if set, else `jit` in
      `$EMILY_CACHE`, else `~/.cache/emily/jit`;
    * a missing folder is created with mode 0700;
    * a folder that is not a directory (a symbolic link, say), is not owned by the user
      the VM runs as, or has a mode other than 0700 is refused: the application does not
      start, and the error names the folder and what is wrong with it. Emily never
      changes an existing folder's owner or mode;
    * an `MLX_PTX_CACHE_DIR` in the environment (MLX's own setting for its CUDA cache)
      is checked the same way.

  MLX keeps its CPU libraries in `<folder>/mlx/<MLX version>/cpu` and its CUDA kernels
  in `<folder>/mlx/<MLX version>/ptx`. It derives both from the temp folder (`TMPDIR`)
  and has no other setting for the CPU one, so Emily sets `TMPDIR` to the folder for the
  whole VM: `System.tmp_dir/0`, and the programs the VM starts (the C++ compiler MLX runs
  among them), then use it too. Set `config :emily, :kernel_cache_dir` in
  `config/runtime.exs`, or `EMILY_CACHE` in the environment, to move it. Deleting the
  folder while no Emily VM runs is safe: MLX compiles again what it needs.
  """

  import Bitwise

  @doc """
  The folder MLX's compiled kernels live in: the one the running application checked,
  or, before it started, the one it would use.
  """
  @spec dir() :: String.t()
  def dir do
    case :persistent_term.get({__MODULE__, :dir}, nil) do
      nil ->
        case configured() do
          {:ok, dir} -> dir
          {:error, message} -> raise ArgumentError, message
        end

      dir ->
        dir
    end
  end

  @doc false
  # At boot, before MLX computes anything: checks (or creates) the folder and points
  # MLX at it. Returns `:ok` or `{:error, message}`.
  @spec setup() :: :ok | {:error, String.t()}
  def setup do
    with {:ok, dir} <- configured(),
         :ok <- ensure_private(dir),
         :ok <- check_ptx_dir(),
         :ok <- point_mlx_at(dir) do
      # The VM's own copy of the environment (System.tmp_dir/0, the programs it starts).
      System.put_env("TMPDIR", dir)
      :persistent_term.put({__MODULE__, :dir}, dir)
      :ok
    end
  end

  defp configured do
    cond do
      dir = Application.get_env(:emily, :kernel_cache_dir) ->
        {:ok, Path.expand(to_string(dir))}

      cache = System.get_env("EMILY_CACHE") ->
        {:ok, Path.expand(Path.join(cache, "jit"))}

      home = System.user_home() ->
        {:ok, Path.join([home, ".cache", "emily", "jit"])}

      true ->
        {:error,
         "Emily: there is no home folder to keep MLX's compiled kernels in: set " <>
           "config :emily, :kernel_cache_dir, or EMILY_CACHE, to a folder of your own"}
    end
  end

  # The C environment MLX reads, which os:putenv does not change.
  defp point_mlx_at(dir) do
    Emily.Native.kernel_cache_dir(dir)
  rescue
    e in ArgumentError -> {:error, "Emily: " <> Exception.message(e)}
  end

  defp check_ptx_dir do
    case System.get_env("MLX_PTX_CACHE_DIR") do
      nil -> :ok
      "" -> :ok
      dir -> ensure_private(Path.expand(dir), "MLX_PTX_CACHE_DIR")
    end
  end

  @doc false
  # Creates `path` with mode 0700 if it is missing; then checks that it is a directory,
  # owned by the user this VM runs as, with mode 0700.
  @spec ensure_private(String.t(), String.t()) :: :ok | {:error, String.t()}
  def ensure_private(path, what \\ "MLX's kernel cache folder") do
    refuse = &{:error, refusal(what, path, &1)}

    with :ok <- create(path, refuse),
         {:ok, stat} <- lstat(path, refuse),
         :ok <- check_type(stat, refuse),
         :ok <- check_owner(path, stat, refuse) do
      check_mode(stat, refuse)
    end
  end

  # mkdir is atomic: when it succeeds, the folder is this VM's. It is made with the
  # umask's mode, so it is closed to everyone else right after, and must still be empty.
  defp create(path, refuse) do
    with {:parent, :ok} <- {:parent, File.mkdir_p(Path.dirname(path))},
         :ok <- File.mkdir(path) do
      with :ok <- File.chmod(path, 0o700),
           {:ok, []} <- File.ls(path) do
        :ok
      else
        {:ok, _} -> refuse.("was written to by someone else while it was being created")
        {:error, reason} -> refuse.("could not be made private: #{format(reason)}")
      end
    else
      {:error, :eexist} -> :ok
      {:parent, {:error, reason}} -> refuse.("cannot be created: #{format(reason)}")
      {:error, reason} -> refuse.("cannot be created: #{format(reason)}")
    end
  end

  defp lstat(path, refuse) do
    case File.lstat(path) do
      {:ok, stat} -> {:ok, stat}
      {:error, reason} -> refuse.("cannot be read: #{format(reason)}")
    end
  end

  defp check_type(%File.Stat{type: :directory}, _refuse), do: :ok

  defp check_type(%File.Stat{type: :symlink}, refuse),
    do: refuse.("is a symbolic link (name the folder it points to instead)")

  defp check_type(%File.Stat{type: type}, refuse),
    do: refuse.("is not a folder (it is a #{type})")

  # The VM's user is the owner of a file it creates; Erlang has no getuid. A folder the
  # VM cannot create a file in is not its user's (mode 0700 is the only one accepted).
  defp check_owner(path, %File.Stat{uid: owner}, refuse) do
    probe = Path.join(path, ".emily-owner-#{:os.getpid()}-#{System.unique_integer([:positive])}")

    case File.open(probe, [:write, :exclusive]) do
      {:ok, io} ->
        File.close(io)
        result = File.lstat(probe)
        File.rm(probe)

        case result do
          {:ok, %File.Stat{uid: ^owner}} ->
            :ok

          {:ok, %File.Stat{uid: me}} ->
            refuse.("is owned by uid #{owner}, not by this VM's user (uid #{me})")

          {:error, reason} ->
            refuse.("cannot be read: #{format(reason)}")
        end

      {:error, reason} ->
        refuse.(
          "is owned by uid #{owner} and this VM's user cannot write to it (#{format(reason)})"
        )
    end
  end

  defp check_mode(%File.Stat{mode: mode}, refuse) do
    case band(mode, 0o777) do
      0o700 -> :ok
      other -> refuse.("has mode 0#{Integer.to_string(other, 8)}, not 0700")
    end
  end

  defp refusal(what, path, problem) do
    elsewhere =
      if what == "MLX_PTX_CACHE_DIR",
        do: "unset MLX_PTX_CACHE_DIR",
        else: "point config :emily, :kernel_cache_dir (or EMILY_CACHE) at another"

    "Emily: #{what} #{path} #{problem}. MLX loads the compiled code it finds there, so " <>
      "Emily uses only a folder of its own user's with mode 0700, and changes no existing " <>
      "folder: fix this one (chmod 700, owned by you), or #{elsewhere} (see Emily.KernelCache)"
  end

  defp format(reason), do: List.to_string(:file.format_error(reason))
end
