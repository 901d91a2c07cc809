// MLX's distributed layer. See distributed.h.
//
// Failure handling. MLX's ring backend moves data on one thread per socket that polls
// its non-blocking socket without a deadline: a peer that dies closes its sockets and
// the collective fails ("connection to a peer was lost"), but a peer that is alive and
// never takes part leaves it waiting forever, and once a socket's thread has given up,
// any later collective queued on it waits forever too. So every group is wrapped in a
// `Timed` group that, on the CPU:
//   * marks the start and end of each collective with tasks on the stream's MLX thread
//     around MLX's own, and lets one collective of the group be in flight at a time;
//   * has a watchdog close the group's sockets (shutdown(2)) when a collective runs past
//     the group's timeout: MLX's socket threads then fail it, the stream goes on;
//   * refuses every later collective of a group once it failed (its sockets closed, by
//     the watchdog or by a peer), before MLX queues anything on them.
// The group's sockets are those the ring backend opened while joining: found in
// /proc/self/fd by their ports. NCCL (GPU streams) has no such deadline.
#include "distributed.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/distributed/distributed.h"
#include "mlx/distributed/distributed_impl.h"
#include "mlx/distributed/ops.h"

namespace emily {
namespace mx = mlx::core;
namespace md = mlx::core::distributed;

namespace {

int64_t now_ms() {
  using namespace std::chrono;
  return duration_cast<milliseconds>(steady_clock::now().time_since_epoch()).count();
}

std::pair<std::string, int> split_address(const std::string& a) {
  auto colon = a.rfind(':');
  if (colon == std::string::npos) throw std::invalid_argument("expected \"ip:port\", got \"" + a + "\"");
  int port = 0;
  try {
    port = std::stoi(a.substr(colon + 1));
  } catch (...) {
    throw std::invalid_argument("expected \"ip:port\", got \"" + a + "\"");
  }
  if (port <= 0 || port > 65535) throw std::invalid_argument("port out of range in \"" + a + "\"");
  return {a.substr(0, colon), port};
}

int port_of(const sockaddr_storage& a) {
  if (a.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in&>(a).sin_port);
  if (a.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6&>(a).sin6_port);
  return -1;
}

// This process's open sockets: {fd, local port, peer port (-1 if not connected)}.
struct Sock {
  int fd, local, peer;
};
std::vector<Sock> sockets() {
  std::vector<Sock> out;
  DIR* d = opendir("/proc/self/fd");
  if (!d) return out;
  while (auto* e = readdir(d)) {
    char* end = nullptr;
    long fd = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0') continue;
    struct stat st;
    if (fstat(static_cast<int>(fd), &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
    sockaddr_storage a{};
    socklen_t len = sizeof(a);
    if (getsockname(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&a), &len) != 0) continue;
    Sock s{static_cast<int>(fd), port_of(a), -1};
    len = sizeof(a);
    if (getpeername(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&a), &len) == 0) s.peer = port_of(a);
    out.push_back(s);
  }
  closedir(d);
  return out;
}

// Sets environment variables for the length of a scope, then restores them. MLX's
// backends read their configuration only from the environment.
class EnvScope {
 public:
  void set(const char* name, const std::string& value) {
    const char* old = std::getenv(name);
    saved_.push_back({name, old ? std::optional<std::string>(old) : std::nullopt});
    setenv(name, value.c_str(), 1);
  }
  ~EnvScope() {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) {
      if (it->second) {
        setenv(it->first, it->second->c_str(), 1);
      } else {
        unsetenv(it->first);
      }
    }
  }

 private:
  std::vector<std::pair<const char*, std::optional<std::string>>> saved_;
};

class Timed : public md::detail::GroupImpl, public std::enable_shared_from_this<Timed> {
 public:
  Timed(std::shared_ptr<md::detail::GroupImpl> inner, std::string backend, std::vector<int> fds,
        int64_t timeout_ms)
      : inner_(std::move(inner)), backend_(std::move(backend)), fds_(std::move(fds)), timeout_ms_(timeout_ms) {}

