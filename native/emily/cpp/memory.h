// Memory controls: MLX's allocator (mlx/memory.h). Glue only; called on worker threads.
#pragma once

#include <cstdint>
#include <vector>

#include "mlx/mlx.h"

namespace emily {

uint64_t memory_active();
uint64_t memory_peak();
uint64_t memory_cache();
uint64_t memory_limit();
void memory_reset_peak();
void memory_clear_cache();
// Each setter returns the previous limit.
uint64_t memory_set_limit(uint64_t limit);
uint64_t memory_set_cache_limit(uint64_t limit);
uint64_t memory_set_wired_limit(uint64_t limit);
bool metal_available();

// glibc's malloc (MLX's CPU allocator): sets M_MMAP_THRESHOLD and M_TRIM_THRESHOLD
// (each only when >= 0). False where the C library is not glibc, or glibc refused.
bool malloc_tune(int32_t mmap_threshold, int32_t trim_threshold);

// Throws if an array in `arrays` would need more bytes than MLX's memory limit (or more
// than a size_t holds). On the CPU, MLX treats the limit as a guideline and does not check
// that an allocation succeeded, so an op result too large for the machine would crash the
// process when evaluated; refusing it when the node is built turns that into an error.
void check_result_sizes(const std::vector<mlx::core::array>& arrays);

}  // namespace emily
