// FNV-1a over 64-bit words: the signatures Emily keys its caches by (a program's input
// shapes and types, a loaded binary's shape, type and samples).
#pragma once

#include <cstdint>

namespace emily {

struct Fnv {
  uint64_t h = 1469598103934665603ull;
  void mix(uint64_t v) { h = (h ^ v) * 1099511628211ull; }
};

}  // namespace emily
