// Tapes: recording a replay's graph and rebuilding it. See tape.h.
#include "tape.h"

#include <algorithm>
#include <cstring>
#include <unordered_map>
#include <utility>

#include "hash.h"
#include "mlx/primitives.h"

namespace emily {
namespace mx = mlx::core;

namespace {

// The tapes a program keeps (the oldest goes first), the most it records (inputs that
// keep changing kind, a prompt of each length, are left to the replay), and the kinds
// run once that it remembers.
constexpr size_t kTapes = 8;
constexpr size_t kRecordings = 32;
constexpr size_t kSeen = 16;

}  // namespace

struct Tape {
  enum Kind : uint32_t { kInput, kValue, kConstant };
  struct Ref {
    Kind kind;
    uint32_t index;
  };
  struct Node {
    std::shared_ptr<mx::Primitive> primitive;
    std::vector<Ref> inputs;
    std::vector<mx::Shape> shapes;
    std::vector<mx::Dtype> dtypes;
  };

  std::vector<int64_t> key;
  std::vector<Node> nodes;
  // Arrays in the graph that the replay did not compute (scalars it made, loaded
  // constants), held here: shared by every rebuilt graph, so MLX never donates their
  // buffers to an output.
  std::vector<array> constants;
  std::vector<Ref> outputs;
  // The outputs of all nodes, in order.
  size_t values = 0;
};

std::vector<int64_t> Tapes::key_of(const std::vector<array>& inputs, const Stream& s) {
  size_t n = inputs.size();
  // For each input, the first input that is the same array (itself if none).
  std::vector<std::pair<std::uintptr_t, uint32_t>> ids(n);
  for (size_t i = 0; i < n; i++) ids[i] = {inputs[i].id(), static_cast<uint32_t>(i)};
  std::sort(ids.begin(), ids.end());
  std::vector<uint32_t> first(n);
  for (size_t i = 0; i < n; i++)
    first[ids[i].second] = i > 0 && ids[i].first == ids[i - 1].first ? first[ids[i - 1].second] : ids[i].second;

  std::vector<int64_t> key;
  key.reserve(2 + n * 12);
  key.push_back(s.index);
  key.push_back(static_cast<int64_t>(s.device.type));
  for (size_t i = 0; i < n; i++) {
    const array& a = inputs[i];
    key.push_back(first[i]);
    key.push_back(static_cast<int64_t>(a.dtype().val()));
    key.push_back(a.ndim());
    key.insert(key.end(), a.shape().begin(), a.shape().end());
    if (a.status() == array::Status::unscheduled) {
      key.push_back(-1);
      continue;
    }
    auto f = a.flags();
    key.push_back(f.contiguous | f.row_contiguous << 1 | f.col_contiguous << 2 | (a.data_size() == a.size()) << 3);
    key.insert(key.end(), a.strides().begin(), a.strides().end());
  }
  return key;
}

static uint64_t hash_of(const std::vector<int64_t>& key) {
  Fnv f;
  for (auto w : key) f.mix(static_cast<uint64_t>(w));
  return f.h;
}

std::pair<std::shared_ptr<const Tape>, bool> Tapes::find(const std::vector<int64_t>& key) const {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& t : tapes_)
    if (t->key == key) return {t, false};
  if (recorded_ >= kRecordings) return {nullptr, false};
  uint64_t h = hash_of(key);
  if (std::find(seen_.begin(), seen_.end(), h) != seen_.end()) return {nullptr, true};
  if (seen_.size() == kSeen) seen_.erase(seen_.begin());
  seen_.push_back(h);
  return {nullptr, false};
}

