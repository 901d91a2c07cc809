// Emily's kernel primitive on MLX's CUDA backend (cuda_launch.h).
//
// Three things come from outside Emily's own code, each found once:
// - NVRTC and the CUDA driver: libmlx links both (libnvrtc.so.13 or .12, libcuda.so.1), so
//   they are already loaded; their functions are looked up in them, and Emily links
//   neither.
// - MLX's command encoder (`cu::get_command_encoder`, `add_kernel_node_raw`, the input
//   and output tracking), which libmlx exports.
// - MLX's device allocator, `cu::malloc_async`: a stream-ordered allocation from the
//   device's memory pool and MLX's buffer cache, what every CUDA primitive of MLX's
//   allocates its outputs with. MLX declares it in its headers but does not export it, and
//   its exported `allocator::malloc` gives managed memory, moving a device buffer it
//   reuses from the cache into managed memory with a synchronous copy. libmlx ships with
//   its full symbol table, where the function is found by its mangled name; where it is
//   not (another build of libmlx), `available()` is false and the callers leave the work
//   to MLX's own ops.
#include "cuda_launch.h"

#include <stdexcept>

#if EMILY_CUDA_LAUNCH

#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <link.h>
#include <nvrtc.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>

#include <mlx/backend/common/utils.h>
#include <mlx/backend/cuda/allocator.h>
#include <mlx/backend/cuda/cuda.h>
#include <mlx/backend/cuda/device.h>
#include <mlx/backend/cuda/utils.h>
#include <mlx/primitives.h>

#endif

namespace emily::cuda {

namespace mx = mlx::core;

const char* const kTypes = R"(
struct bf16_t { unsigned short bits; };
struct f16_t { unsigned short bits; };
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(bf16_t v) { return __uint_as_float((unsigned)v.bits << 16); }
__device__ __forceinline__ float to_float(f16_t v) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
  return f;
}
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ bf16_t from_float<bf16_t>(float v) {
  bf16_t r;
#if __CUDA_ARCH__ >= 800
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(v));
#else
  const unsigned u = __float_as_uint(v);
  r.bits = (u & 0x7fffffffu) > 0x7f800000u ? 0x7fff : (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
#endif
  return r;
}
template <> __device__ __forceinline__ f16_t from_float<f16_t>(float v) {
  f16_t r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(v));
  return r;
}
)";

const char* type_name(mx::Dtype t) {
  switch (t.val()) {
    case mx::Dtype::Val::float32:
      return "float";
    case mx::Dtype::Val::bfloat16:
      return "bf16_t";
    case mx::Dtype::Val::float16:
      return "f16_t";
    case mx::Dtype::Val::bool_:
      return "bool";
    default:
      throw std::invalid_argument("[cuda kernel] no storage type for this dtype");
  }
}

const char* bits_type(size_t bytes) {
  switch (bytes) {
    case 1:
      return "unsigned char";
    case 2:
      return "unsigned short";
    case 4:
      return "unsigned int";
    case 8:
      return "unsigned long long";
    default:
      throw std::invalid_argument("[cuda kernel] no storage type of this size");
  }
}

#if EMILY_CUDA_LAUNCH

