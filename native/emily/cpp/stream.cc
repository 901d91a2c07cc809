// Streams and devices. Every function here runs on the worker thread that owns the stream.
#include <cstdlib>
#include <mutex>

#include "emily.h"
#include "emily/src/bridge.rs.h"
#include "mlx/scheduler.h"

namespace emily {
namespace mx = mlx::core;

static mx::Device device_of(int32_t d) { return d == 1 ? mx::Device::gpu : mx::Device::cpu; }

rust::String mlx_version() { return rust::String(mx::version()); }
bool device_available(int32_t d) { return mx::is_available(device_of(d)); }
std::unique_ptr<Stream> stream_new(int32_t d) { return std::make_unique<Stream>(mx::new_stream(device_of(d))); }
void synchronize(const Stream& s) { mx::synchronize(s); }
void stream_set_default(const Stream& s) { mx::set_default_stream(s); }

void install_exit_guard() {
  static std::once_flag once;
  std::call_once(once, [] {
    // The VM halts through exit(), which runs exit handlers, then the destructors of
    // static objects and of shared libraries (OpenBLAS unmaps its buffers there) while
    // MLX's threads may still be computing. Handlers run in the reverse order of
    // registration: constructing MLX's allocator and scheduler first makes this one run
    // before their destructors, and it lets the running work finish.
    (void)mx::get_active_memory();
    (void)mx::scheduler::scheduler();
    // The same holds for what MLX's CUDA backend makes on first use: a CPU stream signals
    // its events through a CUDA stream held in a function-local static, made by the first
    // signal and destroyed before an older handler runs. A CPU evaluation still going at
    // exit then launched its signal into the destroyed stream (SIGSEGV in cuLaunchKernel,
    // after every test had passed, in about one run of the program tests in ten). An
    // evaluation on a GPU stream and a synchronized one on a CPU stream, each of its own,
    // make those first.
    if (mx::is_available(mx::Device::gpu)) {
      for (auto d : {mx::Device::gpu, mx::Device::cpu}) {
        auto s = mx::new_stream(d);
        mx::eval(mx::zeros({1}, mx::float32, s));
        mx::synchronize(s);
      }
    }
    std::atexit([] {
      quiesce_workers();
      // Kernels of an async_eval may still run on MLX's CPU stream threads. (This is the
      // one MLX call made off a worker thread: the VM is going away.)
      try {
        for (const auto& st : mx::get_streams()) {
          if (st.device == mx::Device::cpu) mx::synchronize(st);
        }
      } catch (...) {
      }
    });
  });
}

}  // namespace emily
