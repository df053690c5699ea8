#include "agent/cuda_stager.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstring>
#include <map>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace poseidon::agent {
namespace {

absl::Status CudaError(cudaError_t e, const std::string& what) {
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorName(e), " (",
                                          cudaGetErrorString(e), ")"));
}

#define PSD_CUDA_RETURN(call, what)                          \
  do {                                                       \
    const cudaError_t psd_e_ = (call);                       \
    if (psd_e_ != cudaSuccess) return CudaError(psd_e_, what); \
  } while (0)

const char* CublasName(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "cuBLAS error";
  }
}

// A host callback carrying a closure (cudaLaunchHostFunc takes a plain function).
struct HostCall {
  std::function<void()> fn;
  static void Run(void* p) {
    std::unique_ptr<HostCall> self(static_cast<HostCall*>(p));
    self->fn();
  }
};

absl::Status LaunchHost(cudaStream_t stream, std::function<void()> fn) {
  auto* call = new HostCall{std::move(fn)};
  const cudaError_t e = cudaLaunchHostFunc(stream, &HostCall::Run, call);
  if (e != cudaSuccess) {
    delete call;
    return CudaError(e, "cudaLaunchHostFunc");
  }
  return absl::OkStatus();
}

class CudaStager final : public DeviceStager {
 public:
  CudaStager(int device, unsigned char* arena, uint64_t bytes, bool ipc_arena,
             std::vector<cudaEvent_t> ready, bool ipc_events, unsigned char* host)
      : device_(device),
        arena_(arena),
        bytes_(bytes),
        ipc_arena_(ipc_arena),
        ready_(std::move(ready)),
        ipc_events_(ipc_events),
        host_(host) {}

  ~CudaStager() override {
    cudaSetDevice(device_);
    if (out_) cudaStreamSynchronize(out_);
    if (in_) cudaStreamSynchronize(in_);
    if (notify_) cudaStreamSynchronize(notify_);
    for (cudaEvent_t e : notes_) {
      if (e) cudaEventDestroy(e);
    }
    if (notify_) cudaStreamDestroy(notify_);
    if (blas_) cublasDestroy(blas_);
    for (auto& [layer, g] : gather_) cudaFree(g.ptr);
    for (cudaEvent_t e : done_) cudaEventDestroy(e);
    if (ipc_events_) {
      for (cudaEvent_t e : ready_) cudaEventDestroy(e);
    }
    if (out_) cudaStreamDestroy(out_);
    if (in_) cudaStreamDestroy(in_);
    for (void* p : pinned_) cudaHostUnregister(p);
    if (ipc_arena_ && arena_) cudaIpcCloseMemHandle(arena_);
  }

  absl::Status Init() {
    PSD_CUDA_RETURN(cudaSetDevice(device_), absl::StrCat("cudaSetDevice(", device_, ")"));
    PSD_CUDA_RETURN(cudaStreamCreateWithFlags(&out_, cudaStreamNonBlocking), "device->host stream");
    PSD_CUDA_RETURN(cudaStreamCreateWithFlags(&in_, cudaStreamNonBlocking), "host->device stream");
    PSD_CUDA_RETURN(cudaStreamCreateWithFlags(&notify_, cudaStreamNonBlocking), "callback stream");
    notes_.resize(kNotes);
    for (auto& e : notes_) {
      PSD_CUDA_RETURN(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "callback event");
    }
    done_.resize(ready_.size());
    for (size_t i = 0; i < done_.size(); ++i) {
      PSD_CUDA_RETURN(
          cudaEventCreateWithFlags(&done_[i], cudaEventDisableTiming | cudaEventInterprocess),
          absl::StrCat("done event of layer ", i));
    }
    if (const cublasStatus_t s = cublasCreate(&blas_); s != CUBLAS_STATUS_SUCCESS) {
      blas_ = nullptr;
      return absl::InternalError(absl::StrCat("cublasCreate: ", CublasName(s)));
    }
    cublasSetStream(blas_, in_);
    // Plain FP32 (no TF32): the rebuild must match a float64 reference to 1e-5.
    cublasSetMathMode(blas_, CUBLAS_DEFAULT_MATH);
    return absl::OkStatus();
  }