namespace {

using MallocAsync = decltype(&mx::cu::malloc_async);

// The address of a function of libmlx's that its dynamic symbol table leaves out, from
// the full table in libmlx's file; null where there is none or the name is not in it.
void* hidden_function(const char* mangled) {
  Dl_info info;
  if (!dladdr(reinterpret_cast<void*>(&mx::cu::get_command_encoder), &info) || !info.dli_fname) return nullptr;
  void* handle = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
  if (!handle) return nullptr;
  link_map* map = nullptr;
  int got = dlinfo(handle, RTLD_DI_LINKMAP, &map);
  dlclose(handle);
  if (got != 0 || !map) return nullptr;

  int fd = open(info.dli_fname, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return nullptr;
  struct stat st;
  void* file = fstat(fd, &st) == 0 ? mmap(nullptr, st.st_size, PROT_READ, MAP_PRIVATE, fd, 0) : MAP_FAILED;
  close(fd);
  if (file == MAP_FAILED) return nullptr;
  std::unique_ptr<void, std::function<void(void*)>> unmap(file, [&](void* p) { munmap(p, st.st_size); });

  auto* bytes = static_cast<const unsigned char*>(file);
  auto size = static_cast<size_t>(st.st_size);
  auto* eh = reinterpret_cast<const Elf64_Ehdr*>(bytes);
  if (size < sizeof(Elf64_Ehdr) || std::memcmp(eh->e_ident, ELFMAG, SELFMAG) != 0 ||
      eh->e_ident[EI_CLASS] != ELFCLASS64 || eh->e_shentsize != sizeof(Elf64_Shdr) ||
      eh->e_shoff + size_t{eh->e_shnum} * sizeof(Elf64_Shdr) > size)
    return nullptr;
  auto* sections = reinterpret_cast<const Elf64_Shdr*>(bytes + eh->e_shoff);
  for (int i = 0; i < eh->e_shnum; i++) {
    const Elf64_Shdr& symtab = sections[i];
    if (symtab.sh_type != SHT_SYMTAB || symtab.sh_link >= eh->e_shnum) continue;
    const Elf64_Shdr& strtab = sections[symtab.sh_link];
    if (symtab.sh_offset + symtab.sh_size > size || strtab.sh_offset + strtab.sh_size > size) return nullptr;
    auto* syms = reinterpret_cast<const Elf64_Sym*>(bytes + symtab.sh_offset);
    auto* names = reinterpret_cast<const char*>(bytes + strtab.sh_offset);
    size_t n = symtab.sh_size / sizeof(Elf64_Sym);
    size_t len = std::strlen(mangled);
    for (size_t j = 0; j < n; j++) {
      const Elf64_Sym& sym = syms[j];
      if (ELF64_ST_TYPE(sym.st_info) != STT_FUNC || sym.st_shndx == SHN_UNDEF || sym.st_name + len >= strtab.sh_size)
        continue;
      if (std::memcmp(names + sym.st_name, mangled, len + 1) != 0) continue;
      void* address = reinterpret_cast<void*>(map->l_addr + sym.st_value);
      // It must lie in the very library whose file was read.
      Dl_info where;
      if (!dladdr(address, &where) || where.dli_fbase != info.dli_fbase) return nullptr;
      return address;
    }
  }
  return nullptr;
}

void* loaded(std::initializer_list<const char*> sonames) {
  for (const char* name : sonames)
    if (void* handle = dlopen(name, RTLD_LAZY | RTLD_NOLOAD)) return handle;
  return nullptr;
}

// The functions found once; `ok` when all of them were.
struct Api {
  MallocAsync malloc_async = nullptr;
  decltype(&nvrtcGetNumSupportedArchs) num_archs = nullptr;
  decltype(&nvrtcGetSupportedArchs) archs = nullptr;
  decltype(&nvrtcCreateProgram) create = nullptr;
  decltype(&nvrtcCompileProgram) compile = nullptr;
  decltype(&nvrtcGetProgramLogSize) log_size = nullptr;
  decltype(&nvrtcGetProgramLog) log = nullptr;
  decltype(&nvrtcGetCUBINSize) cubin_size = nullptr;
  decltype(&nvrtcGetCUBIN) cubin = nullptr;
  decltype(&nvrtcGetPTXSize) ptx_size = nullptr;
  decltype(&nvrtcGetPTX) ptx = nullptr;
  decltype(&nvrtcDestroyProgram) destroy = nullptr;
  decltype(&cuModuleLoadData) load = nullptr;
  decltype(&cuModuleGetFunction) function = nullptr;
  bool ok = false;
};

const Api& api() {
  static const Api found = [] {
    Api a;
    if (!mx::cu::is_available()) return a;
    void* nvrtc = loaded({"libnvrtc.so.13", "libnvrtc.so.12"});
    void* driver = loaded({"libcuda.so.1"});
    if (!nvrtc || !driver) return a;
    auto get = [](void* lib, auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      return fn != nullptr;
    };
    a.malloc_async = reinterpret_cast<MallocAsync>(hidden_function("_ZN3mlx4core2cu12malloc_asyncEmRNS1_14CommandEncoderE"));
    a.ok = a.malloc_async && get(nvrtc, a.num_archs, "nvrtcGetNumSupportedArchs") &&
           get(nvrtc, a.archs, "nvrtcGetSupportedArchs") && get(nvrtc, a.create, "nvrtcCreateProgram") &&
           get(nvrtc, a.compile, "nvrtcCompileProgram") && get(nvrtc, a.log_size, "nvrtcGetProgramLogSize") &&
           get(nvrtc, a.log, "nvrtcGetProgramLog") && get(nvrtc, a.cubin_size, "nvrtcGetCUBINSize") &&
           get(nvrtc, a.cubin, "nvrtcGetCUBIN") && get(nvrtc, a.ptx_size, "nvrtcGetPTXSize") &&
           get(nvrtc, a.ptx, "nvrtcGetPTX") && get(nvrtc, a.destroy, "nvrtcDestroyProgram") &&
           get(driver, a.load, "cuModuleLoadData") && get(driver, a.function, "cuModuleGetFunction");
    return a;
  }();
  return found;
}

void check(nvrtcResult r, const char* what) {
  if (r != NVRTC_SUCCESS) throw std::runtime_error(std::string("[cuda kernel] ") + what + " failed (NVRTC error " + std::to_string(r) + ")");
}

void check(CUresult r, const char* what) {
  if (r != CUDA_SUCCESS) throw std::runtime_error(std::string("[cuda kernel] ") + what + " failed (CUDA error " + std::to_string(r) + ")");
}

// `source` compiled for `device`: SASS where NVRTC knows the device's architecture, else
// PTX for the driver to finish.
CUfunction compile(const Kernel& k, mx::cu::Device& device) {
  const Api& a = api();
  int cc = device.compute_capability_major() * 10 + device.compute_capability_minor();
  int n = 0;
  check(a.num_archs(&n), "nvrtcGetNumSupportedArchs");
  std::vector<int> archs(n);
  check(a.archs(archs.data()), "nvrtcGetSupportedArchs");
  bool sass = std::find(archs.begin(), archs.end(), cc) != archs.end();
  std::string arch = std::string("--gpu-architecture=") + (sass ? "sm_" : "compute_") + std::to_string(cc);

  nvrtcProgram prog;
  check(a.create(&prog, k.source.c_str(), (k.entry + ".cu").c_str(), 0, nullptr, nullptr), "nvrtcCreateProgram");
  std::unique_ptr<nvrtcProgram, void (*)(nvrtcProgram*)> destroy(&prog, [](nvrtcProgram* p) { api().destroy(p); });
  const char* options[] = {arch.c_str(), "--std=c++17"};
  if (a.compile(prog, 2, options) != NVRTC_SUCCESS) {
    size_t size = 0;
    a.log_size(prog, &size);
    std::string log(size, '\0');
    a.log(prog, log.data());
    throw std::runtime_error("[cuda kernel] " + k.entry + " does not compile: " + log);
  }
  size_t size = 0;
  check(sass ? a.cubin_size(prog, &size) : a.ptx_size(prog, &size), sass ? "nvrtcGetCUBINSize" : "nvrtcGetPTXSize");
  std::string image(size, '\0');
  check(sass ? a.cubin(prog, image.data()) : a.ptx(prog, image.data()), sass ? "nvrtcGetCUBIN" : "nvrtcGetPTX");

  device.make_current();
  CUmodule module;
  check(a.load(&module, image.data()), "cuModuleLoadData");
  CUfunction fn;
  check(a.function(&fn, module, k.entry.c_str()), "cuModuleGetFunction");
  return fn;  // the module lives as long as the program, as MLX's kernel modules do
}

}  // namespace

struct Instance {
  Kernel kernel;
  std::once_flag compiled;
  CUfunction function = nullptr;
};

namespace {

// The copy that fills an in-place kernel's output where it cannot take its input's buffer:
// input `in` of rank `rank` and `size` elements of `bytes` bytes, read through its
// strides, written row-contiguous to output 0.
constexpr const char* kCopySource = R"(
extern "C" __global__ void emily_copy(T* out, const T* in, ARGS) {
  const long long n = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= SIZE) return;
  const int dims[RANK] = {DIMS};
  const long long strides[RANK] = {STRIDES};
  long long rest = n, from = 0;
#pragma unroll
  for (int k = RANK - 1; k >= 0; --k) {
    from += rest % dims[k] * strides[k];
    rest /= dims[k];
  }
  out[n] = in[from];
}
)";

