// Memory controls. See memory.h.
#include "memory.h"

#include <stdexcept>
#include <string>

#ifdef __GLIBC__
#include <malloc.h>
#endif

#include "mlx/backend/metal/metal.h"
#include "mlx/memory.h"

namespace emily {
namespace mx = mlx::core;

uint64_t memory_active() { return mx::get_active_memory(); }
uint64_t memory_peak() { return mx::get_peak_memory(); }
uint64_t memory_cache() { return mx::get_cache_memory(); }
uint64_t memory_limit() { return mx::get_memory_limit(); }
void memory_reset_peak() { mx::reset_peak_memory(); }
void memory_clear_cache() { mx::clear_cache(); }
uint64_t memory_set_limit(uint64_t limit) { return mx::set_memory_limit(limit); }
uint64_t memory_set_cache_limit(uint64_t limit) { return mx::set_cache_limit(limit); }
uint64_t memory_set_wired_limit(uint64_t limit) { return mx::set_wired_limit(limit); }
bool metal_available() { return mx::metal::is_available(); }

bool malloc_tune(int32_t mmap_threshold, int32_t trim_threshold) {
#ifdef __GLIBC__
  bool ok = true;
  if (mmap_threshold >= 0) ok = mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1 && ok;
  if (trim_threshold >= 0) ok = mallopt(M_TRIM_THRESHOLD, trim_threshold) == 1 && ok;
  return ok;
#else
  (void)mmap_threshold;
  (void)trim_threshold;
  return false;
#endif
}

void check_result_sizes(const std::vector<mx::array>& arrays) {
  size_t limit = mx::get_memory_limit();
  for (const auto& a : arrays) {
    size_t bytes = a.itemsize();
    bool overflow = false;
    for (auto d : a.shape()) {
      overflow = overflow || __builtin_mul_overflow(bytes, static_cast<size_t>(d), &bytes);
    }
    if (overflow || bytes > limit) {
      std::string shape;
      for (auto d : a.shape()) shape += (shape.empty() ? "" : "x") + std::to_string(d);
      throw std::length_error("the result (shape " + shape + ") needs " +
                              (overflow ? std::string("more than 2^64") : std::to_string(bytes)) +
                              " bytes, above the memory limit of " + std::to_string(limit) + " bytes");
    }
  }
}

}  // namespace emily
