// An NVTX injection library that times the ranges MLX's CUDA backend opens: every
// `gpu::eval` (one array's encoding), every `Foo::eval_gpu` and each
// `CommandEncoder::commit`. Both Emily and Python MLX load the same libmlx, so one run
// of each under this library says where the host's encoding time goes, per primitive.
//
//   g++ -O2 -shared -fPIC -I NVTX_INCLUDE -o nvtx_times.so bench/gpu/nvtx_times.cc -lpthread
//   NVTX_INJECTION64_PATH=$PWD/nvtx_times.so NVTX_TIMES_OUT=/tmp/times.%p PROGRAM
//
// NVTX_INCLUDE holds nvtx3/ (the nvidia-nvtx wheel's include folder). At exit each
// process writes NVTX_TIMES_OUT (%p becomes its pid): one line a range name, with its
// count, inclusive and self time (self: less the ranges opened inside it). A call over
// NVTX_TIMES_SLOW_US (default 1000) is counted apart, so kernel compiles and first-call
// allocations do not weigh on the per-call means. The file is also rewritten every
// NVTX_TIMES_PERIOD_S seconds (default 5), so a process that dies at exit leaves it.
#include <nvtx3/nvToolsExt.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <unistd.h>
#include <unordered_map>
#include <vector>

namespace {

struct Stat {
  long count = 0, slow = 0;
  long long incl_ns = 0, self_ns = 0, slow_ns = 0;
};

struct Frame {
  const char* name;
  long long start, children;
};

// A fixed open-addressed table keyed by the message's address (MLX's are literals): the
// dumping thread reads it while its owner writes, so it never rehashes.
constexpr size_t kSlots = 1024;

struct Slot {
  std::atomic<const char*> name{nullptr};
  Stat stat;
};

struct ThreadStats {
  std::vector<Frame> stack;
  Slot slots[kSlots];

  Stat& of(const char* name) {
    size_t i = (reinterpret_cast<uintptr_t>(name) >> 3) % kSlots;
    for (size_t probe = 0; probe < kSlots; probe++, i = (i + 1) % kSlots) {
      const char* held = slots[i].name.load(std::memory_order_relaxed);
      if (held == name) return slots[i].stat;
      if (held == nullptr) {
        slots[i].name.store(name, std::memory_order_release);
        return slots[i].stat;
      }
    }
    return slots[0].stat;  // full: lump the rest into one row
  }
};

std::mutex registry_mutex;
std::vector<ThreadStats*>* registry = new std::vector<ThreadStats*>;
long long slow_ns = 1000000;

long long now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

ThreadStats& local() {
  thread_local ThreadStats* t = [] {
    auto* s = new ThreadStats;
    s->stack.reserve(64);
    std::lock_guard<std::mutex> lock(registry_mutex);
    registry->push_back(s);
    return s;
  }();
  return *t;
}

const char* message_of(const nvtxEventAttributes_t* attr) {
  if (attr && attr->messageType == NVTX_MESSAGE_TYPE_ASCII && attr->message.ascii) {
    return attr->message.ascii;
  }
  return "(unnamed)";
}

int push(const char* name) {
  auto& t = local();
  t.stack.push_back({name, now_ns(), 0});
  return static_cast<int>(t.stack.size()) - 1;
}

int pop() {
  auto& t = local();
  if (t.stack.empty()) return -1;
  long long end = now_ns();
  Frame f = t.stack.back();
  t.stack.pop_back();
  long long incl = end - f.start;
  auto& s = t.of(f.name);
  if (incl > slow_ns) {
    s.slow++;
    s.slow_ns += incl;
  } else {
    s.count++;
    s.incl_ns += incl;
    s.self_ns += incl - f.children;
  }
  if (!t.stack.empty()) t.stack.back().children += incl;
  return static_cast<int>(t.stack.size());
}

int NVTX_API push_ex(const nvtxEventAttributes_t* attr) { return push(message_of(attr)); }
int NVTX_API push_a(const char* message) { return push(message); }
int NVTX_API pop_core() { return pop(); }
int NVTX_API domain_push_ex(nvtxDomainHandle_t, const nvtxEventAttributes_t* attr) {
  return push(message_of(attr));
}
int NVTX_API domain_pop(nvtxDomainHandle_t) { return pop(); }

void dump() {
  const char* pattern = std::getenv("NVTX_TIMES_OUT");
  std::string path = pattern ? pattern : "nvtx_times.%p";
  if (auto at = path.find("%p"); at != std::string::npos) {
    path.replace(at, 2, std::to_string(getpid()));
  }
  std::unordered_map<std::string, Stat> total;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    for (auto* t : *registry) {
      for (auto& slot : t->slots) {
        const char* name = slot.name.load(std::memory_order_acquire);
        if (!name) continue;
        const Stat& s = slot.stat;
        auto& d = total[name];
        d.count += s.count;
        d.slow += s.slow;
        d.incl_ns += s.incl_ns;
        d.self_ns += s.self_ns;
        d.slow_ns += s.slow_ns;
      }
    }
  }
  std::vector<std::pair<std::string, Stat>> rows(total.begin(), total.end());
  std::sort(rows.begin(), rows.end(),
            [](auto& a, auto& b) { return a.second.self_ns > b.second.self_ns; });
  std::string tmp = path + ".tmp";
  FILE* out = std::fopen(tmp.c_str(), "w");
  if (!out) return;
  std::fprintf(out, "%-40s %10s %12s %12s %10s %10s %8s %12s\n", "range", "count", "incl_ms",
               "self_ms", "incl_us", "self_us", "slow", "slow_ms");
  for (auto& [name, s] : rows) {
    double n = s.count ? static_cast<double>(s.count) : 1.0;
    std::fprintf(out, "%-40s %10ld %12.3f %12.3f %10.3f %10.3f %8ld %12.3f\n", name.c_str(),
                 s.count, s.incl_ns / 1e6, s.self_ns / 1e6, s.incl_ns / 1e3 / n,
                 s.self_ns / 1e3 / n, s.slow, s.slow_ns / 1e6);
  }
  std::fclose(out);
  std::rename(tmp.c_str(), path.c_str());
}

}  // namespace