constexpr unsigned kCopyBlock = 256;

Instance& copy_kernel(int in, const array& a) {
  int rank = a.ndim();
  auto num = [](auto v) { return std::to_string(v); };
  std::string key = "copy " + num(in) + " " + num(rank) + " " + num(a.itemsize()) + " " + num(a.size());
  return instance(key, [&] {
    std::string args, dims, strides;
    using P = Param;
    std::vector<P> params{{P::Output, 0}, {P::Input, in}};
    for (int k = 0; k < rank; k++) {
      args += (k ? ", int d" : "int d") + num(k);
      dims += (k ? ", d" : "d") + num(k);
      params.push_back({P::Dim, in, k});
    }
    for (int k = 0; k < rank; k++) {
      args += ", long long s" + num(k);
      strides += (k ? ", s" : "s") + num(k);
      params.push_back({P::Stride, in, k});
    }
    std::string src = kTypes;
    src += "using T = " + std::string(bits_type(a.itemsize())) + ";\n#define RANK " + num(rank) + "\n#define SIZE " +
           num(a.size()) + "LL\n#define ARGS " + args + "\n#define DIMS " + dims + "\n#define STRIDES " + strides + "\n";
    src += kCopySource;
    auto blocks = static_cast<unsigned>((a.size() + kCopyBlock - 1) / kCopyBlock);
    return Kernel{"emily_copy", std::move(src), std::move(params), {blocks, 1, 1}, {kCopyBlock, 1, 1}};
  });
}