  std::vector<IpcHandle> DoneEvents() const override {
    std::vector<IpcHandle> out(done_.size());
    cudaSetDevice(device_);
    for (size_t i = 0; i < done_.size(); ++i) {
      cudaIpcEventHandle_t h;
      if (cudaIpcGetEventHandle(&h, done_[i]) == cudaSuccess) std::memcpy(out[i].data(), &h, 64);
    }
    return out;
  }

  cudaEvent_t done(uint32_t layer) const { return done_.at(layer); }

  absl::Status PinHost(void* host, uint64_t bytes) override {
    if (bytes == 0) return absl::OkStatus();
    std::lock_guard<std::mutex> lock(mu_);
    for (void* p : pinned_) {
      if (p == host) return absl::OkStatus();
    }
    PSD_CUDA_RETURN(cudaSetDevice(device_), "cudaSetDevice");
    PSD_CUDA_RETURN(cudaHostRegister(host, bytes, cudaHostRegisterPortable),
                    absl::StrCat("pinning ", bytes, " bytes of host memory"));
    pinned_.push_back(host);
    return absl::OkStatus();
  }

  absl::Status StageOut(uint32_t layer, std::span<const DeviceRange> ranges,
                        std::function<void(size_t)> on_copied) override {
    RETURN_IF_ERROR(CheckLayer(layer));
    for (const DeviceRange& r : ranges) RETURN_IF_ERROR(CheckRange(r));
    PSD_CUDA_RETURN(cudaSetDevice(device_), "cudaSetDevice");
    std::lock_guard<std::mutex> lock(out_mu_);  // ranges of one layer stay together
    PSD_CUDA_RETURN(cudaStreamWaitEvent(out_, ready_[layer], 0),
                    absl::StrCat("waiting for layer ", layer, "'s ready event"));
    auto shared = std::make_shared<std::function<void(size_t)>>(std::move(on_copied));
    for (size_t i = 0; i < ranges.size(); ++i) {
      const DeviceRange r = ranges[i];
      const absl::Time queued = absl::Now();
      PSD_CUDA_RETURN(cudaMemcpyAsync(host_ + r.offset, arena_ + r.offset, r.bytes,
                                      cudaMemcpyDeviceToHost, out_),
                      absl::StrCat("device->host copy of layer ", layer));
      RETURN_IF_ERROR(Notify(out_, [this, shared, i, layer, queued, bytes = r.bytes] {
        if (observer_) observer_("d2h", layer, queued, absl::Now(), bytes);
        (*shared)(i);
      }));
    }
    return absl::OkStatus();
  }

  absl::Status StageIn(uint32_t layer, DeviceRange r) override {
    RETURN_IF_ERROR(CheckLayer(layer));
    RETURN_IF_ERROR(CheckRange(r));
    PSD_CUDA_RETURN(cudaSetDevice(device_), "cudaSetDevice");
    const absl::Time queued = absl::Now();
    PSD_CUDA_RETURN(cudaMemcpyAsync(arena_ + r.offset, host_ + r.offset, r.bytes,
                                    cudaMemcpyHostToDevice, in_),
                    absl::StrCat("host->device copy of layer ", layer));
    if (observer_) {
      RETURN_IF_ERROR(Notify(in_, [this, layer, queued, bytes = r.bytes] {
        observer_("h2d", layer, queued, absl::Now(), bytes);
      }));
    }
    return absl::OkStatus();
  }

  absl::Status MarkDone(uint32_t layer) override {
    RETURN_IF_ERROR(CheckLayer(layer));
    PSD_CUDA_RETURN(cudaSetDevice(device_), "cudaSetDevice");
    PSD_CUDA_RETURN(cudaEventRecord(done_[layer], in_),
                    absl::StrCat("recording layer ", layer, "'s done event"));
    return absl::OkStatus();
  }

  absl::Status StagePeerFactors(uint32_t layer, const SfbShape& s, uint64_t iteration,
                                uint32_t peer, const float* factors) override {
    RETURN_IF_ERROR(CheckSfb(layer, s));
    if (peer >= s.world || peer == s.me) {
      return absl::InvalidArgumentError(absl::StrCat("peer ", peer, " of ", s.world));
    }
    PSD_CUDA_RETURN(cudaSetDevice(device_), "cudaSetDevice");
    std::lock_guard<std::mutex> lock(mu_);
    ASSIGN_OR_RETURN(Gather * g, GatherFor(layer, s, iteration));
    return CopyPeer(*g, s, iteration, peer, factors);
  }

