// Graphs: async eval and program replay. See program.h.
#include "program.h"

#include <pthread.h>

#include <algorithm>
#include <csignal>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "emily/src/bridge.rs.h"
#include "hash.h"
#include "mlx/compile_impl.h"
#include "mlx/scheduler.h"
#include "index.h"
#include "ops.h"

namespace emily {
namespace mx = mlx::core;

std::unique_ptr<ProgramSpec> program_spec_new(size_t n_inputs) {
  auto p = std::make_unique<ProgramSpec>();
  p->n_inputs = n_inputs;
  return p;
}

void program_spec_push(ProgramSpec& p, uint32_t op, rust::Str name, rust::Slice<const uint32_t> slots,
                       rust::Slice<const int64_t> ints, rust::Slice<const double> floats,
                       rust::Slice<const rust::String> strs, uint32_t outputs) {
  p.instrs.push_back(ProgramInstr{op, std::string(name), {slots.begin(), slots.end()}, {ints.begin(), ints.end()},
                                  {floats.begin(), floats.end()}, {strs.begin(), strs.end()}, outputs});
}

void program_spec_outputs(ProgramSpec& p, rust::Slice<const uint32_t> slots) {
  p.outputs.assign(slots.begin(), slots.end());
}

// The slots were checked when the program was built (src/ops/program.rs). Each
// instruction reads its inputs in place and appends its outputs to the slots, through a
// vector reused from op to op: an op costs MLX's work and a table lookup, no allocation.
static std::vector<array> replay(const ProgramSpec& p, const std::vector<array>& inputs, const Stream& s) {
  StartsMemo memo;
  std::vector<array> slots;
  // Reserved for every output up front: the Reader's references into it stay valid.
  size_t n_slots = inputs.size();
  for (const auto& in : p.instrs) n_slots += in.outputs;
  slots.reserve(n_slots);
  slots.insert(slots.end(), inputs.begin(), inputs.end());
  std::vector<array> out;
  for (size_t k = 0; k < p.instrs.size(); k++) {
    const ProgramInstr& in = p.instrs[k];
    out.clear();
    try {
      Reader r{slots, &in.slots, rust::Slice<const int64_t>(in.ints.data(), in.ints.size()),
               rust::Slice<const double>(in.floats.data(), in.floats.size()),
               rust::Slice<const rust::String>(in.strs.data(), in.strs.size())};
      run_op(in.op, r, s, out);
    } catch (const std::exception& e) {
      throw std::runtime_error("instruction " + std::to_string(k) + " (" + in.name + "): " + e.what());
    }
    if (out.size() != in.outputs) {
      throw std::runtime_error("instruction " + std::to_string(k) + " (" + in.name + ") returned " +
                               std::to_string(out.size()) + " arrays, expected " + std::to_string(in.outputs));
    }
    for (auto& a : out) slots.push_back(std::move(a));
  }
  std::vector<array> result;
  result.reserve(p.outputs.size());
  for (auto o : p.outputs) result.push_back(slots.at(o));
  return result;
}

// The program's graph on `inputs`: replayed, or rebuilt from its tape for inputs like these.
static std::vector<array> build(const ProgramSpec& p, const std::vector<array>& inputs, const Stream& s) {
  return p.tapes.build(inputs, s, [&] { return replay(p, inputs, s); });
}

size_t program_tapes(const ProgramSpec& p) { return p.tapes.size(); }

std::unique_ptr<ArrayVec> program_call(const ProgramSpec& p, const ArrayVec& inputs, const Stream& s) {
  auto out = std::make_unique<ArrayVec>();
  out->items = build(p, inputs.items, s);
  return out;
}

static Stream here(int32_t device) { return mx::default_stream(device == 1 ? mx::Device::gpu : mx::Device::cpu); }

std::unique_ptr<ArrayVec> program_dispatch_here(const ProgramSpec& p, const ArrayVec& inputs, int32_t device) {
  auto out = std::make_unique<ArrayVec>();
  out->items = build(p, inputs.items, here(device));
  mx::async_eval(out->items);
  return out;
}

bool program_finish_here(ArrayVec& outputs, int32_t device) { return evaluate_row_contiguous(outputs.items, here(device)); }

// The outputs on this thread's CPU stream `s`, each ending in MLX's `contiguous`, for a
// program_eval_async whose outputs may come out strided: they leave as plain bytes, and
// whether one is row-contiguous is known only once it is computed (`contiguous` shares
// the buffer when it is, but is a node all the same, two tasks for MLX's thread). An
// input passed through is contiguous already.
static std::vector<array> for_export(std::vector<array> out, const Stream& s) {
  for (auto& a : out)
    if (a.has_primitive()) a = mx::contiguous(a, false, s);
  return out;
}

bool row_contiguous(const ArrayVec& v) {
  return std::all_of(v.items.begin(), v.items.end(), [](const array& a) { return a.flags().row_contiguous; });
}

// Evaluates `out` on this thread's CPU stream `s`, and calls `done` once it is computed.
static void eval_then(const std::vector<array>& out, const Stream& s, rust::Box<EvalDone> done) {
  mx::async_eval(out);
  // Runs after every task of this evaluation (a CPU stream runs its tasks in order),
  // holding the outputs until then. std::function wants a copyable callable.
  auto d = std::make_shared<rust::Box<EvalDone>>(std::move(done));
  mx::scheduler::enqueue(s, [d, s, keep = out]() {
    std::string error;
    try {
      mx::scheduler::check_error(s);
    } catch (const std::exception& e) {
      error = e.what();
    }
    eval_done(std::move(*d), error);
  });
}

std::unique_ptr<ArrayVec> program_eval_async(const ProgramSpec& p, const ArrayVec& inputs, bool contiguous,
                                             rust::Box<EvalDone> done) {
  Stream s = mx::default_stream(mx::Device::cpu);
  auto out = std::make_unique<ArrayVec>();
  out->items = build(p, inputs.items, s);
  if (contiguous) out->items = for_export(std::move(out->items), s);
  eval_then(out->items, s, std::move(done));
  return out;
}

// The nodes MLX has yet to schedule in the graphs of `out`.
static size_t count_unscheduled(const std::vector<array>& out) {
  std::unordered_set<std::uintptr_t> seen;
  std::vector<const array*> stack;
  for (auto& a : out) stack.push_back(&a);
  while (!stack.empty()) {
    const array* a = stack.back();
    stack.pop_back();
    if (a->status() != array::Status::unscheduled || !seen.insert(a->id()).second) continue;
    for (auto& in : a->inputs()) stack.push_back(&in);
  }
  return seen.size();
}

size_t program_graph_size(const ProgramSpec& p, const ArrayVec& inputs) {
  // (Without the outputs' `contiguous`, which most programs never need.)
  return count_unscheduled(replay(p, inputs.items, mx::default_stream(mx::Device::cpu)));
}

size_t unscheduled_nodes(const ArrayVec& outputs) { return count_unscheduled(outputs.items); }

// The longest path of unscheduled nodes in the graphs of `out`, walked without recursion.
static size_t longest_unscheduled_path(const std::vector<array>& out) {
  auto pending = [](const array& a) { return a.status() == array::Status::unscheduled; };
  std::unordered_map<std::uintptr_t, size_t> depth;
  std::vector<std::pair<const array*, bool>> stack;
  size_t deepest = 0;
  for (auto& a : out)
    if (pending(a)) stack.push_back({&a, false});
  while (!stack.empty()) {
    auto [a, inputs_done] = stack.back();
    stack.pop_back();
    if (depth.count(a->id())) continue;
    if (!inputs_done) {
      stack.push_back({a, true});
      for (auto& in : a->inputs())
        if (pending(in) && !depth.count(in.id())) stack.push_back({&in, false});
      continue;
    }
    size_t d = 0;
    for (auto& in : a->inputs()) {
      auto found = depth.find(in.id());
      if (found != depth.end()) d = std::max(d, found->second);
    }
    depth[a->id()] = d + 1;
    deepest = std::max(deepest, d + 1);
  }
  return deepest;
}

size_t program_graph_depth(const ProgramSpec& p, const ArrayVec& inputs, int32_t device) {
  return longest_unscheduled_path(replay(p, inputs.items, here(device)));
}

// The lowest address of the calling thread's stack (nullptr if unknown).
static char* stack_low() {
#ifdef __APPLE__
  pthread_t self = pthread_self();
  return static_cast<char*>(pthread_get_stackaddr_np(self)) - pthread_get_stacksize_np(self);
#else
  pthread_attr_t attr;
  if (pthread_getattr_np(pthread_self(), &attr) != 0) return nullptr;
  void* addr = nullptr;
  size_t size = 0;
  int rc = pthread_attr_getstack(&attr, &addr, &size);
  pthread_attr_destroy(&attr);
  return rc == 0 ? static_cast<char*>(addr) : nullptr;
#endif
}

size_t stack_left() {
  // Asked once per thread: glibc's pthread_getattr_np makes a system call.
  thread_local char* const low = stack_low();
  char here_on_stack;
  return low && &here_on_stack > low ? static_cast<size_t>(&here_on_stack - low) : 0;
}

uint64_t inputs_signature(const ArrayVec& inputs) {
  Fnv f;
  for (auto& a : inputs.items) {
    f.mix(a.ndim());
    f.mix(static_cast<uint64_t>(a.dtype().val()));
    for (auto d : a.shape()) f.mix(static_cast<uint64_t>(d));
  }
  return f.h;
}

void hold_cpu_stream(rust::Box<HoldTask> task) {
  // std::function wants a copyable callable.
  auto t = std::make_shared<rust::Box<HoldTask>>(std::move(task));
  mx::scheduler::enqueue(mx::default_stream(mx::Device::cpu), [t] { hold_run(**t); });
}

int32_t mlx_tasks_in_flight() { return mx::scheduler::n_active_tasks(); }

bool mlx_memory_over_limit() { return mx::get_active_memory() > mx::get_memory_limit(); }

// On the CPU, MLX builds fused kernels by running the system C++ compiler (system() and
// popen()/pclose()). The BEAM sets SIGCHLD to SIG_IGN, which makes the kernel reap those
// children itself: the waits inside system() and pclose() then fail, and MLX concludes
// that there is no compiler (silently compiling nothing). SIGCHLD's default disposition
// also ignores the signal, but lets each parent wait for its own children. The BEAM's
// only child is erl_child_setup, which lives as long as the VM, so restoring the default
// changes nothing else. Done once, before MLX first asks whether a compiler exists.
static void allow_waiting_for_children() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction old {};
    if (sigaction(SIGCHLD, nullptr, &old) == 0 && old.sa_handler == SIG_IGN) {
      struct sigaction dfl {};
      dfl.sa_handler = SIG_DFL;
      sigemptyset(&dfl.sa_mask);
      sigaction(SIGCHLD, &dfl, nullptr);
    }
  });
}