// One node of `k` on the encoder, reading `inputs` and writing `outputs` (whose data is
// set).
void add_node(Instance& k, const std::vector<array>& inputs, std::vector<array>& outputs,
              mx::cu::CommandEncoder& encoder) {
  std::call_once(k.compiled, [&] { k.function = compile(k.kernel, encoder.device()); });
  // Each parameter's value in a slot of its own, as the node reads it: pointers and
  // long longs fill a slot, ints its first four bytes.
  const auto& params = k.kernel.params;
  std::vector<int64_t> slots(params.size());
  std::vector<void*> pointers(params.size());
  for (size_t i = 0; i < params.size(); i++) {
    const Param& p = params[i];
    void* slot = &slots[i];
    switch (p.kind) {
      case Param::Input:
        *static_cast<const void**>(slot) = mx::gpu_ptr<void>(inputs[p.index]);
        break;
      case Param::Output:
        *static_cast<void**>(slot) = mx::gpu_ptr<void>(outputs[p.index]);
        break;
      case Param::Dim:
        *static_cast<int32_t*>(slot) = inputs[p.index].shape(p.axis);
        break;
      case Param::Stride:
        *static_cast<int64_t*>(slot) = inputs[p.index].strides(p.axis);
        break;
      case Param::Int:
        *static_cast<int32_t*>(slot) = p.value;
        break;
      case Param::BroadcastStride: {
        const array& in = inputs[p.index];
        int axis = p.axis - (p.value - static_cast<int>(in.ndim()));
        *static_cast<int64_t*>(slot) = axis < 0 || in.shape(axis) == 1 ? 0 : in.strides(axis);
        break;
      }
    }
    pointers[i] = slot;
  }
  // MLX's encoder orders each node after the last node that wrote a buffer it reads or
  // writes.
  for (const auto& in : inputs) encoder.set_input_array(in);
  for (const auto& out : outputs) encoder.set_output_array(out);
  const auto& [gx, gy, gz] = k.kernel.grid;
  const auto& [bx, by, bz] = k.kernel.block;
  encoder.add_kernel_node_raw(k.function, dim3(gx, gy, gz), dim3(bx, by, bz), dim3(1, 1, 1), 0, pointers.data());
}