  absl::Status Rebuild(uint32_t layer, const SfbShape& s, uint64_t iteration,
                       const float* peers) override {
    RETURN_IF_ERROR(CheckSfb(layer, s));
    PSD_CUDA_RETURN(cudaSetDevice(device_), "cudaSetDevice");
    std::lock_guard<std::mutex> lock(mu_);  // the cuBLAS handle and the gather buffers
    const absl::Time queued = absl::Now();
    ASSIGN_OR_RETURN(Gather * g, GatherFor(layer, s, iteration));
    const uint64_t ku = s.k * s.m, kv = s.k * s.n, floats = ku + kv;
    float* all_u = g->ptr;                // world * K x M: [U_0; U_1; ...]
    float* all_v = g->ptr + s.world * ku;  // world * K x N
    uint32_t missing = 0;
    for (uint32_t p = 0; p < s.world; ++p) missing += p != s.me && g->staged[p] != iteration;
    if (missing == s.world - 1 && s.world > 2) {
      // Nothing staged yet: every rank's U, then every rank's V, in one strided copy each (our
      // own slot on the host is stale and is overwritten from the arena below).
      PSD_CUDA_RETURN(cudaMemcpy2DAsync(all_u, ku * 4, peers, floats * 4, ku * 4, s.world,
                                        cudaMemcpyHostToDevice, in_),
                      "gathering the peers' U factors");
      PSD_CUDA_RETURN(cudaMemcpy2DAsync(all_v, kv * 4, peers + ku, floats * 4, kv * 4, s.world,
                                        cudaMemcpyHostToDevice, in_),
                      "gathering the peers' V factors");
      for (uint32_t p = 0; p < s.world; ++p) g->staged[p] = iteration;
    } else {
      for (uint32_t p = 0; p < s.world; ++p) {
        if (p != s.me && g->staged[p] != iteration) {
          RETURN_IF_ERROR(CopyPeer(*g, s, iteration, p, peers + p * floats));
        }
      }
    }
    PSD_CUDA_RETURN(cudaMemcpyAsync(all_u + s.me * ku, arena_ + s.u_offset, ku * 4,
                                    cudaMemcpyDeviceToDevice, in_),
                    "our U factor");
    PSD_CUDA_RETURN(cudaMemcpyAsync(all_v + s.me * kv, arena_ + s.v_offset, kv * 4,
                                    cudaMemcpyDeviceToDevice, in_),
                    "our V factor");
    // Row-major G (M x N) = U^T V is column-major G^T (N x M) = V^T U: with the column-major
    // views all_v = V^T (N x PK, ld N) and all_u = U^T (M x PK, ld M): C = A * B^T.
    const float zero = 0.0f;
    const int n = static_cast<int>(s.n), m = static_cast<int>(s.m),
              pk = static_cast<int>(s.k * s.world);
    const cublasStatus_t st =
        cublasSgemm(blas_, CUBLAS_OP_N, CUBLAS_OP_T, n, m, pk, &s.scale, all_v, n, all_u, m, &zero,
                    reinterpret_cast<float*>(arena_ + s.grad_offset), n);
    if (st != CUBLAS_STATUS_SUCCESS) {
      return absl::InternalError(
          absl::StrCat("cublasSgemm rebuilding layer ", layer, ": ", CublasName(st)));
    }
    if (observer_) {
      RETURN_IF_ERROR(Notify(in_, [this, layer, queued, bytes = s.world * floats * 4] {
        observer_("gpu rebuild", layer, queued, absl::Now(), bytes);
      }));
    }
    return absl::OkStatus();
  }

  void SetObserver(DeviceObserver observer) override { observer_ = std::move(observer); }

 private:
  // Every rank's factors of one layer on the GPU, one buffer per iteration parity.
  // Runs `fn` on a CUDA runtime thread once everything queued so far on `after` has finished.
  // A host function launched on a copy stream would hold that stream until it returns; this
  // one runs on a side stream that waits for an event, so the copies go back to back.
  // Events are reused round robin: a wait captures the event's record at the time it is queued.
  absl::Status Notify(cudaStream_t after, std::function<void()> fn) {
    std::lock_guard<std::mutex> lock(notify_mu_);
    cudaEvent_t e = notes_[next_note_++ % notes_.size()];
    PSD_CUDA_RETURN(cudaEventRecord(e, after), "callback event");
    PSD_CUDA_RETURN(cudaStreamWaitEvent(notify_, e, 0), "callback stream wait");
    return LaunchHost(notify_, std::move(fn));
  }

