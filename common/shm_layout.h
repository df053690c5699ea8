/* The shared-memory layout between a training process (libposeidon) and its poseidon-agent
 * (DESIGN.md, "Shared memory between framework and agent"). A C header, so that the C shim and
 * the C++ agent read the same definitions. Fields shared across the processes are accessed only
 * with __atomic builtins; every value one side reads from memory the other side writes is
 * validated before use.
 *
 * Two segments per worker rank, both created by the agent with mode 0600:
 *   control  /dev/shm/<name>        header, layer table, two event rings (fixed size)
 *   data     /dev/shm/<name>.data   the layers' gradient / factor buffers, created at
 *                                   registration once the sizes are known
 * Thread-safety: the rings are single-producer single-consumer; see each field's owner. */
#ifndef POSEIDON_COMMON_SHM_LAYOUT_H_
#define POSEIDON_COMMON_SHM_LAYOUT_H_

#include <stdint.h>

#define PSD_SHM_MAGIC 0x314D485344535050ull /* "PPSDSHM1" */
#define PSD_SHM_ABI_VERSION 7u
#define PSD_SHM_MAX_LAYERS 4096u
#define PSD_SHM_NAME_BYTES 64u
#define PSD_SHM_MAX_DIMS 4u
#define PSD_SHM_RING_CAPACITY 4096u /* power of two */
#define PSD_SHM_ERROR_BYTES 256u
#define PSD_SHM_ALIGN 64u

/* Event types. framework -> agent: */
#define PSD_EVENT_REGISTER 1u    /* the layer table is filled: plan it and create buffers */
#define PSD_EVENT_LAYER_READY 2u /* layer's gradient (or factors) for `iteration` is written */
#define PSD_EVENT_DETACH 3u      /* the framework is leaving cleanly */
#define PSD_EVENT_CUDA_ATTACH 4u /* the CUDA fields are filled: open the arena and the events */
/* agent -> framework: */
#define PSD_EVENT_LAYER_FAILED 16u /* layer/iteration failed; status + message in the layer */

/* psd_shm_event.aux of PSD_EVENT_LAYER_READY: where the layer's input is (bits 0-7), and the
 * scheme the framework wrote it for (bits 8-15: the layer's schedule at that iteration; the
 * agent refuses an input of the wrong form). */
#define PSD_READY_HOST 0u   /* in the data segment */
#define PSD_READY_DEVICE 1u /* in the CUDA arena, complete once the layer's ready event fires */
#define PSD_READY_AUX(location, scheme) ((uint64_t)(location) | ((uint64_t)(scheme) << 8))
/* header.cuda_state */
#define PSD_CUDA_OFF 0u
#define PSD_CUDA_REQUESTED 1u
#define PSD_CUDA_READY 2u
#define PSD_CUDA_FAILED 3u
/* Size of cudaIpcMemHandle_t and cudaIpcEventHandle_t (CUDA runtime ABI). */
#define PSD_CUDA_IPC_HANDLE_BYTES 64u
/* Layer kinds and element types (the same numbers as poseidon.v1 LayerKind / ElementType). */
#define PSD_KIND_FC 1u
#define PSD_KIND_CONV 2u
#define PSD_KIND_BIAS 3u
#define PSD_KIND_OTHER 4u
#define PSD_DTYPE_F32 1u

/* Schemes (poseidon.v1 SyncScheme). */
#define PSD_SCHEME_PS 1u
#define PSD_SCHEME_SFB 2u
#define PSD_SCHEME_ALLREDUCE 3u

/* A layer's scheme by iteration (psd_shm_layer.schedule, written by the agent when a plan
 * changes, read atomically by the framework): `before` for iterations < switch_at, `after`
 * from switch_at on. The agent changes the word only for iterations later than the next one the
 * framework will post, so the scheme of an iteration, once read, never changes. */
#define PSD_SCHEDULE_PACK(before, after, switch_at) \
  ((uint64_t)(before) | ((uint64_t)(after) << 8) | ((uint64_t)(switch_at) << 16))
#define PSD_SCHEDULE_SCHEME(word, iteration) \
  ((uint32_t)((uint64_t)(iteration) >= ((word) >> 16) ? (((word) >> 8) & 0xffu) : ((word) & 0xffu)))
/* psd_shm_layer.agent_flags */
#define PSD_LAYER_SFB_BUFFERS 1u /* u_offset / v_offset are laid out (the layer may run SFB) */

