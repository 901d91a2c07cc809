// MLX runs a CPU stream's kernels on one thread; a kernel that streams a weight matrix
// from memory (a decoding step's matrix-vector products) needs every core to reach the
// memory's bandwidth. These helpers are started once, never touch MLX (so they leave no
// stream behind) and are never stopped: at exit they are idle, waiting for work. A helper
// spins briefly before it sleeps, since a decoding step hands them one product after
// another, microseconds apart.
#include "pool.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <cblas.h>
#endif

#if defined(__x86_64__)
#include <immintrin.h>
#define EMILY_PAUSE() _mm_pause()
#else
#define EMILY_PAUSE() std::this_thread::yield()
#endif

namespace emily::pool {
namespace {

class Pool {
 public:
  explicit Pool(int helpers) : helpers_(helpers) {
    for (int h = 0; h < helpers; h++) std::thread([this, h] { loop(h + 1); }).detach();
  }

  int size() const { return helpers_ + 1; }

  // (Callers on several streams take turns.)
  void run(int n, const std::function<void(int)>& part) {
    std::lock_guard<std::mutex> one_at_a_time(caller_);
    int shared = n < size() ? n : size();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      part_ = &part;
      n_ = shared;
      pending_.store(shared - 1, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    part(0);
    for (int i = shared; i < n; i++) part(i);
    while (pending_.load(std::memory_order_acquire) > 0) EMILY_PAUSE();
  }

 private:
  void loop(int index) {
    uint64_t seen = 0;
    for (;;) {
      uint64_t g = seen;
      auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(200);
      while ((g = generation_.load(std::memory_order_acquire)) == seen && std::chrono::steady_clock::now() < until) {
        EMILY_PAUSE();
      }
      if (g == seen) {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return (g = generation_.load(std::memory_order_acquire)) != seen; });
      }
      seen = g;
      // Parts past this run's count (a run of fewer parts than helpers) are not ours.
      if (index < n_) {
        (*part_)(index);
        pending_.fetch_sub(1, std::memory_order_acq_rel);
      }
    }
  }

  const int helpers_;
  std::mutex caller_, mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  const std::function<void(int)>* part_ = nullptr;
  int n_ = 0;
};

int configured_parts() {
#if defined(__linux__)
  int n = openblas_get_num_threads();
#else
  int n = static_cast<int>(std::thread::hardware_concurrency());
#endif
  return n < 1 ? 1 : n > 64 ? 64 : n;
}

Pool& pool() {
  // Leaked on purpose: its threads outlive every static destructor.
  static Pool* p = new Pool(configured_parts() - 1);
  return *p;
}

}  // namespace

int parts() { return pool().size(); }

void run(int n, const std::function<void(int)>& part) {
  if (n <= 1) {
    if (n == 1) part(0);
    return;
  }
  pool().run(n, part);
}

}  // namespace emily::pool
