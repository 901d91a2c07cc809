// Graphs: async eval, and programs (a list of op-table ops replayed in one native call,
// optionally through mx::compile). Glue only: the replay composes op_call.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "emily.h"
#include "mlx/compile_impl.h"
#include "tape.h"

namespace emily {

struct ProgramInstr {
  uint32_t op;
  std::string name;
  std::vector<uint32_t> slots;
  std::vector<int64_t> ints;
  std::vector<double> floats;
  std::vector<rust::String> strs;
  uint32_t outputs;
};

// Slots 0..n_inputs-1 hold the inputs; each instruction appends its outputs.
struct ProgramSpec {
  size_t n_inputs = 0;
  std::vector<ProgramInstr> instrs;
  std::vector<uint32_t> outputs;
  // The graphs its replays built, rebuilt for later runs (tape.h).
  Tapes tapes;
};

// A program compiled with mx::compile, for every thread that runs it (a stream's worker,
// or the scheduler of a program_eval): MLX's compile cache is thread-local, so each
// calling thread's cache gets its own entry, replayed on that thread's default stream
// for `device` (a worker's is its own stream). Destroyed on any thread, it erases every
// one of those entries (MLX erases through a weak pointer to the cache, under the cache's
// lock).
struct Compiled {
  uint64_t id;
  std::function<std::vector<array>(const std::vector<array>&)> fn;
  mutable std::mutex mutex;
  mutable std::vector<mlx::core::detail::CompileCacheWeakPtr> caches;
  ~Compiled();
};

std::unique_ptr<ProgramSpec> program_spec_new(size_t n_inputs);
void program_spec_push(ProgramSpec& p, uint32_t op, rust::Str name, rust::Slice<const uint32_t> slots,
                       rust::Slice<const int64_t> ints, rust::Slice<const double> floats,
                       rust::Slice<const rust::String> strs, uint32_t outputs);
void program_spec_outputs(ProgramSpec& p, rust::Slice<const uint32_t> slots);
// The tapes `p` keeps (tape.h).
size_t program_tapes(const ProgramSpec& p);
std::unique_ptr<ArrayVec> program_call(const ProgramSpec& p, const ArrayVec& inputs, const Stream& s);
// Replays on the calling thread's own default stream of `device` and hands the graph to
// MLX for evaluation (MLX may wait there for earlier work); program_finish_here, on the
// same thread, then waits for the outputs and makes them row-contiguous, so that they
// may cross threads (true if one had to be copied). Two calls, so that the hand-over can
// be timed.
std::unique_ptr<ArrayVec> program_dispatch_here(const ProgramSpec& p, const ArrayVec& inputs, int32_t device);
bool program_finish_here(ArrayVec& outputs, int32_t device);
// The CPU device's asynchronous form of those two: replays on the calling
// thread's own default CPU stream, hands the evaluation to MLX's thread for that stream
// and returns the outputs at once (with `contiguous`, each made row-contiguous by the
// graph itself). When they are computed, MLX's thread calls `eval_done`
// (src/ops/program.rs) with the stream's error, if any. Nothing may read the outputs
// before then.
struct EvalDone;
std::unique_ptr<ArrayVec> program_eval_async(const ProgramSpec& p, const ArrayVec& inputs, bool contiguous,
                                             rust::Box<EvalDone> done);
// Whether every array of `v` (computed) is row-contiguous.
bool row_contiguous(const ArrayVec& v);
// The number of nodes program_eval_async hands to MLX for inputs like these (it
// builds the graph on the calling thread's CPU stream, counts it and drops it), and a
// hash of the inputs' shapes and dtypes, which decide that number.
size_t program_graph_size(const ProgramSpec& p, const ArrayVec& inputs);
uint64_t inputs_signature(const ArrayVec& inputs);
// The nodes of `outputs`' graphs that MLX has not scheduled yet (a compiled program's
// count, its fused kernels being one node each).
size_t unscheduled_nodes(const ArrayVec& outputs);
// The depth of the graph the program builds on inputs like these (the longest path of
// nodes, on the calling thread's default stream of `device`; built and dropped): how
// deep mx::compile's tracing, which recurses along the graph, goes.
size_t program_graph_depth(const ProgramSpec& p, const ArrayVec& inputs, int32_t device);
// The bytes of stack left to the calling thread below the caller (0 if unknown).
size_t stack_left();
// Queues `hold_run(task)` (src/hold.rs) on the calling thread's default CPU stream.
struct HoldTask;
void hold_cpu_stream(rust::Box<HoldTask> task);
// MLX's task groups in flight (on any stream), and whether its active memory is over its
// limit: MLX's own conditions for waiting on its threads while it queues a graph.
int32_t mlx_tasks_in_flight();
bool mlx_memory_over_limit();

std::unique_ptr<Compiled> program_compile(const ProgramSpec& p, uint64_t id, int32_t device);
std::unique_ptr<ArrayVec> compiled_call(const Compiled& c, const ArrayVec& inputs);
std::unique_ptr<ArrayVec> compiled_eval_async(const Compiled& c, const ArrayVec& inputs, bool contiguous,
                                              rust::Box<EvalDone> done);

}  // namespace emily