  // Refuses, while the graph is built, a collective on a stream its backend cannot run
  // on. Evaluated there it would throw inside MLX's CUDA graph capture (ring's CPU
  // kernels on a GPU stream), which aborts the process; MLX's own communication_stream
  // keeps whatever stream it is given.
  void check_stream(const mx::Stream& s, const char* op) const {
    bool nccl = backend_ == "nccl";
    auto want = nccl ? mx::Device::gpu : mx::Device::cpu;
    if (s.device != want) {
      throw std::invalid_argument(std::string("[distributed] ") + op + ": the " + backend_ + " backend runs on " +
                                  (nccl ? "a GPU" : "the CPU") + " stream only, got a " +
                                  (s.device == mx::Device::cpu ? "CPU" : "GPU") + " stream");
    }
    if (nccl && (std::string(op) == "send" || std::string(op) == "recv")) {
      throw std::invalid_argument(std::string("[distributed] ") + op + ": the nccl backend has no " + op);
    }
  }

  mx::Stream communication_stream(mx::StreamOrDevice s) override { return inner_->communication_stream(s); }
  int rank() override { return inner_->rank(); }
  int size() override { return inner_->size(); }
  std::shared_ptr<md::detail::GroupImpl> split(int, int) override {
    throw std::runtime_error("[distributed] Emily's groups cannot be split");
  }

  void all_sum(const mx::array& in, mx::array& out, mx::Stream s) override {
    run(s, "all_sum", [&] { inner_->all_sum(in, out, s); });
  }
  void all_gather(const mx::array& in, mx::array& out, mx::Stream s) override {
    run(s, "all_gather", [&] { inner_->all_gather(in, out, s); });
  }
  void send(const mx::array& in, int dst, mx::Stream s) override {
    run(s, "send", [&] { inner_->send(in, dst, s); });
  }
  void recv(mx::array& out, int src, mx::Stream s) override {
    run(s, "recv", [&] { inner_->recv(out, src, s); });
  }
  void all_max(const mx::array& in, mx::array& out, mx::Stream s) override {
    run(s, "all_max", [&] { inner_->all_max(in, out, s); });
  }
  void all_min(const mx::array& in, mx::array& out, mx::Stream s) override {
    run(s, "all_min", [&] { inner_->all_min(in, out, s); });
  }
  void sum_scatter(const mx::array& in, mx::array& out, mx::Stream s) override {
    run(s, "sum_scatter", [&] { inner_->sum_scatter(in, out, s); });
  }

  // The watchdog's check: closes the group if a collective has run past the timeout.
  void check_deadline() {
    int64_t start = started_.load();
    if (start != 0 && timeout_ms_ > 0 && now_ms() - start > timeout_ms_) {
      std::lock_guard lk(mu_);
      close_locked("a collective got no answer within " + std::to_string(timeout_ms_) + " ms");
    }
  }

 private:
  template <class F>
  void run(mx::Stream s, const char* op, F&& dispatch) {
    if (s.device != mx::Device::cpu) {
      // NCCL only (check_stream): nothing may throw here, inside a CUDA graph capture,
      // and an NCCL group is never closed (it has no deadline of Emily's).
      dispatch();
      return;
    }
    {
      std::unique_lock lk(mu_);
      // One collective in flight per group: the previous one's failure is then seen
      // (closed sockets) before anything is queued behind it.
      auto wait = std::chrono::milliseconds(timeout_ms_ > 0 ? 2 * timeout_ms_ + 1000 : 0);
      bool idle = timeout_ms_ > 0 ? cv_.wait_for(lk, wait, [&] { return !pending_ || closed_; })
                                  : (cv_.wait(lk, [&] { return !pending_ || closed_; }), true);
      if (!idle) close_locked("the previous collective did not finish");
      check_open_locked(op);
      if (!sockets_open()) {
        close_locked("a peer closed its connection (it stopped, or its collective failed)");
        check_open_locked(op);
      }
      pending_ = true;
    }
    auto self = shared_from_this();
    auto& enc = mx::cpu::get_command_encoder(s);
    enc.dispatch([self] { self->started_.store(now_ms()); });
    try {
      dispatch();
    } catch (...) {
      enc.dispatch([self] { self->finish(); });
      throw;
    }
    enc.dispatch([self] { self->finish(); });
  }

