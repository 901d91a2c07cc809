// Tapes: the MLX graph a program's replay built, recorded once and rebuilt for later runs
// on inputs of the same kind straight from the recorded primitives, without the ops.
//
// Replaying a program runs each instruction's op: argument decoding, MLX's shape and
// type inference, broadcasting and Emily's choice of kernel, for every node of every
// run, though none of it changes while the inputs' shapes, dtypes and layouts don't (a
// decoding loop runs the same program thousands of times). A tape keeps what those ops
// produced: each node's primitive (shared, as mx::compile's tapes share theirs), its
// output shapes and dtypes, and where each of its inputs comes from (a program input,
// an earlier node, or a constant the replay made, such as a scalar), with each chain of
// views that keep the elements' order folded into one reshape (tape.cc). Rebuilding is
// then one array construction a node.
//
// What a replay builds depends on nothing but the key below. MLX's ops read only their
// inputs' shapes and dtypes; Emily's also read an evaluated input's layout (the CUDA
// product kernel takes a row-contiguous weight, the CPU's transposed copy a transposed
// one), so the key holds each input's shape, dtype, whether it is scheduled, and if it
// is, its flags and strides; which inputs are the same array (a tied embedding passed
// twice) is in it too, since the recorded graph cannot tell them apart; and the stream,
// since each primitive holds its own.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "emily.h"

namespace emily {

struct Tape;

// A program's tapes. Copying a program (to compile it) starts it with none.
class Tapes {
 public:
  Tapes() = default;
  Tapes(const Tapes&) {}
  Tapes& operator=(const Tapes&) { return *this; }

  // The outputs of `replay(inputs)`, or the same graph rebuilt from this set's tape for
  // inputs like `inputs` on `s`. The second run of a kind of inputs records its tape
  // (the first may be the only one, as a one-off jit's is); the third is the first
  // rebuilt.
  template <typename Replay>
  std::vector<array> build(const std::vector<array>& inputs, const Stream& s, Replay&& replay) const {
    auto key = key_of(inputs, s);
    auto [tape, record] = find(key);
    if (tape) return rebuild(*tape, inputs);
    std::vector<array> out = replay();
    if (record) keep(std::move(key), inputs, out);
    return out;
  }

  // The tapes kept.
  size_t size() const;

 private:
  static std::vector<int64_t> key_of(const std::vector<array>& inputs, const Stream& s);
  // The tape for `key`, if any, and if not, whether to record one.
  std::pair<std::shared_ptr<const Tape>, bool> find(const std::vector<int64_t>& key) const;
  static std::vector<array> rebuild(const Tape& t, const std::vector<array>& inputs);
  void keep(std::vector<int64_t> key, const std::vector<array>& inputs, const std::vector<array>& out) const;

  mutable std::mutex mutex_;
  mutable std::vector<std::shared_ptr<const Tape>> tapes_;
  // Hashes of the keys run once (the latest few), and the tapes recorded so far.
  mutable std::vector<uint64_t> seen_;
  mutable size_t recorded_ = 0;
};

}  // namespace emily