Compiled::~Compiled() {
  for (auto& cache : caches) mx::detail::compile_erase(cache, id);
}

std::unique_ptr<Compiled> program_compile(const ProgramSpec& p, uint64_t id, int32_t device) {
  if (device == 0) allow_waiting_for_children();
  auto spec = std::make_shared<const ProgramSpec>(p);
  auto c = std::make_unique<Compiled>();
  c->id = id;
  c->fn = mx::detail::compile(
      [spec, device](const std::vector<array>& in) { return replay(*spec, in, here(device)); }, id);
  return c;
}

// Notes this thread's compile cache as one to erase `c`'s entries from.
static void note_cache(const Compiled& c) {
  auto cache = mx::detail::compile_cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  auto known = [&](const mx::detail::CompileCacheWeakPtr& w) {
    return !w.owner_before(cache) && !cache.owner_before(w);
  };
  if (std::none_of(c.caches.begin(), c.caches.end(), known)) c.caches.push_back(cache);
}

std::unique_ptr<ArrayVec> compiled_call(const Compiled& c, const ArrayVec& inputs) {
  note_cache(c);
  auto out = std::make_unique<ArrayVec>();
  out->items = c.fn(inputs.items);
  return out;
}

std::unique_ptr<ArrayVec> compiled_eval_async(const Compiled& c, const ArrayVec& inputs, bool contiguous,
                                              rust::Box<EvalDone> done) {
  note_cache(c);
  Stream s = mx::default_stream(mx::Device::cpu);
  auto out = std::make_unique<ArrayVec>();
  out->items = c.fn(inputs.items);
  if (contiguous) out->items = for_export(std::move(out->items), s);
  eval_then(out->items, s, std::move(done));
  return out;
}

}  // namespace emily
