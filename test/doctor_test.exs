defmodule Emily.DoctorTest do
  use ExUnit.Case, async: false
  import ExUnit.CaptureIO

  test "the self-checks pass on every device and the report names what they ran on" do
    out = capture_io(fn -> assert Emily.Doctor.run(size: 256) == :ok end)

    assert out =~ "on MLX #{Emily.mlx_version()}"
    assert out =~ "BLAS for MLX's CPU matmuls:"
    assert out =~ "MLX's compiled kernels: #{Emily.KernelCache.dir()} (private"

    for device <- Emily.devices() do
      assert out =~ "\n#{device}:\n"
    end

    checks = Regex.scan(~r/^  (ok  |FAIL) (.*):/m, out, capture: :all_but_first)
    assert length(checks) == 3 * length(Emily.devices())
    assert Enum.all?(checks, fn [status, _] -> status == "ok  " end)

    assert Enum.map(Enum.take(checks, 3), fn [_, what] -> what end) == [
             "matmul 256x256x256 f32",
             "elementwise chain, 16777216 f32, one program",
             "quantized matmul 4-bit 16x256x64"
           ]

    assert out =~ "all checks passed"
  end

  # A CUDA build finds NVRTC, the driver and MLX's device allocator wherever there is a
  # GPU (cpp/cuda_launch.cc); a CPU or Metal build has no CUDA kernels.
  test "Emily's CUDA kernels run wherever MLX has a CUDA GPU" do
    cuda? = :gpu in Emily.devices() and :os.type() != {:unix, :darwin}
    assert Emily.Native.cuda_kernels() == cuda?
  end
end
