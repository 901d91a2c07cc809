// MLX's distributed layer (mlx/distributed): groups and collectives. Glue only.
//
// A group is known by an id (0: the world of one, which needs no backend). Ops on a group
// are graph nodes built on the stream's worker like any op; the collective itself runs
// when the graph is evaluated, on the stream's MLX thread.
#pragma once

#include <cstdint>

#include "mlx/mlx.h"
#include "rust/cxx.h"

namespace emily {

// Joins a group of `size` processes as `rank` over `backend` ("ring", "nccl", "mpi")
// and returns its id. `hostfile` is the ring backend's JSON host list (one list of
// "ip:port" per rank); `coordinator` ("ip:port", rank 0's) is NCCL's rendezvous.
// Blocks until every rank has joined, or MLX gives up. `timeout_ms` bounds each later
// collective of the group on the CPU (see distributed.cc). Throws on failure.
int64_t distributed_init(rust::Str backend, int32_t rank, int32_t size, rust::Str hostfile,
                         rust::Str coordinator, int64_t timeout_ms);
// Forgets group `id`: its connections close once no pending op holds it.
void distributed_release(int64_t id);
// Whether `backend` is compiled into this libmlx ("ring", "mpi", "nccl", "jaccl").
bool distributed_available(rust::Str backend);

// The op table's glue (optable/distributed.ops). Each throws std::invalid_argument for a
// stream whose device the group's backend does not run on (ring, mpi: CPU; nccl: GPU).
mlx::core::array dist_all_sum(const mlx::core::array& x, int64_t group, const mlx::core::Stream& s);
mlx::core::array dist_all_max(const mlx::core::array& x, int64_t group, const mlx::core::Stream& s);
mlx::core::array dist_all_min(const mlx::core::array& x, int64_t group, const mlx::core::Stream& s);
mlx::core::array dist_all_gather(const mlx::core::array& x, int64_t group, const mlx::core::Stream& s);
mlx::core::array dist_send(const mlx::core::array& x, int dst, int64_t group, const mlx::core::Stream& s);
mlx::core::array dist_recv(const mlx::core::Shape& shape, mlx::core::Dtype dtype, int src, int64_t group,
                           const mlx::core::Stream& s);

}  // namespace emily
