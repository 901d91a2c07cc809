// Streams and devices. Every function here runs on the worker thread that owns the stream.
#include "emily.h"

namespace emily {
namespace mx = mlx::core;

static mx::Device device_of(int32_t d) { return d == 1 ? mx::Device::gpu : mx::Device::cpu; }

rust::String mlx_version() { return rust::String(mx::version()); }
bool device_available(int32_t d) { return mx::is_available(device_of(d)); }
std::unique_ptr<Stream> stream_new(int32_t d) { return std::make_unique<Stream>(mx::new_stream(device_of(d))); }
void synchronize(const Stream& s) { mx::synchronize(s); }
void stream_set_default(const Stream& s) { mx::set_default_stream(s); }

}  // namespace emily
