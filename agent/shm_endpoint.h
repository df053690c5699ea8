// The agent's side of the shared-memory channel (common/shm_layout.h): it creates the control
// segment (mode 0600), consumes the framework's event ring, publishes the plan's layout and the
// data segment at registration, and signals layer completion. Everything read from the segment
// is validated: a bad layer id, size, state or ring index is an error for that event, never a
// crash of the agent.
// Thread-safety: NextEvent/registration from the agent's main thread only; LayerDone/
// LayerFailed/Grad/Factors from any thread (each layer's progress words are written by one
// sync task at a time).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "agent/device_stager.h"
#include "common/shm_layout.h"

namespace poseidon::agent {

struct LayerDesc {
  std::string name;
  uint32_t kind = 0;
  std::vector<uint64_t> shape;
  uint32_t batch_k = 0;
  uint64_t elements = 0;
  bool fusable = false;  // the framework allows fusing it with neighbours (PSD_LAYER_FUSABLE)
  bool average = false;  // the result is the mean over the ranks summed (PSD_LAYER_AVERAGE)
  bool counters = false;  // SGD with learning rate 1 under a server-side rule (PSD_LAYER_COUNTERS)
  bool own_clock = false;  // iterations of its own, not the job's (PSD_LAYER_OWN_CLOCK)
  bool by_servers = false;  // PS whatever the plan says (PSD_LAYER_BY_SERVERS)
};

struct LayerLayout {
  uint32_t scheme = PSD_SCHEME_PS;
  uint32_t priority = 0;
  uint64_t grad_offset = 0;
  uint64_t u_offset = 0;
  uint64_t v_offset = 0;
  bool sfb_buffers = false;  // u_offset / v_offset are laid out
};

struct Event {
  uint32_t type = 0;
  uint32_t layer = 0;
  uint64_t iteration = 0;
  // LAYER_READY (validated): PSD_READY_HOST or PSD_READY_DEVICE, and the scheme the input was
  // written for (0: not said, an older framework library).
  uint64_t location = 0;
  uint64_t scheme = 0;
};

class ShmEndpoint {
 public:
  static absl::StatusOr<std::unique_ptr<ShmEndpoint>> Create(const std::string& name, uint32_t rank,
                                                             uint32_t world_size, uint64_t job_id);
  ~ShmEndpoint();  // marks the agent EXITED and unlinks both segments

  const std::string& name() const { return name_; }
  void Heartbeat();
  void SetState(uint32_t state, const std::string& error = "");

  // The next event from the framework within `timeout` (nullopt: none). A malformed event is an
  // error (the caller logs it and goes on); ring corruption resynchronises the ring.
  absl::StatusOr<std::optional<Event>> NextEvent(absl::Duration timeout);

  // Whether a framework is attached, and an error if it attached and its process has ended
  // (gone, or a zombie its parent has not reaped). The process is the pid the segment named
  // first after the attach; a pid that names no process is an error of its own.
  bool attached() const;
  absl::Status CheckFramework();

  // The server-side update rule the framework asked for (rule 0: sum), validated.
  struct ServerRule {
    uint32_t rule = 0;
    bool nesterov = false;
    double lr = 0, momentum = 0, dampening = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
  };
  absl::StatusOr<ServerRule> ReadServerRule() const;

  // Registration: the layer table as the framework wrote it (validated).
  absl::StatusOr<std::vector<LayerDesc>> ReadLayers() const;
  // Creates the data segment and publishes each layer's layout and the job's iteration the
  // framework's iteration 1 is (psd_start_iteration), then answers the framework.
  absl::Status PublishLayout(const std::vector<LayerDesc>& layers,
                             const std::vector<LayerLayout>& layout, uint64_t data_bytes,
                             uint64_t start_iteration = 1);
  void FailRegistration(const std::string& why);

  // CUDA (after registration): what the framework exported, validated (state REQUESTED, the
  // arena's size equal to the data segment's, a device id >= 0); then the answer.
  absl::StatusOr<DeviceAttach> ReadCudaAttach() const;
  void AnswerCuda(const std::vector<IpcHandle>& done_events);
  void FailCuda(const std::string& why);
  unsigned char* data() const { return data_; }
  uint64_t data_bytes() const { return data_bytes_; }

  float* Grad(uint32_t layer) const;
  float* FactorU(uint32_t layer) const;
  float* FactorV(uint32_t layer) const;

  // A layer's scheme by iteration (PSD_SCHEDULE_PACK), for the framework.
  void PublishSchedule(uint32_t layer, uint64_t word);

  // The world shrank: this rank's index among the ranks left, their number and the count of
  // changes so far (psd_world), in one atomic word. Any thread.
  void SetLiveWorld(uint32_t rank, uint32_t size, uint64_t generation);

  // How many ranks took up the running job so far (psd_takeovers; it only grows) and this
  // agent's --rejoin_timeout. Any thread.
  void SetTakeovers(uint64_t takeovers);
  void SetRejoinTimeout(uint32_t ms);

  void LayerDone(uint32_t layer, uint64_t iteration);
  void LayerFailed(uint32_t layer, uint64_t iteration, const std::string& why);

 private:
  ShmEndpoint() = default;
  psd_shm_header* header() const { return reinterpret_cast<psd_shm_header*>(control_); }
  psd_shm_ring* to_agent() const {
    return reinterpret_cast<psd_shm_ring*>(control_ + PSD_SHM_TO_AGENT_OFFSET);
  }
  psd_shm_layer* layers() const {
    return reinterpret_cast<psd_shm_layer*>(control_ + PSD_SHM_LAYERS_OFFSET);
  }

  std::string name_, data_name_;
  unsigned char* control_ = nullptr;
  unsigned char* data_ = nullptr;
  uint64_t data_bytes_ = 0;
  std::vector<LayerLayout> layout_;
  pid_t framework_pid_ = 0;   // the attached training process, once it wrote its pid
  int framework_pidfd_ = -1;  // its pidfd (-1 where pidfd_open failed)
};

}  // namespace poseidon::agent
