/* libposeidon: the C ABI a training framework uses to hand its layers to the local
 * poseidon-agent (DESIGN.md, "Processes" and "One iteration"). In the manner of NCCL's nccl.h:
 * opaque handles, a psd_status result on every call with psd_last_error() for the message, a
 * versioned config struct that starts with its size, and only the psd_* symbols exported.
 * Depends on libc and pthread only.
 *
 * Thread-safety, per call:
 *   psd_attach, psd_detach, psd_register_layers: one thread, not concurrently with other calls
 *     on the same context.
 *   psd_layer_ready, psd_wait_layer, psd_get_layer_info, psd_layer_scheme, psd_rank: any
 *     thread, concurrently.
 *   psd_last_error: per thread (the message of this thread's last failed call).
 *
 * One iteration (WFBP): during backward, write each layer's gradient (or, for a layer the plan
 * syncs by SFB at that iteration, its factors U and V) into the buffers psd_get_layer_info
 * returns and call psd_layer_ready(layer, t) at once; backward continues while the agent
 * synchronises. Before layer l runs in the next forward pass, psd_wait_layer(l, t) returns when
 * its synchronised result (the gradient summed over all workers) is in the gradient buffer.
 *
 * Plans change while training runs (the coordinator's new plan epochs): a layer's scheme is per
 * iteration. Ask psd_layer_scheme(l, t) once layer l's iteration t - 1 has been posted (e.g. in
 * the forward pass of t) and write that form; the answer for t never changes afterwards, and
 * every worker gets the same one. */
#ifndef POSEIDON_POSEIDON_H_
#define POSEIDON_POSEIDON_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define PSD_ABI_VERSION 3u

typedef enum psd_status {
  PSD_OK = 0,
  PSD_INVALID_ARGUMENT = 1,    /* a bad layer id, size, iteration or pointer */
  PSD_TIMEOUT = 2,             /* the wait's timeout passed; the agent is alive */
  PSD_AGENT_LOST = 3,          /* the agent died or failed; psd_last_error says what is known */
  PSD_NOT_FOUND = 4,           /* no agent segment of that name */
  PSD_FAILED_PRECONDITION = 5, /* called in the wrong state (not registered, never posted...) */
  PSD_ALREADY_ATTACHED = 6,    /* another process is attached to this agent */
  PSD_SYNC_FAILED = 7,         /* the agent could not synchronise the layer (server, peer...) */
  PSD_VERSION_MISMATCH = 8,    /* the agent speaks another shared-memory ABI version */
  PSD_INTERNAL = 9
} psd_status;

/* Layer kinds, element types, schemes. */
#define PSD_LAYER_FC 1u
#define PSD_LAYER_CONV 2u
#define PSD_LAYER_BIAS 3u
#define PSD_LAYER_OTHER 4u
#define PSD_FLOAT32 1u
#define PSD_SYNC_PS 1u
#define PSD_SYNC_SFB 2u
#define PSD_SYNC_ALLREDUCE 3u /* the gradient in, the sum out: as PS for the framework */

typedef struct psd_context psd_context;

typedef struct psd_config {
  uint32_t struct_size; /* sizeof(psd_config): set by psd_config_init */
  uint32_t abi_version; /* PSD_ABI_VERSION: set by psd_config_init */
  /* The agent's shared-memory segment name; NULL takes $POSEIDON_SEGMENT. */
  const char* segment;
  /* How long psd_attach waits for the agent's segment to appear (ms). */
  uint32_t attach_timeout_ms;
  /* An agent whose heartbeat is older than this is lost (ms). */
  uint32_t agent_timeout_ms;
} psd_config;

typedef struct psd_layer_desc {
  const char* name; /* unique, < 64 bytes */
  uint32_t kind;    /* PSD_LAYER_* */
  uint32_t dtype;   /* PSD_FLOAT32 */
  uint32_t ndim;    /* 1..4; FC layers: 2, shape = {M outputs, N inputs} */
  const uint64_t* shape;
  uint32_t batch_k; /* FC layers: the per-worker batch K (rows of the SFB factors) */
  uint32_t flags;   /* PSD_LAYER_FUSABLE | _AVERAGE | _COUNTERS | _OWN_CLOCK, or 0 */
} psd_layer_desc;

/* psd_layer_desc.flags. FUSABLE: the framework posts this layer in the same burst as its
 * neighbours every iteration (as backward does), never waiting for one of them in between, so
 * the agent may fuse it with adjacent small layers into one synchronisation. Do not set it on a
 * layer the framework waits for before posting other layers of the same iteration. */
