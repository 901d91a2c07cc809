// A CUDA injection library that records, through CUPTI's activity API, every kernel,
// copy and memset the device ran: its start and end on the device's clock, its stream
// and, for a node of a CUDA graph, the graph. Both Emily and Python MLX launch their
// kernels from CUDA graphs that the host cannot time; this says where the device's time
// goes and where it sat idle waiting for the host. bench/gpu/timeline.py reads it.
//
//   g++ -O2 -shared -fPIC -I CUPTI/include -I CUDA/include -o cupti_times.so
//     bench/gpu/cupti_times.cc -L CUPTI/lib -l:libcupti.so.13 -Wl,-rpath,CUPTI/lib   (one line)
//   CUDA_INJECTION64_PATH=$PWD/cupti_times.so CUPTI_TIMES_OUT=/tmp/kernels.%p PROGRAM
//
// CUPTI is the nvidia-cuda-cupti wheel's nvidia/cu13 folder; CUDA/include the CUDA
// headers (cuda.h). Each process that initialises CUDA writes CUPTI_TIMES_OUT (%p
// becomes its pid): a first line `# pid COMMAND LINE`, then one tab-separated line an
// activity: `k` (kernel) or `c` (copy) or `s` (memset), start and end in ns, stream,
// graph id (0 outside a graph), and the kernel's demangled name or the copy's bytes.
// Records arrive in buffers as CUPTI completes them, flushed every CUPTI_TIMES_PERIOD_S
// seconds (default 2) and at exit, so a process that dies at exit loses at most that.
#include <cupti.h>
#include <cxxabi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <unistd.h>
#include <unordered_map>

namespace {

// The fields read here (start, end, streamId, graphId, name) sit at the same offsets in
// every kernel record version since 9, so one reader serves CUPTI 12 and 13.
using KernelRecord = CUpti_ActivityKernel9;
using CopyRecord = CUpti_ActivityMemcpy6;
using SetRecord = CUpti_ActivityMemset4;

constexpr size_t kBufferBytes = 8 << 20;

std::mutex out_mutex;
FILE* out = nullptr;
std::unordered_map<const char*, std::string>* names = new std::unordered_map<const char*, std::string>;

// CUPTI shares one name string among a kernel's records: demangle each once.
const std::string& name_of(const char* mangled) {
  auto it = names->find(mangled);
  if (it != names->end()) return it->second;
  int status = 0;
  char* plain = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string name = status == 0 && plain ? plain : mangled;
  std::free(plain);
  for (char& c : name) {
    if (c == '\t' || c == '\n') c = ' ';
  }
  return names->emplace(mangled, std::move(name)).first->second;
}

void open_out() {
  const char* pattern = std::getenv("CUPTI_TIMES_OUT");
  std::string path = pattern ? pattern : "cupti_times.%p";
  if (auto at = path.find("%p"); at != std::string::npos) {
    path.replace(at, 2, std::to_string(getpid()));
  }
  out = std::fopen(path.c_str(), "w");
  if (!out) return;
  std::ifstream cmdline("/proc/self/cmdline", std::ios::binary);
  std::string args((std::istreambuf_iterator<char>(cmdline)), std::istreambuf_iterator<char>());
  for (char& c : args) {
    if (c == '\0' || c == '\n') c = ' ';
  }
  std::fprintf(out, "# %d %s\n", getpid(), args.c_str());
}

// A copy's or a memset's line: its bytes where a kernel's has its name.
template <typename Record>
void write_bytes(char kind, const Record* r) {
  std::fprintf(out, "%c\t%llu\t%llu\t%u\t%u\t%llu\n", kind, (unsigned long long)r->start,
               (unsigned long long)r->end, r->streamId, r->graphId, (unsigned long long)r->bytes);
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = kBufferBytes;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  {
    std::lock_guard<std::mutex> lock(out_mutex);
    CUpti_Activity* record = nullptr;
    while (out && cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
      switch (record->kind) {
        case CUPTI_ACTIVITY_KIND_KERNEL:
        case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
          auto* k = reinterpret_cast<KernelRecord*>(record);
          std::fprintf(out, "k\t%llu\t%llu\t%u\t%u\t%s\n", (unsigned long long)k->start,
                       (unsigned long long)k->end, k->streamId, k->graphId,
                       name_of(k->name).c_str());
          break;
        }
        case CUPTI_ACTIVITY_KIND_MEMCPY:
          write_bytes('c', reinterpret_cast<CopyRecord*>(record));
          break;
        case CUPTI_ACTIVITY_KIND_MEMSET:
          write_bytes('s', reinterpret_cast<SetRecord*>(record));
          break;
        default:
          break;
      }
    }
    if (out) std::fflush(out);
  }
  std::free(buffer);
}

void flush_all() {
  cuptiActivityFlushAll(1);
  std::lock_guard<std::mutex> lock(out_mutex);
  if (out) std::fflush(out);
}

}  // namespace

extern "C" __attribute__((visibility("default"))) int InitializeInjection(void) {
  static bool started = false;
  if (started) return 1;
  started = true;
  open_out();
  if (!out) return 0;
  if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS) {
    std::fprintf(out, "# cuptiActivityRegisterCallbacks failed\n");
    return 0;
  }
  for (auto kind : {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
                    CUPTI_ACTIVITY_KIND_MEMSET}) {
    if (cuptiActivityEnable(kind) != CUPTI_SUCCESS) {
      std::fprintf(out, "# cuptiActivityEnable(%d) failed\n", static_cast<int>(kind));
    }
  }
  std::atexit(flush_all);
  const char* period = std::getenv("CUPTI_TIMES_PERIOD_S");
  int seconds = period ? std::atoi(period) : 2;
  if (seconds > 0) {
    std::thread([seconds] {
      for (;;) {
        std::this_thread::sleep_for(std::chrono::seconds(seconds));
        cuptiActivityFlushAll(0);
      }
    }).detach();
  }
  return 1;
}