/* header.agent_state */
#define PSD_AGENT_STARTING 0u
#define PSD_AGENT_WAITING 1u /* segment ready, waiting for a framework to attach and register */
#define PSD_AGENT_SERVING 2u /* registered: layers are being synchronised */
#define PSD_AGENT_FAILED 3u  /* a fatal error; header.error says why */
#define PSD_AGENT_EXITED 4u

/* header.registration_state */
#define PSD_REG_NONE 0u
#define PSD_REG_REQUESTED 1u
#define PSD_REG_DONE 2u
#define PSD_REG_FAILED 3u

typedef struct psd_shm_event {
  uint32_t type;
  uint32_t layer;
  uint64_t iteration;
  int32_t status;
  uint32_t reserved;
  uint64_t aux;
} psd_shm_event; /* 32 bytes */

/* Single-producer single-consumer ring. The producer writes events[tail % capacity], then
 * stores tail + 1 (release) and increments `doorbell`, waking the consumer with FUTEX_WAKE when
 * `consumer_sleeping` is set. The consumer reads while head < tail (acquire), stores head + 1.
 * A consumer must treat tail - head > capacity as corruption. */
typedef struct psd_shm_ring {
  uint64_t head; /* consumer */
  uint8_t pad0[PSD_SHM_ALIGN - 8];
  uint64_t tail; /* producer */
  uint8_t pad1[PSD_SHM_ALIGN - 8];
  uint32_t doorbell; /* futex word */
  uint32_t consumer_sleeping;
  uint8_t pad2[PSD_SHM_ALIGN - 8];
  psd_shm_event events[PSD_SHM_RING_CAPACITY];
} psd_shm_ring;

typedef struct psd_shm_layer {
  /* Written by the framework before PSD_EVENT_REGISTER; read (and validated) by the agent. */
  char name[PSD_SHM_NAME_BYTES]; /* NUL-terminated */
  uint32_t kind;
  uint32_t dtype;
  uint32_t ndim;
  uint32_t batch_k; /* FC: K, the per-worker batch (rows of the factors) */
  uint32_t flags;   /* PSD_LAYER_FUSABLE, _AVERAGE, _COUNTERS (poseidon.h) */
  uint32_t reserved0;
  uint64_t shape[PSD_SHM_MAX_DIMS];
  /* Written by the agent at registration. Offsets are into the data segment. */
  uint32_t scheme; /* the first plan's (see schedule for later iterations) */
  uint32_t priority;
  uint64_t elements;
  uint64_t grad_offset; /* elements * 4 bytes: the gradient in, the synchronised result out */
  uint64_t u_offset;    /* PSD_LAYER_SFB_BUFFERS: K x M factor U (0 bytes otherwise) */
  uint64_t v_offset;    /* PSD_LAYER_SFB_BUFFERS: K x N factor V */
  uint32_t agent_flags; /* PSD_LAYER_SFB_BUFFERS */
  uint32_t reserved1;
  uint64_t schedule; /* PSD_SCHEDULE_PACK; updated by the agent when a plan changes (atomic) */
  /* Progress. ready_iteration: framework; done_*: agent. done_futex is bumped (and woken) by the
   * agent after every completion or failure of this layer. */
  uint64_t ready_iteration;
  uint64_t done_iteration;
  int32_t done_status; /* 0 ok, else a psd_status of the last failure */
  uint32_t done_futex;
  char message[128]; /* the last failure, NUL-terminated */
  /* CUDA (see the header's cuda_state): cudaIpcEventHandle_t of the framework's event recorded
   * once the layer's input is in the arena (framework), and of the agent's event recorded once
   * the result has been copied back into the arena (agent). */
  uint8_t cuda_ready_event[PSD_CUDA_IPC_HANDLE_BYTES];
  uint8_t cuda_done_event[PSD_CUDA_IPC_HANDLE_BYTES];
} psd_shm_layer;

