// MLX runs a CPU stream's kernels on one thread; a kernel that streams a weight matrix
// from memory (a decoding step's matrix-vector products) needs every core to reach the
// memory's bandwidth. These helpers are started once, never touch MLX (so they leave no
// stream behind) and are never stopped: at exit they are idle, waiting for work. A helper
// waits a millisecond before it sleeps: a decoding step hands them one product after
// another, a few other kernels apart, and waking a sleeping thread costs more than that.
// It spins for the first 50 us and yields the core for the rest: a busy helper beside
// BLAS's threads took a core from the sgemm that follows an elementwise pass (a BERT-base
// forward at batch 1 ran 1.35x slower so).
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
    for (int h = 0; h < helpers; h++) std::thread([this] { loop(); }).detach();
  }

  int size() const { return helpers_ + 1; }

  // The caller and the helpers claim parts one at a time, so a helper that wakes late
  // takes fewer, and the caller waits only for the parts under way. (Callers on several
  // streams take turns.)
  void run(int n, const std::function<void(int)>& part) {
    std::lock_guard<std::mutex> one_at_a_time(caller_);
    part_.store(&part, std::memory_order_relaxed);
    n_.store(n, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    uint64_t g = ++runs_;
    ticket_.store(g << 32, std::memory_order_release);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      generation_.store(g, std::memory_order_release);
    }
    wake_.notify_all();
    work(g);
    while (done_.load(std::memory_order_acquire) < n) EMILY_PAUSE();
  }

 private:
  // Claims and runs parts of run `g` until none is left. A ticket holds the run's number
  // and the next part: a helper still holding an earlier run's number claims nothing.
  void work(uint64_t g) {
    for (;;) {
      uint64_t t = ticket_.load(std::memory_order_acquire);
      if ((t >> 32) != g) return;
      auto i = static_cast<int>(t & 0xFFFFFFFFu);
      if (i >= n_.load(std::memory_order_relaxed)) return;
      if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) continue;
      (*part_.load(std::memory_order_relaxed))(i);
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  void loop() {
    uint64_t seen = 0;
    for (;;) {
      uint64_t g = seen;
      auto start = std::chrono::steady_clock::now();
      auto busy = start + std::chrono::microseconds(50), until = start + std::chrono::microseconds(1000);
      for (auto now = start; (g = generation_.load(std::memory_order_acquire)) == seen && now < until;
           now = std::chrono::steady_clock::now()) {
        if (now < busy) {
          EMILY_PAUSE();
        } else {
          std::this_thread::yield();
        }
      }
      if (g == seen) {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return (g = generation_.load(std::memory_order_acquire)) != seen; });
      }
      seen = g;
      work(g);
    }
  }

  const int helpers_;
  std::mutex caller_, mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0}, ticket_{0};
  std::atomic<int> n_{0}, done_{0};
  std::atomic<const std::function<void(int)>*> part_{nullptr};
  uint64_t runs_ = 0;
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
  if (n <= 1 || pool().size() == 1) {
    for (int i = 0; i < n; i++) part(i);
    return;
  }
  pool().run(n, part);
}

}  // namespace emily::pool