#define PSD_LAYER_FUSABLE 1u
/* AVERAGE: the synchronised result is the mean over the ranks whose gradient it summed — the
 * world size, or the ranks left in the iterations after one was removed from a job that may
 * shrink (poseidon-agent --min_workers): the KV servers divide each key's clock by the ranks it
 * summed, the agents an SFB layer's iteration by the ranks it counted and an all-reduce by the
 * ranks of the ring that summed it. For a framework's own optimizer in such a job. */
#define PSD_LAYER_AVERAGE 2u
/* COUNTERS (a job with a server-side rule, psd_set_server_rule): the KV servers hold this
 * layer as parameters stepped by plain SGD with learning rate 1 on the ranks' mean push,
 * whatever the job's rule: iteration 1 gives rank 0's values, and a rank that pushes
 * (held - wanted) reads back `wanted` when every rank pushed the same. For small integer
 * counters the ranks keep alike and a rank taking up the running job must learn (the PyTorch
 * integration's ElasticState: epoch, batch); they are checkpointed with the parameters. */
#define PSD_LAYER_COUNTERS 4u
/* OWN_CLOCK: the layer's iterations are not the training iterations (the PyTorch integration's
 * broadcast of DDP's buffers, which a forward without backward adds to). It counts its own:
 * where a rank takes up the running job (poseidon-agent --rejoin) the job's iteration is read
 * from the other layers' keys, and this layer's iteration 1 is its key's last completed clock
 * (a retransmission: the servers answer that clock's sum) — the framework learns from a live
 * rank where its own posts go on. Not with FUSABLE. */
#define PSD_LAYER_OWN_CLOCK 8u
/* BY_SERVERS: the layer goes by the KV servers (PS) whatever the plan says (never SFB or ring
 * all-reduce): it is posted now and then, or a rank taking up the running job posts again
 * iterations the others completed (a retransmission only a server can answer) — the PyTorch
 * integration's broadcast layers in a job that takes ranks back. Needs KV servers. */
#define PSD_LAYER_BY_SERVERS 16u

typedef struct psd_layer_info {
  uint32_t scheme;   /* PSD_SYNC_PS or PSD_SYNC_SFB, as the first plan says (psd_layer_scheme:
                        per iteration) */
  uint32_t priority; /* lower is synchronised sooner */
  uint64_t elements;
  float* grad; /* elements floats: write the gradient here; the synchronised sum comes back */
  float* u;    /* K x M (row-major), the per-sample output gradients, for the iterations the
                  layer runs by SFB; NULL if it never can (not an FC layer, or factors larger
                  than the gradient) */
  float* v;    /* K x N, the per-sample inputs; NULL likewise */
} psd_layer_info;

/* A server-side update rule: the KV servers apply the optimizer and the synchronised result of
 * each iteration is the updated parameters (not the summed gradient). */
typedef struct psd_server_rule {
  uint32_t struct_size; /* sizeof(psd_server_rule) */
  uint32_t rule;        /* PSD_RULE_SGD, PSD_RULE_MOMENTUM, PSD_RULE_ADAM */
  double lr, momentum, dampening, beta1, beta2, eps, weight_decay;
  uint32_t nesterov;
} psd_server_rule;
#define PSD_RULE_SGD 2u
#define PSD_RULE_MOMENTUM 3u
#define PSD_RULE_ADAM 4u

/* Fills the defaults: struct_size, abi_version, attach 30 s, agent timeout 5 s. */
void psd_config_init(psd_config* config);

psd_status psd_attach(const psd_config* config, psd_context** out);

/* Registers the model's layers (in forward order) and waits up to timeout_ms for the agent's
 * plan and buffers. Once. */
psd_status psd_register_layers(psd_context* ctx, const psd_layer_desc* layers, uint32_t count,
                               uint32_t timeout_ms);

psd_status psd_get_layer_info(psd_context* ctx, uint32_t layer, psd_layer_info* out);

/* The layer's scheme at `iteration` (PSD_SYNC_PS: write the gradient; PSD_SYNC_SFB: write U and
 * V). Valid from the iteration after the last one posted; fails (PSD_INVALID_ARGUMENT) for an
 * earlier one. */
psd_status psd_layer_scheme(psd_context* ctx, uint32_t layer, uint64_t iteration,
                            uint32_t* scheme);