  void finish() {
    std::lock_guard lk(mu_);
    started_.store(0);
    pending_ = false;
    cv_.notify_all();
  }

  // Whether every socket of the group is still connected (a peek that reads nothing).
  bool sockets_open() {
    for (int fd : fds_) {
      char c;
      ssize_t r = ::recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
      if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return false;
    }
    return true;
  }

  void check_open_locked(const char* op) {
    if (closed_) {
      throw std::runtime_error(std::string("[distributed] ") + op + ": the group is closed (" + reason_ +
                               "); initialize a new one");
    }
  }

  void close_locked(const std::string& why) {
    if (closed_) return;
    closed_ = true;
    reason_ = why;
    // MLX's socket threads see the shutdown and fail what is in flight, on every rank.
    for (int fd : fds_) shutdown(fd, SHUT_RDWR);
    cv_.notify_all();
  }

  std::shared_ptr<md::detail::GroupImpl> inner_;
  std::string backend_;
  std::vector<int> fds_;
  int64_t timeout_ms_;
  std::atomic<int64_t> started_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  bool pending_ = false;
  bool closed_ = false;
  std::string reason_;
};

std::mutex registry_mu;
std::unordered_map<int64_t, std::shared_ptr<Timed>> registry;
int64_t next_id = 1;

void watchdog() {
  for (;;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    std::vector<std::shared_ptr<Timed>> groups;
    {
      std::lock_guard lk(registry_mu);
      for (auto& [id, g] : registry) groups.push_back(g);
    }
    for (auto& g : groups) g->check_deadline();
  }
}

// The group `id` stands for, once `op` on stream `s` is one its backend runs; nullopt
// for the world of one (0), whose collectives are copies on any stream.
std::optional<md::Group> lookup(int64_t id, const mx::Stream& s, const char* op) {
  if (id == 0) return std::nullopt;
  std::shared_ptr<Timed> g;
  {
    std::lock_guard lk(registry_mu);
    auto it = registry.find(id);
    if (it == registry.end()) {
      throw std::invalid_argument("[distributed] unknown group " + std::to_string(id) + " (released?)");
    }
    g = it->second;
  }
  g->check_stream(s, op);
  return md::Group(g);
}

}  // namespace

bool distributed_available(rust::Str backend) { return md::is_available(std::string(backend)); }

