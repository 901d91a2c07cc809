defmodule Emily.KernelCacheTest do
  # Not async: it reads and sets the process environment.
  use ExUnit.Case, async: false
  import Bitwise

  alias Emily.KernelCache

  @moduletag timeout: 300_000

  setup do
    root = Path.join(System.tmp_dir!(), "kernel-cache-test-#{System.unique_integer([:positive])}")
    File.mkdir_p!(root)
    on_exit(fn -> File.rm_rf!(root) end)
    %{root: root}
  end

  defp mode(path), do: band(File.lstat!(path).mode, 0o777)

  # The uid of this VM's user: the owner of a file it makes.
  defp my_uid(root) do
    probe = Path.join(root, "probe")
    File.write!(probe, "")
    File.lstat!(probe).uid
  end

  describe "the running application" do
    test "keeps MLX's kernels in a private folder, and TMPDIR names it" do
      dir = KernelCache.dir()
      assert %File.Stat{type: :directory} = File.lstat!(dir)
      assert mode(dir) == 0o700
      assert System.get_env("TMPDIR") == dir
      assert System.tmp_dir!() == dir
    end
  end

  describe "Emily.Native.kernel_cache_dir/1" do
    test "keeps the folder it was given at boot for the life of the VM", %{root: root} do
      assert Emily.Native.kernel_cache_dir(KernelCache.dir()) == :ok
      other = Path.join(root, "other")
      assert KernelCache.ensure_private(other) == :ok

      assert_raise ArgumentError, ~r/kernel cache is #{KernelCache.dir()} for the life/, fn ->
        Emily.Native.kernel_cache_dir(other)
      end

      assert System.get_env("TMPDIR") == KernelCache.dir()
    end

    @native_script """
    dir = System.fetch_env!("KC_DIR")
    for path <- [dir, "relative/jit"] do
      try do
        Emily.Native.kernel_cache_dir(path)
        IO.puts("accepted " <> path)
      rescue
        e -> IO.puts("refused " <> Exception.message(e))
      end
    end
    File.chmod!(dir, 0o700)
    IO.puts(inspect(Emily.Native.kernel_cache_dir(dir)))
    """

    test "refuses, by itself, a folder that is not private", %{root: root} do
      dir = Path.join(root, "open")
      File.mkdir!(dir)
      File.chmod!(dir, 0o755)
      # Before the application starts: the NIF alone.
      {out, status} = elixir(@native_script, [{"KC_DIR", dir}])
      assert status == 0, out
      assert out =~ "refused kernel_cache_dir: #{dir} is not an absolute path to a folder of uid"
      assert out =~ "refused kernel_cache_dir: relative/jit: "
      assert out =~ ":ok\n"
    end
  end

  describe "ensure_private/1" do
    test "creates a missing folder, and its parents, with mode 0700", %{root: root} do
      dir = Path.join([root, "a", "b", "jit"])
      assert KernelCache.ensure_private(dir) == :ok
      assert mode(dir) == 0o700
      assert File.ls!(dir) == []
      # And accepts it again.
      assert KernelCache.ensure_private(dir) == :ok
    end

    test "refuses a folder with another mode, and leaves it as it is", %{root: root} do
      for bad <- [0o755, 0o777, 0o750, 0o500] do
        dir = Path.join(root, "mode-#{Integer.to_string(bad, 8)}")
        File.mkdir!(dir)
        File.chmod!(dir, bad)
        assert {:error, message} = KernelCache.ensure_private(dir)

        assert message =~
                 "MLX's kernel cache folder #{dir} has mode 0#{Integer.to_string(bad, 8)}, not 0700"

        assert message =~ "config :emily, :kernel_cache_dir"
        assert mode(dir) == bad
        File.chmod!(dir, 0o700)
        assert File.ls!(dir) == []
      end
    end

    test "refuses a folder owned by another user", %{root: root} do
      me = my_uid(root)

      if me == 0 do
        # root can write anywhere: the owner, not the write, must decide.
        dir = Path.join(root, "nobody")
        File.mkdir!(dir)
        File.chmod!(dir, 0o700)
        File.chown!(dir, 65_534)
        assert {:error, message} = KernelCache.ensure_private(dir)
        assert message =~ "#{dir} is owned by uid 65534, not by this VM's user (uid 0)"
        assert File.ls!(dir) == []
      else
        # Not root: "/" is someone else's and not writable.
        assert {:error, message} = KernelCache.ensure_private("/")
        assert message =~ "/ is owned by uid #{File.lstat!("/").uid} and this VM's user"
      end
    end

    test "refuses a symbolic link and a file", %{root: root} do
      target = Path.join(root, "target")
      assert KernelCache.ensure_private(target) == :ok
      link = Path.join(root, "link")
      File.ln_s!(target, link)
      assert {:error, message} = KernelCache.ensure_private(link)
      assert message =~ "#{link} is a symbolic link"

      file = Path.join(root, "file")
      File.write!(file, "")
      assert {:error, message} = KernelCache.ensure_private(file)
      assert message =~ "#{file} is not a folder"
    end

    test "an MLX_PTX_CACHE_DIR in the environment is checked too", %{root: root} do
      shared = Path.join(root, "ptx")
      File.mkdir!(shared)
      File.chmod!(shared, 0o777)
      tmpdir = System.get_env("TMPDIR")

      try do
        System.put_env("MLX_PTX_CACHE_DIR", shared)
        assert {:error, message} = KernelCache.setup()
        assert message =~ "MLX_PTX_CACHE_DIR #{shared} has mode 0777"
        assert message =~ "unset MLX_PTX_CACHE_DIR"
        assert System.get_env("TMPDIR") == tmpdir

        File.chmod!(shared, 0o700)
        assert KernelCache.setup() == :ok
      after
        System.delete_env("MLX_PTX_CACHE_DIR")
      end

      assert KernelCache.setup() == :ok
      assert System.get_env("TMPDIR") == tmpdir
    end
  end

  describe "in a VM of its own" do
    # A compiled program of a chain no other test compiles (its name is MLX's file name).
    @compile_script """
    dir = System.fetch_env!("KC_DIR")
    Application.put_env(:emily, :kernel_cache_dir, dir)
    {:ok, _} = Application.ensure_all_started(:emily)
    s = Emily.Stream.default(:cpu)
    chain = [{:sin, [0]}, {:tanh, [1]}, {:cos, [2]}, {:arctan, [3]}, {:sinh, [4]}, {:exp, [5]}]
    p = Emily.Program.new(chain, inputs: 1, compile: true)
    x = Emily.Native.full(s, {7, 3}, 0.25, {:f, 16})
    [y] = Emily.Program.eval(p, [x], stream: s)
    Emily.eval(y)
    IO.puts("dir=" <> Emily.KernelCache.dir())
    IO.puts("tmpdir=" <> System.tmp_dir!())
    """

    @refused_script """
    case Application.ensure_all_started(:emily) do
      {:ok, _} -> IO.puts("started"); System.halt(0)
      {:error, reason} -> IO.puts("refused: " <> inspect(reason)); System.halt(3)
    end
    """

    test "a compiled program's kernels land in the private folder, not in TMPDIR",
         %{root: root} do
      # The temp folder the VM is given, as open as /tmp.
      shared = Path.join(root, "shared")
      File.mkdir!(shared)
      File.chmod!(shared, 0o1777)
      dir = Path.join(root, "private/jit")

      {out, status} = elixir(@compile_script, [{"KC_DIR", dir}, {"TMPDIR", shared}])
      assert status == 0, out
      assert out =~ "dir=#{dir}\n"
      assert out =~ "tmpdir=#{dir}\n"
      assert mode(dir) == 0o700

      libs = Path.wildcard(Path.join([dir, "mlx", Emily.mlx_version(), "cpu", "lib*.so"]))
      assert libs != [], "no compiled kernel under #{dir}: #{out}"
      assert File.ls!(shared) == []
    end

    test "a kernel folder with the wrong mode stops the application", %{root: root} do
      cache = Path.join(root, "cache")
      File.mkdir_p!(Path.join(cache, "jit"))
      File.chmod!(Path.join(cache, "jit"), 0o755)

      {out, status} = elixir(@refused_script, [{"EMILY_CACHE", cache}])
      assert status == 3, out
      assert out =~ "refused: "
      assert out =~ "MLX's kernel cache folder #{cache}/jit has mode 0755, not 0700"
      assert File.ls!(Path.join(cache, "jit")) == []
    end
  end

  # Runs `script` in a new VM with this one's code path (its ebin directories: "." would
  # name the working directory as an app) and `env` added to the environment.
  defp elixir(script, env) do
    paths =
      for path <- :code.get_path(),
          Path.basename(to_string(path)) == "ebin",
          arg <- ["-pa", to_string(path)],
          do: arg

    System.cmd(System.find_executable("elixir"), paths ++ ["-e", script],
      env: env,
      stderr_to_stdout: true
    )
  end
end