class Launch : public mx::Primitive {
 public:
  Launch(mx::Stream s, Instance& k, Instance* fill) : mx::Primitive(s), k_(k), fill_(fill) {}

  void eval_cpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("[cuda kernel] " + k_.kernel.entry + " runs on a GPU stream only");
  }

  void eval_gpu(const std::vector<array>& inputs, std::vector<array>& outputs) override {
    auto& encoder = mx::cu::get_command_encoder(stream());
    const Api& a = api();
    int in_place = k_.kernel.in_place;
    for (size_t i = 0; i < outputs.size(); i++) {
      auto& out = outputs[i];
      if (i == 0 && in_place >= 0) {
        const array& in = inputs[in_place];
        // As MLX's own updates donate (and no larger buffer than the output needs). An
        // input that a node queued earlier still reads is not donatable: each node holds
        // its inputs' data until its graph completes.
        if (in.flags().row_contiguous && in.data_size() == in.size() && mx::is_donatable(in, out)) {
          out.copy_shared_buffer(in);
          continue;
        }
        out.set_data(a.malloc_async(out.nbytes(), encoder));
        std::vector<array> filled{out};
        add_node(*fill_, inputs, filled, encoder);
        continue;
      }
      out.set_data(a.malloc_async(out.nbytes(), encoder));
    }
    add_node(k_, inputs, outputs, encoder);
  }

  const char* name() const override { return k_.kernel.entry.c_str(); }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const Launch*>(&other);
    return o && &o->k_ == &k_ && o->fill_ == fill_;
  }

 private:
  Instance& k_;
  Instance* fill_;
};

}  // namespace

bool available() { return api().ok; }

Instance& instance(const std::string& key, const std::function<Kernel()>& make) {
  static std::mutex mutex;
  // Leaked on purpose, as MLX's own kernel caches: nodes still alive at exit point here.
  static auto* made = new std::unordered_map<std::string, std::unique_ptr<Instance>>();
  std::lock_guard<std::mutex> lock(mutex);
  auto& slot = (*made)[key];
  if (!slot) {
    slot = std::make_unique<Instance>();
    slot->kernel = make();
  }
  return *slot;
}

std::vector<array> launch(Instance& kernel, const std::vector<array>& inputs, std::vector<mx::Shape> shapes,
                          std::vector<mx::Dtype> types, const Stream& s) {
  if (!available()) throw std::runtime_error("[cuda kernel] Emily's CUDA kernels are not available here");
  int in_place = kernel.kernel.in_place;
  if (in_place >= 0 && (shapes.empty() || inputs.at(in_place).shape() != shapes[0] ||
                        inputs[in_place].dtype() != types[0] || inputs[in_place].ndim() == 0 ||
                        inputs[in_place].size() == 0))
    throw std::invalid_argument("[cuda kernel] " + kernel.kernel.entry +
                                ": an in-place output takes its input's shape and type, of rank 1 or more, not empty");
  Instance* fill = in_place >= 0 ? &copy_kernel(in_place, inputs[in_place]) : nullptr;
  auto primitive = std::make_shared<Launch>(s, kernel, fill);
  return array::make_arrays(std::move(shapes), types, std::move(primitive), inputs);
}

#else

struct Instance {};

bool available() { return false; }

Instance& instance(const std::string&, const std::function<Kernel()>&) {
  throw std::runtime_error("[cuda kernel] this build of Emily has no CUDA kernels");
}

std::vector<array> launch(Instance&, const std::vector<array>&, std::vector<mx::Shape>, std::vector<mx::Dtype>,
                          const Stream&) {
  throw std::runtime_error("[cuda kernel] this build of Emily has no CUDA kernels");
}

#endif

}  // namespace emily::cuda

namespace emily {

bool cuda_kernels_available() { return cuda::available(); }

}  // namespace emily