typedef struct psd_shm_header {
  uint64_t magic;
  uint32_t abi_version;
  uint32_t header_bytes;
  uint64_t control_bytes;
  /* Agent side. */
  uint32_t agent_pid;
  uint32_t agent_state;
  uint64_t agent_heartbeat_ns; /* CLOCK_MONOTONIC, refreshed every 100 ms */
  uint32_t rank;
  uint32_t world_size;
  uint64_t job_id;
  char error[PSD_SHM_ERROR_BYTES];
  /* Framework side: claim with a compare-exchange of attached 0 -> 1 (a second attach fails). */
  uint32_t attached;
  uint32_t framework_pid;
  uint64_t framework_heartbeat_ns;
  /* Registration. The framework fills num_layers and the layer table, sets registration_state
   * to REQUESTED and posts PSD_EVENT_REGISTER; the agent answers DONE or FAILED (error says why)
   * and bumps registration_futex. */
  uint32_t num_layers;
  uint32_t registration_state;
  int32_t registration_status;
  uint32_t registration_futex;
  char data_name[PSD_SHM_NAME_BYTES]; /* the data segment, set by the agent */
  uint64_t data_bytes;
  /* Offsets from the start of the control segment. */
  uint64_t to_agent_offset;
  uint64_t to_framework_offset;
  uint64_t layers_offset;
  /* Server-side update rule (written by the framework before registration; 0: sum, the
   * framework's own optimizer steps). poseidon.v1 UpdateRule numbers: 2 sgd, 3 momentum, 4 adam.
   * With a server rule every layer goes by PS, iteration 1 carries rank 0's initial parameters
   * and the synchronised result of every later iteration is the updated parameters. */
  uint32_t server_rule;
  uint32_t server_nesterov;
  double server_lr, server_momentum, server_dampening, server_beta1, server_beta2, server_eps,
      server_weight_decay;
  /* CUDA, after registration. The framework allocates the arena (data_bytes of device memory
   * laid out exactly like the data segment), fills cuda_device, cuda_arena_bytes, the arena's
   * cudaIpcMemHandle_t and every layer's cuda_ready_event, sets cuda_state REQUESTED and posts
   * PSD_EVENT_CUDA_ATTACH. The agent opens them, fills the layers' cuda_done_event and answers
   * READY or FAILED (error says why), bumping registration_futex. */
  uint32_t cuda_state;
  int32_t cuda_device;
  uint64_t cuda_arena_bytes;
  uint8_t cuda_arena_handle[PSD_CUDA_IPC_HANDLE_BYTES];
  /* Written by the agent before it answers the registration: the job's iteration that the
   * framework's iteration 1 is when its rank rejoins a running job (poseidon-agent --rejoin);
   * 1 otherwise (a resumed job's ranks read theirs from $POSEIDON_RESUMED_ITERATION). */
  uint64_t start_iteration;
  /* Written by the agent whenever the world shrinks (poseidon-agent --min_workers: a dead rank
   * removed and the job going on without it), one atomic word: this rank's index among the
   * ranks left, their number and how many times the world changed (PSD_LIVE_WORLD_*). 0: never
   * changed (rank and world_size above hold). */
  uint64_t live_world;
  /* Written by the agent: how many ranks took up the running job after the others trained
   * without them (the coordinator's count, HeartbeatResponse.takeovers; it only grows), and its
   * --rejoin_timeout in milliseconds (0: a dead rank is never waited for, so none takes up the
   * job). A job with a local optimizer hands its state to such a rank (poseidon.torch). */
  uint64_t takeovers;
  uint32_t rejoin_timeout_ms;
  uint32_t reserved0;
} psd_shm_header;

#define PSD_LIVE_WORLD_PACK(rank, size, generation)                         \
  (((uint64_t)(rank) & 0xfffffu) | (((uint64_t)(size) & 0xfffffu) << 20) | \
   ((uint64_t)(generation) << 40))
#define PSD_LIVE_WORLD_RANK(word) ((uint32_t)((word) & 0xfffffu))
#define PSD_LIVE_WORLD_SIZE(word) ((uint32_t)(((word) >> 20) & 0xfffffu))
#define PSD_LIVE_WORLD_GENERATION(word) ((word) >> 40)

/* The control segment: header, then (aligned) the two rings and the layer table. */
#define PSD_SHM_ALIGN_UP(x) (((x) + PSD_SHM_ALIGN - 1) / PSD_SHM_ALIGN * PSD_SHM_ALIGN)
#define PSD_SHM_TO_AGENT_OFFSET PSD_SHM_ALIGN_UP(sizeof(psd_shm_header))
#define PSD_SHM_TO_FRAMEWORK_OFFSET \
  (PSD_SHM_TO_AGENT_OFFSET + PSD_SHM_ALIGN_UP(sizeof(psd_shm_ring)))
#define PSD_SHM_LAYERS_OFFSET \
  (PSD_SHM_TO_FRAMEWORK_OFFSET + PSD_SHM_ALIGN_UP(sizeof(psd_shm_ring)))
#define PSD_SHM_CONTROL_BYTES \
  (PSD_SHM_LAYERS_OFFSET + PSD_SHM_ALIGN_UP(sizeof(psd_shm_layer) * PSD_SHM_MAX_LAYERS))

#endif /* POSEIDON_COMMON_SHM_LAYOUT_H_ */