std::vector<array> Tapes::rebuild(const Tape& t, const std::vector<array>& inputs) {
  std::vector<array> values;
  values.reserve(t.values);
  auto get = [&](Tape::Ref r) -> const array& {
    switch (r.kind) {
      case Tape::kInput: return inputs[r.index];
      case Tape::kValue: return values[r.index];
      default: return t.constants[r.index];
    }
  };
  for (const auto& n : t.nodes) {
    std::vector<array> in;
    in.reserve(n.inputs.size());
    for (auto r : n.inputs) in.push_back(get(r));
    if (n.shapes.size() == 1) {
      values.emplace_back(n.shapes[0], n.dtypes[0], n.primitive, std::move(in));
    } else {
      for (auto& o : array::make_arrays(n.shapes, n.dtypes, n.primitive, in)) values.push_back(std::move(o));
    }
  }
  std::vector<array> out;
  out.reserve(t.outputs.size());
  for (auto r : t.outputs) out.push_back(get(r));
  return out;
}

// A view that keeps its input's elements in order (a reshape, an added or removed unit
// axis, a transpose that moves only unit axes): a chain of them computes one reshape.
static bool keeps_order(const mx::Primitive& p, const mx::Shape& in) {
  // (By name: libmlx exports no type information for its primitives.)
  const char* name = p.name();
  if (!std::strcmp(name, "Reshape") || !std::strcmp(name, "ExpandDims") || !std::strcmp(name, "Squeeze")) return true;
  if (std::strcmp(name, "Transpose")) return false;
  int last = -1;
  for (int axis : static_cast<const mx::Transpose&>(p).state()) {
    if (in[axis] == 1) continue;
    if (axis < last) return false;
    last = axis;
  }
  return true;
}

// Folds each chain of order-keeping views whose inner links nothing else reads into one
// reshape of the chain's start, and drops the inner links. Bumblebee's graphs are full of
// them (a product's output reshaped to [B, L, N], then to [B, L, heads, D]; a head axis
// moved past a unit one, then merged), and every node costs the host the same to
// rebuild and MLX the same to encode, whether it computes or not. A reshape of the start
// computes the chain's values (a copy where the start's layout allows no view, as any
// reshape).
static void fold_views(Tape& t, const std::vector<array>& inputs) {
  // Each value's node, shape and readers (the outputs count as readers).
  std::vector<uint32_t> node_of;
  std::vector<const mx::Shape*> shape;
  for (uint32_t i = 0; i < t.nodes.size(); i++)
    for (auto& sh : t.nodes[i].shapes) {
      node_of.push_back(i);
      shape.push_back(&sh);
    }
  std::vector<uint32_t> readers(t.values, 0);
  for (auto& n : t.nodes)
    for (auto r : n.inputs)
      if (r.kind == Tape::kValue) readers[r.index]++;
  for (auto r : t.outputs)
    if (r.kind == Tape::kValue) readers[r.index]++;
  auto shape_of = [&](Tape::Ref r) -> const mx::Shape& {
    switch (r.kind) {
      case Tape::kInput: return inputs[r.index].shape();
      case Tape::kValue: return *shape[r.index];
      default: return t.constants[r.index].shape();
    }
  };

  // A node folded into its reader is dropped; a chain that ends in its start's shape is
  // dropped whole, its readers reading the start.
  std::vector<bool> dropped(t.nodes.size(), false);
  std::vector<std::pair<uint32_t, Tape::Ref>> same;
  for (uint32_t i = 0; i < t.nodes.size(); i++) {
    auto& n = t.nodes[i];
    if (n.inputs.size() != 1 || n.shapes.size() != 1 || n.inputs[0].kind != Tape::kValue) continue;
    uint32_t v = n.inputs[0].index;
    auto& inner = t.nodes[node_of[v]];
    if (dropped[node_of[v]] || readers[v] != 1 || inner.inputs.size() != 1 || inner.shapes.size() != 1) continue;
    if (!keeps_order(*n.primitive, *shape[v]) || !keeps_order(*inner.primitive, shape_of(inner.inputs[0]))) continue;
    auto start = inner.inputs[0];
    dropped[node_of[v]] = true;
    if (shape_of(start) == n.shapes[0]) {
      dropped[i] = true;
      same.emplace_back(i, start);
      continue;
    }
    n.inputs[0] = start;
    if (std::strcmp(n.primitive->name(), "Reshape")) {
      auto s = n.primitive->stream();
      n.primitive = mx::reshape(mx::zeros(shape_of(start), n.dtypes[0], s), n.shapes[0], s).primitive_ptr();
    }
  }
  if (same.empty() && std::find(dropped.begin(), dropped.end(), true) == dropped.end()) return;

  // Renumber the values that remain.
  std::vector<Tape::Ref> renumbered(t.values);
  std::vector<Tape::Node> kept;
  uint32_t next = 0, v = 0;
  auto remap = [&](Tape::Ref& r) {
    if (r.kind == Tape::kValue) r = renumbered[r.index];
  };
  auto whole = same.begin();
  for (uint32_t i = 0; i < t.nodes.size(); i++) {
    if (whole != same.end() && whole->first == i) {
      // (The start comes before: renumbered already.)
      remap(whole->second);
      renumbered[v++] = whole->second;
      whole++;
      continue;
    }
    for (size_t k = 0; k < t.nodes[i].shapes.size(); k++, v++)
      renumbered[v] = Tape::Ref{Tape::kValue, dropped[i] ? UINT32_MAX : next++};
    if (!dropped[i]) {
      for (auto& r : t.nodes[i].inputs) remap(r);
      kept.push_back(std::move(t.nodes[i]));
    }
  }
  for (auto& r : t.outputs) remap(r);
  t.nodes = std::move(kept);
  t.values = next;
}