  struct Gather {
    float* ptr = nullptr;
    uint64_t bytes = 0;
    std::vector<uint64_t> staged;  // per rank: the iteration whose factors are (being) copied
  };

  absl::Status CheckSfb(uint32_t layer, const SfbShape& s) const {
    RETURN_IF_ERROR(CheckLayer(layer));
    if (s.world == 0 || s.me >= s.world || s.m == 0 || s.n == 0 || s.k == 0) {
      return absl::InvalidArgumentError("bad SFB shape");
    }
    if (s.m * s.n > (uint64_t{1} << 31) || s.k * s.world > (uint64_t{1} << 31) ||
        s.k * (s.m + s.n) > (uint64_t{1} << 40)) {
      return absl::InvalidArgumentError("SFB layer too large for one GEMM");
    }
    RETURN_IF_ERROR(CheckRange({s.grad_offset, s.m * s.n * 4}));
    RETURN_IF_ERROR(CheckRange({s.u_offset, s.k * s.m * 4}));
    RETURN_IF_ERROR(CheckRange({s.v_offset, s.k * s.n * 4}));
    return absl::OkStatus();
  }

  // mu_ held.
  absl::StatusOr<Gather*> GatherFor(uint32_t layer, const SfbShape& s, uint64_t iteration) {
    Gather& g = gather_[{layer, static_cast<int>(iteration % 2)}];
    const uint64_t need = s.world * s.k * (s.m + s.n) * sizeof(float);
    if (g.bytes < need) {
      if (g.ptr) cudaFree(g.ptr);
      g.ptr = nullptr;
      g.bytes = 0;
      PSD_CUDA_RETURN(cudaMalloc(reinterpret_cast<void**>(&g.ptr), need),
                      absl::StrCat("gather buffer of ", need, " bytes for layer ", layer));
      g.bytes = need;
      g.staged.assign(s.world, 0);
    }
    if (g.staged.size() != s.world) g.staged.assign(s.world, 0);
    return &g;
  }

  // mu_ held. Queued on the in-stream, so a later GEMM of the same parity runs after it.
  absl::Status CopyPeer(Gather& g, const SfbShape& s, uint64_t iteration, uint32_t peer,
                        const float* factors) {
    const uint64_t ku = s.k * s.m, kv = s.k * s.n;
    PSD_CUDA_RETURN(cudaMemcpyAsync(g.ptr + peer * ku, factors, ku * 4, cudaMemcpyHostToDevice,
                                    in_),
                    absl::StrCat("copying rank ", peer, "'s U factor"));
    PSD_CUDA_RETURN(cudaMemcpyAsync(g.ptr + s.world * ku + peer * kv, factors + ku, kv * 4,
                                    cudaMemcpyHostToDevice, in_),
                    absl::StrCat("copying rank ", peer, "'s V factor"));
    g.staged[peer] = iteration;
    return absl::OkStatus();
  }

  absl::Status CheckLayer(uint32_t layer) const {
    if (layer >= ready_.size()) {
      return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " of ", ready_.size()));
    }
    return absl::OkStatus();
  }
  absl::Status CheckRange(DeviceRange r) const {
    if (r.offset > bytes_ || r.bytes > bytes_ - r.offset) {
      return absl::OutOfRangeError(absl::StrCat("range [", r.offset, ", +", r.bytes,
                                                ") outside the ", bytes_, "-byte arena"));
    }
    return absl::OkStatus();
  }

  const int device_;
  unsigned char* const arena_;
  const uint64_t bytes_;
  const bool ipc_arena_;
  const std::vector<cudaEvent_t> ready_;
  const bool ipc_events_;
  unsigned char* const host_;
  cudaStream_t out_ = nullptr, in_ = nullptr, notify_ = nullptr;
  static constexpr size_t kNotes = 64;
  std::vector<cudaEvent_t> notes_;
  std::mutex notify_mu_;
  uint64_t next_note_ = 0;
  std::vector<cudaEvent_t> done_;
  cublasHandle_t blas_ = nullptr;
  std::mutex mu_, out_mu_;
  std::vector<void*> pinned_;
  std::map<std::pair<uint32_t, int>, Gather> gather_;  // by (layer, iteration parity)
  DeviceObserver observer_;
};

}  // namespace