int64_t distributed_init(rust::Str backend_s, int32_t rank, int32_t size, rust::Str hostfile_s,
                         rust::Str coordinator_s, int64_t timeout_ms) {
  std::string backend(backend_s), hostfile(hostfile_s), coordinator(coordinator_s);
  if (size < 2 || rank < 0 || rank >= size) {
    throw std::invalid_argument("[distributed] rank " + std::to_string(rank) + " is not in a group of " +
                                std::to_string(size));
  }
  if (!md::is_available(backend)) {
    throw std::invalid_argument("[distributed] this MLX has no \"" + backend + "\" backend");
  }
  // One join at a time: the environment MLX reads and its backend cache are global.
  static std::mutex init_mu;
  std::lock_guard lk(init_mu);
  std::set<int> before;
  for (auto& s : sockets()) before.insert(s.fd);

  int own_port = -1, right_port = -1;
  {
    EnvScope env;
    env.set("MLX_RANK", std::to_string(rank));
    if (backend == "ring") {
      env.set("MLX_HOSTFILE", hostfile);
    } else if (backend == "nccl") {
      auto [ip, port] = split_address(coordinator);
      env.set("NCCL_HOST_IP", ip);
      env.set("NCCL_PORT", std::to_string(port));
      env.set("MLX_WORLD_SIZE", std::to_string(size));
    }
    if (backend == "ring") {
      std::ifstream f(hostfile);
      std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
      // The hostfile Emily writes holds one "ip:port" per rank, in order.
      std::vector<int> ports;
      for (size_t i = 0; (i = text.find('"', i)) != std::string::npos;) {
        size_t j = text.find('"', i + 1);
        if (j == std::string::npos) break;
        ports.push_back(split_address(text.substr(i + 1, j - i - 1)).second);
        i = j + 1;
      }
      if (static_cast<int>(ports.size()) != size) {
        throw std::invalid_argument("[distributed] the hostfile lists " + std::to_string(ports.size()) +
                                    " hosts for a group of " + std::to_string(size));
      }
      own_port = ports[rank];
      right_port = ports[(rank + 1) % size];
    }
    // A fresh group, not MLX's cached one: a group that failed can be joined again.
    md::clear_backends();
    std::optional<md::Group> g;
    try {
      g = md::init(true, backend);
    } catch (...) {
      md::clear_backends();
      throw;
    }
    md::clear_backends();
    if (g->size() != size || g->rank() != rank) {
      throw std::runtime_error("[distributed] joined as rank " + std::to_string(g->rank()) + " of " +
                               std::to_string(g->size()) + ", expected rank " + std::to_string(rank) + " of " +
                               std::to_string(size));
    }
    std::vector<int> fds;
    if (backend == "ring") {
      for (auto& s : sockets()) {
        if (before.count(s.fd)) continue;
        if ((s.local == own_port && s.peer > 0) || s.peer == right_port) fds.push_back(s.fd);
      }
    }
    auto timed =
        std::make_shared<Timed>(g->raw_group(), backend, std::move(fds), backend == "ring" ? timeout_ms : 0);
    static std::once_flag started;
    std::call_once(started, [] { std::thread(watchdog).detach(); });
    std::lock_guard rl(registry_mu);
    int64_t id = next_id++;
    registry.emplace(id, std::move(timed));
    return id;
  }
}

void distributed_release(int64_t id) {
  std::shared_ptr<Timed> g;
  {
    std::lock_guard lk(registry_mu);
    auto it = registry.find(id);
    if (it == registry.end()) return;
    g = std::move(it->second);
    registry.erase(it);
  }
  // Dropped here, outside the lock: the last holder's destructor joins MLX's threads.
}

mx::array dist_all_sum(const mx::array& x, int64_t group, const mx::Stream& s) {
  auto g = lookup(group, s, "all_sum");
  return g ? md::all_sum(x, g, s) : mx::copy(x, s);
}

mx::array dist_all_max(const mx::array& x, int64_t group, const mx::Stream& s) {
  auto g = lookup(group, s, "all_max");
  return g ? md::all_max(x, g, s) : mx::copy(x, s);
}

mx::array dist_all_min(const mx::array& x, int64_t group, const mx::Stream& s) {
  auto g = lookup(group, s, "all_min");
  return g ? md::all_min(x, g, s) : mx::copy(x, s);
}

mx::array dist_all_gather(const mx::array& x, int64_t group, const mx::Stream& s) {
  auto g = lookup(group, s, "all_gather");
  if (!g) return mx::copy(x.ndim() == 0 ? mx::reshape(x, {1}, s) : x, s);
  return md::all_gather(x, g, s);
}

mx::array dist_send(const mx::array& x, int dst, int64_t group, const mx::Stream& s) {
  auto g = lookup(group, s, "send");
  if (!g) throw std::invalid_argument("[distributed] send: a group of one has no other rank");
  return md::send(x, dst, g, s);
}

mx::array dist_recv(const mx::Shape& shape, mx::Dtype dtype, int src, int64_t group, const mx::Stream& s) {
  auto g = lookup(group, s, "recv");
  if (!g) throw std::invalid_argument("[distributed] recv: a group of one has no other rank");
  return md::recv(shape, dtype, src, g, s);
}

}  // namespace emily