/* Before psd_register_layers: use a server-side update rule instead of the sum. Every layer then
 * goes by PS; iteration 1 carries rank 0's initial parameters (other ranks' buffers are ignored)
 * and every psd_wait_layer(l, t) leaves the layer's updated parameters in its buffer; iteration
 * t >= 2 posts the gradient (averaged over the workers by the servers). */
psd_status psd_set_server_rule(psd_context* ctx, const psd_server_rule* rule);

/* Posts "layer's input for iteration is written". Iterations start at 1 and increase by one per
 * layer. Does not block. */
psd_status psd_layer_ready(psd_context* ctx, uint32_t layer, uint64_t iteration);

/* ---- CUDA ----------------------------------------------------------------------------------
 * Gradients born on a GPU stay there: after psd_register_layers, psd_cuda_enable allocates one
 * device arena laid out like the host buffers (every layer's grad / u / v at the same offsets),
 * and the agent opens it and the per-layer events through CUDA IPC. During backward, write a
 * layer's input into its device buffers on `stream` and call psd_cuda_layer_ready: it records
 * the layer's event on the stream and returns at once; the agent's copies wait for that event on
 * the device, so the training thread never blocks. psd_cuda_wait_layer waits (bounded) until
 * the agent has queued the result's copy back into the arena, then makes `stream` wait for it
 * on the device. Host-buffer calls (psd_layer_ready / psd_wait_layer) stay valid for any layer.
 *
 * libposeidon loads the CUDA runtime (libcudart) only here, at run time: without it, or
 * without a device, psd_cuda_enable fails with PSD_FAILED_PRECONDITION and a clear message.
 * Streams are cudaStream_t values (NULL: the legacy default stream). Thread-safety as for the
 * host calls; psd_cuda_enable: once, on the registering thread. */
psd_status psd_cuda_enable(psd_context* ctx, int device, uint32_t timeout_ms);

/* The layer's device buffers (NULL where the layer has none, e.g. u/v of a PS layer). */
psd_status psd_cuda_layer_buffers(psd_context* ctx, uint32_t layer, float** grad, float** u,
                                  float** v);

psd_status psd_cuda_layer_ready(psd_context* ctx, uint32_t layer, uint64_t iteration,
                                void* stream);

psd_status psd_cuda_wait_layer(psd_context* ctx, uint32_t layer, uint64_t iteration,
                               uint32_t timeout_ms, void* stream);

/* Waits until the layer's iteration is synchronised, at most timeout_ms. */
psd_status psd_wait_layer(psd_context* ctx, uint32_t layer, uint64_t iteration,
                          uint32_t timeout_ms);

psd_status psd_rank(psd_context* ctx, uint32_t* rank, uint32_t* world_size);

/* After psd_register_layers: the job's iteration this process's iteration 1 is. For a rank
 * that rejoined a running job (its agent started with --rejoin after the rank died) the
 * iteration it takes up, so that its data and schedule go on from there; 1 otherwise (a
 * resumed job's ranks read $POSEIDON_RESUMED_ITERATION). Iterations passed to psd_layer_ready
 * stay this process's own (1, 2, ...). */
psd_status psd_start_iteration(psd_context* ctx, uint64_t* iteration);

/* The world this rank trains in now: its index among the ranks the job goes on with, their
 * number, and how many times that changed (0: the world the job started with, psd_rank's).
 * The world shrinks when a dead rank is removed (poseidon-agent --min_workers): from then on
 * the synchronised results sum the ranks left, and a data loader shards by these. Cheap: one
 * load from shared memory; poll it between iterations. */
psd_status psd_world(psd_context* ctx, uint32_t* rank, uint32_t* world_size,
                     uint64_t* generation);

/* How many ranks took up the running job (an agent restarted with --rejoin after the others
 * had trained without it; the coordinator's count as this rank's agent last heard it, so it
 * lags by up to a heartbeat; it only grows), and the agent's --rejoin_timeout in milliseconds
 * (0: a dead rank is never waited for, so none can take up the job). A framework whose ranks
 * hold state the servers do not (a local optimizer) hands it to such a rank when the count
 * grows. Cheap: loads from shared memory. */
psd_status psd_takeovers(psd_context* ctx, uint64_t* takeovers, uint32_t* rejoin_timeout_ms);

/* Tells the agent the framework is leaving, unmaps, frees the context. */
psd_status psd_detach(psd_context* ctx);

/* The message of this thread's last failed call ("" if none). */
const char* psd_last_error(void);
const char* psd_status_string(psd_status status);
uint32_t psd_abi_version(void);

#ifdef __cplusplus
}
#endif

#endif /* POSEIDON_POSEIDON_H_ */