extern "C" __attribute__((visibility("default"))) int InitializeInjectionNvtx2(
    NvtxGetExportTableFunc_t get_export_table) {
  if (const char* us = std::getenv("NVTX_TIMES_SLOW_US")) slow_ns = std::atoll(us) * 1000;
  auto* callbacks =
      static_cast<const NvtxExportTableCallbacks*>(get_export_table(NVTX_ETID_CALLBACKS));
  if (!callbacks) return 0;
  NvtxFunctionTable table = nullptr;
  unsigned int size = 0;
  if (callbacks->GetModuleFunctionTable(NVTX_CB_MODULE_CORE, &table, &size) && table) {
    *table[NVTX_CBID_CORE_RangePushEx] = reinterpret_cast<NvtxFunctionPointer>(push_ex);
    *table[NVTX_CBID_CORE_RangePushA] = reinterpret_cast<NvtxFunctionPointer>(push_a);
    *table[NVTX_CBID_CORE_RangePop] = reinterpret_cast<NvtxFunctionPointer>(pop_core);
  }
  if (callbacks->GetModuleFunctionTable(NVTX_CB_MODULE_CORE2, &table, &size) && table) {
    *table[NVTX_CBID_CORE2_DomainRangePushEx] =
        reinterpret_cast<NvtxFunctionPointer>(domain_push_ex);
    *table[NVTX_CBID_CORE2_DomainRangePop] = reinterpret_cast<NvtxFunctionPointer>(domain_pop);
  }
  static bool registered = false;
  if (!registered) {
    registered = true;
    std::atexit(dump);
    const char* period = std::getenv("NVTX_TIMES_PERIOD_S");
    int seconds = period ? std::atoi(period) : 5;
    if (seconds > 0) {
      std::thread([seconds] {
        for (;;) {
          std::this_thread::sleep_for(std::chrono::seconds(seconds));
          dump();
        }
      }).detach();
    }
  }
  return 1;
}