// Walks the graphs of `out` (nothing evaluated yet) down to the inputs and to arrays the
// replay did not compute (constants), and lists the nodes inputs first.
static std::shared_ptr<Tape> record(const std::vector<array>& inputs, const std::vector<array>& out) {
  auto t = std::make_shared<Tape>();
  std::unordered_map<std::uintptr_t, Tape::Ref> refs;
  for (size_t i = 0; i < inputs.size(); i++) refs.emplace(inputs[i].id(), Tape::Ref{Tape::kInput, uint32_t(i)});
  std::vector<std::pair<const array*, bool>> stack;
  for (auto it = out.rbegin(); it != out.rend(); ++it) stack.push_back({&*it, false});
  while (!stack.empty()) {
    auto [a, inputs_done] = stack.back();
    stack.pop_back();
    if (refs.count(a->id())) continue;
    if (!a->has_primitive() || a->status() != array::Status::unscheduled) {
      refs.emplace(a->id(), Tape::Ref{Tape::kConstant, uint32_t(t->constants.size())});
      t->constants.push_back(*a);
      continue;
    }
    if (!inputs_done) {
      stack.push_back({a, true});
      for (auto it = a->inputs().rbegin(); it != a->inputs().rend(); ++it)
        if (!refs.count(it->id())) stack.push_back({&*it, false});
      continue;
    }
    Tape::Node n{a->primitive_ptr(), {}, {}, {}};
    for (auto& in : a->inputs()) n.inputs.push_back(refs.at(in.id()));
    for (auto& o : a->outputs()) {
      refs.emplace(o.id(), Tape::Ref{Tape::kValue, uint32_t(t->values++)});
      n.shapes.push_back(o.shape());
      n.dtypes.push_back(o.dtype());
    }
    t->nodes.push_back(std::move(n));
  }
  for (auto& o : out) t->outputs.push_back(refs.at(o.id()));
  fold_views(*t, inputs);
  return t;
}

void Tapes::keep(std::vector<int64_t> key, const std::vector<array>& inputs, const std::vector<array>& out) const {
  auto t = record(inputs, out);
  t->key = std::move(key);
  std::lock_guard<std::mutex> lock(mutex_);
  recorded_++;
  if (tapes_.size() == kTapes) tapes_.erase(tapes_.begin());
  tapes_.push_back(std::move(t));
}

size_t Tapes::size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return tapes_.size();
}

}  // namespace emily