absl::Status CudaDeviceAvailableHere() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    return absl::UnavailableError(absl::StrCat("no CUDA device: cudaGetDeviceCount returned ",
                                               static_cast<int>(e), " (", cudaGetErrorName(e),
                                               ")"));
  }
  if (count == 0) return absl::UnavailableError("no CUDA device: 0 devices");
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<DeviceStager>> OpenCudaStager(const DeviceAttach& attach,
                                                             void* host, uint64_t host_bytes) {
  RETURN_IF_ERROR(CudaDeviceAvailableHere());
  if (attach.arena_bytes != host_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("the CUDA arena has ", attach.arena_bytes,
                                                   " bytes; the buffers need ", host_bytes));
  }
  PSD_CUDA_RETURN(cudaSetDevice(attach.device),
                  absl::StrCat("cudaSetDevice(", attach.device, ")"));
  cudaIpcMemHandle_t mh;
  std::memcpy(&mh, attach.arena.data(), sizeof(mh));
  void* arena = nullptr;
  PSD_CUDA_RETURN(cudaIpcOpenMemHandle(&arena, mh, cudaIpcMemLazyEnablePeerAccess),
                  "opening the framework's CUDA arena");
  std::vector<cudaEvent_t> ready(attach.ready_events.size(), nullptr);
  for (size_t i = 0; i < ready.size(); ++i) {
    cudaIpcEventHandle_t eh;
    std::memcpy(&eh, attach.ready_events[i].data(), sizeof(eh));
    if (const cudaError_t e = cudaIpcOpenEventHandle(&ready[i], eh); e != cudaSuccess) {
      for (size_t j = 0; j < i; ++j) cudaEventDestroy(ready[j]);
      cudaIpcCloseMemHandle(arena);
      return CudaError(e, absl::StrCat("opening the ready event of layer ", i));
    }
  }
  auto stager = std::make_unique<CudaStager>(attach.device, static_cast<unsigned char*>(arena),
                                             attach.arena_bytes, true, std::move(ready), true,
                                             static_cast<unsigned char*>(host));
  RETURN_IF_ERROR(stager->Init());
  RETURN_IF_ERROR(stager->PinHost(host, host_bytes));
  return std::unique_ptr<DeviceStager>(std::move(stager));
}

absl::StatusOr<std::unique_ptr<DeviceStager>> CreateLocalDeviceStager(
    int device, void* arena, uint64_t arena_bytes, void* host, uint64_t host_bytes,
    std::vector<cudaEvent_t> ready_events) {
  RETURN_IF_ERROR(CudaDeviceAvailableHere());
  if (arena_bytes != host_bytes) return absl::InvalidArgumentError("arena and host sizes differ");
  auto stager = std::make_unique<CudaStager>(device, static_cast<unsigned char*>(arena),
                                             arena_bytes, false, std::move(ready_events), false,
                                             static_cast<unsigned char*>(host));
  RETURN_IF_ERROR(stager->Init());
  RETURN_IF_ERROR(stager->PinHost(host, host_bytes));
  return std::unique_ptr<DeviceStager>(std::move(stager));
}

cudaEvent_t LocalDoneEvent(DeviceStager& stager, uint32_t layer) {
  return static_cast<CudaStager&>(stager).done(layer);
}

}  // namespace poseidon::agent

// The plugin's entry points (device_stager.cc loads them with dlopen / dlsym).
extern "C" __attribute__((visibility("default"))) void psd_cuda_stager_available(
    absl::Status* status) {
  *status = poseidon::agent::CudaDeviceAvailableHere();
}

extern "C" __attribute__((visibility("default"))) poseidon::agent::DeviceStager*
psd_cuda_stager_open(const poseidon::agent::DeviceAttach* attach, void* host, uint64_t host_bytes,
                     absl::Status* status) {
  auto stager = poseidon::agent::OpenCudaStager(*attach, host, host_bytes);
  *status = stager.status();
  return stager.ok() ? stager->release() : nullptr;
}
