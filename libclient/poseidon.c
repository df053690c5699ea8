/* libposeidon: the framework side of the shared-memory channel to poseidon-agent. C11, libc and
 * pthread only. Every value read from the segment is checked before use; every wait is bounded
 * and checks that the agent is still alive. */
#define _GNU_SOURCE
#include "poseidon/poseidon.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "common/shm_layout.h"

#define PSD_EXPORT __attribute__((visibility("default")))

struct psd_context {
  int control_fd;
  unsigned char* control;
  size_t control_bytes;
  unsigned char* data;
  size_t data_bytes;
  psd_shm_header* header;
  psd_shm_ring* to_agent;
  psd_shm_layer* layers;
  uint32_t num_layers; /* our copy, once registered */
  uint32_t agent_timeout_ms;
  pid_t agent_pid;
  uint32_t rank; /* the agent's rank, read at attach (for messages) */
  pthread_mutex_t post_mu; /* the to-agent ring has one producer: us, serialized here */
  char segment[PSD_SHM_NAME_BYTES];
  /* CUDA (psd_cuda_enable): the device arena and the per-layer events. */
  int cuda_device;
  unsigned char* cuda_arena;
  void** cuda_ready; /* cudaEvent_t per layer, ours, exported */
  void** cuda_done;  /* cudaEvent_t per layer, the agent's, opened */
};

static __thread char psd_error[512];

static psd_status fail(psd_status s, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(psd_error, sizeof(psd_error), fmt, ap);
  va_end(ap);
  return s;
}

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void futex_wait(uint32_t* addr, uint32_t expected, uint64_t timeout_ns) {
  struct timespec ts = {(time_t)(timeout_ns / 1000000000ull), (long)(timeout_ns % 1000000000ull)};
  syscall(SYS_futex, addr, FUTEX_WAIT, expected, &ts, NULL, 0);
}

static void futex_wake(uint32_t* addr) { syscall(SYS_futex, addr, FUTEX_WAKE, 1 << 30, NULL, NULL, 0); }

static uint32_t load32(const uint32_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static uint64_t load64(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

/* The agent is gone if its process is, if it says it failed, or if its heartbeat is stale. */
static psd_status check_agent(psd_context* ctx) {
  const uint32_t state = load32(&ctx->header->agent_state);
  if (state == PSD_AGENT_FAILED || state == PSD_AGENT_EXITED) {
    char why[PSD_SHM_ERROR_BYTES + 1];
    memcpy(why, ctx->header->error, PSD_SHM_ERROR_BYTES);
    why[PSD_SHM_ERROR_BYTES] = '\0';
    return fail(PSD_AGENT_LOST, "agent lost (rank %u, segment %s): %s", ctx->rank, ctx->segment,
                why[0] ? why : "it exited");
  }
  if (ctx->agent_pid > 0 && kill(ctx->agent_pid, 0) != 0 && errno == ESRCH) {
    return fail(PSD_AGENT_LOST, "agent lost (rank %u, segment %s): process %d is gone", ctx->rank,
                ctx->segment, (int)ctx->agent_pid);
  }
  /* The clock first, then the beat: a training process descheduled between the two reads (a
   * loaded machine) then sees a beat newer than `now` instead of taking its own pause for the
   * agent's silence. */
  const uint64_t now = now_ns();
  const uint64_t beat = load64(&ctx->header->agent_heartbeat_ns);
  if (beat != 0 && now > beat && now - beat > (uint64_t)ctx->agent_timeout_ms * 1000000ull) {
    return fail(PSD_AGENT_LOST, "agent lost (rank %u, segment %s): no heartbeat for %llu ms",
                ctx->rank, ctx->segment, (unsigned long long)((now - beat) / 1000000ull));
  }
  __atomic_store_n(&ctx->header->framework_heartbeat_ns, now, __ATOMIC_RELEASE);
  return PSD_OK;
}

static psd_status post_aux(psd_context* ctx, uint32_t type, uint32_t layer, uint64_t iteration,
                           uint64_t aux) {
  psd_shm_ring* ring = ctx->to_agent;
  pthread_mutex_lock(&ctx->post_mu);
  const uint64_t tail = __atomic_load_n(&ring->tail, __ATOMIC_RELAXED);
  const uint64_t head = load64(&ring->head);
  if (tail - head >= PSD_SHM_RING_CAPACITY) {
    pthread_mutex_unlock(&ctx->post_mu);
    return fail(PSD_FAILED_PRECONDITION,
                "the event ring to the agent is full (%u events): is the agent stuck?",
                PSD_SHM_RING_CAPACITY);
  }
  psd_shm_event* e = &ring->events[tail % PSD_SHM_RING_CAPACITY];
  e->type = type;
  e->layer = layer;
  e->iteration = iteration;
  e->status = 0;
  e->aux = aux;
  __atomic_store_n(&ring->tail, tail + 1, __ATOMIC_RELEASE);
  __atomic_add_fetch(&ring->doorbell, 1, __ATOMIC_RELEASE);
  if (load32(&ring->consumer_sleeping)) futex_wake(&ring->doorbell);
  pthread_mutex_unlock(&ctx->post_mu);
  return PSD_OK;
}

static psd_status post(psd_context* ctx, uint32_t type, uint32_t layer, uint64_t iteration) {
  return post_aux(ctx, type, layer, iteration, 0);
}

static void cuda_release(psd_context* ctx);

PSD_EXPORT void psd_config_init(psd_config* config) {
  if (config == NULL) return;
  memset(config, 0, sizeof(*config));
  config->struct_size = sizeof(*config);
  config->abi_version = PSD_ABI_VERSION;
  config->attach_timeout_ms = 30000;
  config->agent_timeout_ms = 5000;
}

PSD_EXPORT uint32_t psd_abi_version(void) { return PSD_ABI_VERSION; }

PSD_EXPORT const char* psd_last_error(void) { return psd_error; }

PSD_EXPORT const char* psd_status_string(psd_status s) {
  switch (s) {
    case PSD_OK: return "ok";
    case PSD_INVALID_ARGUMENT: return "invalid argument";
    case PSD_TIMEOUT: return "timeout";
    case PSD_AGENT_LOST: return "agent lost";
    case PSD_NOT_FOUND: return "not found";
    case PSD_FAILED_PRECONDITION: return "failed precondition";
    case PSD_ALREADY_ATTACHED: return "already attached";
    case PSD_SYNC_FAILED: return "synchronisation failed";
    case PSD_VERSION_MISMATCH: return "version mismatch";
    case PSD_INTERNAL: return "internal error";
  }
  return "unknown status";
}

PSD_EXPORT psd_status psd_attach(const psd_config* config, psd_context** out) {
  psd_error[0] = '\0';
  if (config == NULL || out == NULL) return fail(PSD_INVALID_ARGUMENT, "config and out must be set");
  if (config->struct_size < sizeof(psd_config) || config->abi_version != PSD_ABI_VERSION) {
    return fail(PSD_VERSION_MISMATCH,
                "psd_config of size %u version %u; this library is ABI version %u "
                "(use psd_config_init)",
                config->struct_size, config->abi_version, PSD_ABI_VERSION);
  }
  const char* segment = config->segment ? config->segment : getenv("POSEIDON_SEGMENT");
  if (segment == NULL || segment[0] == '\0') {
    return fail(PSD_INVALID_ARGUMENT, "no agent segment: set config.segment or POSEIDON_SEGMENT");
  }
  if (strlen(segment) >= PSD_SHM_NAME_BYTES || strchr(segment + 1, '/') != NULL) {
    return fail(PSD_INVALID_ARGUMENT, "bad segment name '%s'", segment);
  }
  /* Wait for the agent to create the segment. */
  const uint64_t deadline = now_ns() + (uint64_t)config->attach_timeout_ms * 1000000ull;
  int fd = -1;
  while ((fd = shm_open(segment, O_RDWR, 0)) < 0) {
    if (errno != ENOENT) return fail(PSD_NOT_FOUND, "cannot open %s: %s", segment, strerror(errno));
    if (now_ns() >= deadline) {
      return fail(PSD_NOT_FOUND, "no agent segment %s after %u ms: is poseidon-agent running?",
                  segment, config->attach_timeout_ms);
    }
    usleep(10000);
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || (size_t)st.st_size < PSD_SHM_CONTROL_BYTES) {
    /* The agent may still be sizing it. */
    while (now_ns() < deadline && fstat(fd, &st) == 0 && (size_t)st.st_size < PSD_SHM_CONTROL_BYTES) {
      usleep(10000);
    }
    if ((size_t)st.st_size < PSD_SHM_CONTROL_BYTES) {
      close(fd);
      return fail(PSD_VERSION_MISMATCH, "segment %s is %lld bytes, expected at least %zu", segment,
                  (long long)st.st_size, (size_t)PSD_SHM_CONTROL_BYTES);
    }
  }
  unsigned char* control = mmap(NULL, PSD_SHM_CONTROL_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (control == MAP_FAILED) {
    close(fd);
    return fail(PSD_INTERNAL, "mmap of %s failed: %s", segment, strerror(errno));
  }
  psd_shm_header* header = (psd_shm_header*)control;
  /* The agent publishes magic last: wait for it. */
  while (load64(&header->magic) != PSD_SHM_MAGIC && now_ns() < deadline) usleep(5000);
  if (load64(&header->magic) != PSD_SHM_MAGIC || header->abi_version != PSD_SHM_ABI_VERSION ||
      header->control_bytes != PSD_SHM_CONTROL_BYTES ||
      header->to_agent_offset != PSD_SHM_TO_AGENT_OFFSET ||
      header->to_framework_offset != PSD_SHM_TO_FRAMEWORK_OFFSET ||
      header->layers_offset != PSD_SHM_LAYERS_OFFSET) {
    munmap(control, PSD_SHM_CONTROL_BYTES);
    close(fd);
    return fail(PSD_VERSION_MISMATCH,
                "segment %s is not a poseidon-agent segment of ABI version %u", segment,
                PSD_SHM_ABI_VERSION);
  }
  uint32_t expected = 0;
  if (!__atomic_compare_exchange_n(&header->attached, &expected, 1, 0, __ATOMIC_ACQ_REL,
                                   __ATOMIC_ACQUIRE)) {
    const uint32_t holder = load32(&header->framework_pid);
    munmap(control, PSD_SHM_CONTROL_BYTES);
    close(fd);
    return fail(PSD_ALREADY_ATTACHED, "another process (pid %u) is attached to agent %s", holder,
                segment);
  }
  psd_context* ctx = calloc(1, sizeof(*ctx));
  if (ctx == NULL) {
    __atomic_store_n(&header->attached, 0, __ATOMIC_RELEASE);
    munmap(control, PSD_SHM_CONTROL_BYTES);
    close(fd);
    return fail(PSD_INTERNAL, "out of memory");
  }
  ctx->control_fd = fd;
  ctx->control = control;
  ctx->control_bytes = PSD_SHM_CONTROL_BYTES;
  ctx->header = header;
  ctx->to_agent = (psd_shm_ring*)(control + PSD_SHM_TO_AGENT_OFFSET);
  ctx->layers = (psd_shm_layer*)(control + PSD_SHM_LAYERS_OFFSET);
  ctx->agent_timeout_ms = config->agent_timeout_ms ? config->agent_timeout_ms : 5000;
  ctx->agent_pid = (pid_t)load32(&header->agent_pid);
  ctx->rank = header->rank;
  pthread_mutex_init(&ctx->post_mu, NULL);
  snprintf(ctx->segment, sizeof(ctx->segment), "%s", segment);
  __atomic_store_n(&header->framework_pid, (uint32_t)getpid(), __ATOMIC_RELEASE);
  __atomic_store_n(&header->framework_heartbeat_ns, now_ns(), __ATOMIC_RELEASE);
  psd_status s = check_agent(ctx);
  if (s != PSD_OK) {
    psd_detach(ctx);
    return s;
  }
  *out = ctx;
  return PSD_OK;
}

PSD_EXPORT psd_status psd_set_server_rule(psd_context* ctx, const psd_server_rule* rule) {
  psd_error[0] = '\0';
  if (ctx == NULL || rule == NULL) return fail(PSD_INVALID_ARGUMENT, "ctx and rule must be set");
  if (rule->struct_size < sizeof(psd_server_rule)) {
    return fail(PSD_VERSION_MISMATCH, "psd_server_rule of size %u, expected %zu",
                rule->struct_size, sizeof(psd_server_rule));
  }
  if (rule->rule != PSD_RULE_SGD && rule->rule != PSD_RULE_MOMENTUM && rule->rule != PSD_RULE_ADAM) {
    return fail(PSD_INVALID_ARGUMENT, "unknown server rule %u", rule->rule);
  }
  if (ctx->num_layers != 0) return fail(PSD_FAILED_PRECONDITION, "layers are already registered");
  psd_shm_header* h = ctx->header;
  h->server_lr = rule->lr;
  h->server_momentum = rule->momentum;
  h->server_dampening = rule->dampening;
  h->server_beta1 = rule->beta1;
  h->server_beta2 = rule->beta2;
  h->server_eps = rule->eps;
  h->server_weight_decay = rule->weight_decay;
  h->server_nesterov = rule->nesterov;
  __atomic_store_n(&h->server_rule, rule->rule, __ATOMIC_RELEASE);
  return PSD_OK;
}

PSD_EXPORT psd_status psd_register_layers(psd_context* ctx, const psd_layer_desc* layers,
                                          uint32_t count, uint32_t timeout_ms) {
  psd_error[0] = '\0';
  if (ctx == NULL || layers == NULL) return fail(PSD_INVALID_ARGUMENT, "ctx and layers must be set");
  if (count == 0 || count > PSD_SHM_MAX_LAYERS) {
    return fail(PSD_INVALID_ARGUMENT, "layer count %u outside [1, %u]", count, PSD_SHM_MAX_LAYERS);
  }
  if (ctx->num_layers != 0 || load32(&ctx->header->registration_state) != PSD_REG_NONE) {
    return fail(PSD_FAILED_PRECONDITION, "layers are already registered");
  }
  for (uint32_t i = 0; i < count; ++i) {
    const psd_layer_desc* d = &layers[i];
    if (d->name == NULL || d->name[0] == '\0' || strlen(d->name) >= PSD_SHM_NAME_BYTES) {
      return fail(PSD_INVALID_ARGUMENT, "layer %u: name must have 1 to %u bytes", i,
                  PSD_SHM_NAME_BYTES - 1);
    }
    if (d->ndim == 0 || d->ndim > PSD_SHM_MAX_DIMS || d->shape == NULL) {
      return fail(PSD_INVALID_ARGUMENT, "layer %u (%s): ndim must be 1..%u", i, d->name,
                  PSD_SHM_MAX_DIMS);
    }
    if (d->dtype != PSD_FLOAT32) {
      return fail(PSD_INVALID_ARGUMENT, "layer %u (%s): only PSD_FLOAT32 is supported", i, d->name);
    }
    if (d->kind < PSD_LAYER_FC || d->kind > PSD_LAYER_OTHER) {
      return fail(PSD_INVALID_ARGUMENT, "layer %u (%s): unknown kind %u", i, d->name, d->kind);
    }
    const uint32_t known =
        PSD_LAYER_FUSABLE | PSD_LAYER_AVERAGE | PSD_LAYER_COUNTERS | PSD_LAYER_OWN_CLOCK |
        PSD_LAYER_BY_SERVERS;
    if ((d->flags & ~known) != 0) {
      return fail(PSD_INVALID_ARGUMENT, "layer %u (%s): unknown flags 0x%x", i, d->name,
                  d->flags & ~known);
    }
    if ((d->flags & PSD_LAYER_OWN_CLOCK) && (d->flags & PSD_LAYER_FUSABLE)) {
      return fail(PSD_INVALID_ARGUMENT,
                  "layer %u (%s): PSD_LAYER_OWN_CLOCK and PSD_LAYER_FUSABLE exclude each other "
                  "(a fused layer goes at its bucket's clock)", i, d->name);
    }
    if (d->kind == PSD_LAYER_FC && (d->ndim != 2 || d->batch_k == 0)) {
      return fail(PSD_INVALID_ARGUMENT, "layer %u (%s): FC layers need shape {M, N} and batch_k > 0",
                  i, d->name);
    }
    for (uint32_t k = 0; k < d->ndim; ++k) {
      if (d->shape[k] == 0 || d->shape[k] > (1ull << 32)) {
        return fail(PSD_INVALID_ARGUMENT, "layer %u (%s): bad dimension %llu", i, d->name,
                    (unsigned long long)d->shape[k]);
      }
    }
    psd_shm_layer* l = &ctx->layers[i];
    memset(l, 0, sizeof(*l));
    snprintf(l->name, sizeof(l->name), "%s", d->name);
    l->kind = d->kind;
    l->dtype = d->dtype;
    l->ndim = d->ndim;
    l->batch_k = d->batch_k;
    l->flags = d->flags;
    for (uint32_t k = 0; k < d->ndim; ++k) l->shape[k] = d->shape[k];
  }
  __atomic_store_n(&ctx->header->num_layers, count, __ATOMIC_RELEASE);
  const uint32_t generation = load32(&ctx->header->registration_futex);
  __atomic_store_n(&ctx->header->registration_state, PSD_REG_REQUESTED, __ATOMIC_RELEASE);
  psd_status s = post(ctx, PSD_EVENT_REGISTER, 0, 0);
  if (s != PSD_OK) return s;
  const uint64_t deadline = now_ns() + (uint64_t)timeout_ms * 1000000ull;
  uint32_t state;
  while ((state = load32(&ctx->header->registration_state)) == PSD_REG_REQUESTED) {
    s = check_agent(ctx);
    if (s != PSD_OK) return s;
    const uint64_t now = now_ns();
    if (now >= deadline) {
      return fail(PSD_TIMEOUT, "the agent did not answer the registration of %u layers within %u ms",
                  count, timeout_ms);
    }
    const uint64_t left = deadline - now;
    futex_wait(&ctx->header->registration_futex, generation, left < 100000000ull ? left : 100000000ull);
  }
  if (state != PSD_REG_DONE) {
    char why[PSD_SHM_ERROR_BYTES + 1];
    memcpy(why, ctx->header->error, PSD_SHM_ERROR_BYTES);
    why[PSD_SHM_ERROR_BYTES] = '\0';
    return fail(PSD_FAILED_PRECONDITION, "the agent refused the registration: %s", why);
  }
  /* Map the data segment the agent created. */
  char data_name[PSD_SHM_NAME_BYTES + 1];
  memcpy(data_name, ctx->header->data_name, PSD_SHM_NAME_BYTES);
  data_name[PSD_SHM_NAME_BYTES] = '\0';
  const uint64_t data_bytes = load64(&ctx->header->data_bytes);
  const int fd = shm_open(data_name, O_RDWR, 0);
  if (fd < 0) return fail(PSD_AGENT_LOST, "cannot open data segment %s: %s", data_name, strerror(errno));
  struct stat st;
  if (fstat(fd, &st) != 0 || (uint64_t)st.st_size != data_bytes || data_bytes == 0) {
    close(fd);
    return fail(PSD_INTERNAL, "data segment %s has the wrong size", data_name);
  }
  void* data = mmap(NULL, data_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (data == MAP_FAILED) return fail(PSD_INTERNAL, "mmap of %s failed: %s", data_name, strerror(errno));
  /* Check every offset the agent wrote against the data segment before handing out pointers. */
  for (uint32_t i = 0; i < count; ++i) {
    const psd_shm_layer* l = &ctx->layers[i];
    const uint64_t grad_end = l->grad_offset + l->elements * 4;
    int bad = l->elements == 0 || grad_end > data_bytes || grad_end < l->grad_offset;
    const int buffers = (l->agent_flags & PSD_LAYER_SFB_BUFFERS) != 0;
    if (buffers) {
      const uint64_t m = l->shape[0], n = l->shape[1], k = l->batch_k;
      bad |= l->kind != PSD_KIND_FC || l->u_offset + k * m * 4 > data_bytes ||
             l->v_offset + k * n * 4 > data_bytes;
    }
    /* The first plan's scheme, and every scheme the schedule can name, must be runnable. */
    const uint64_t word = load64(&l->schedule);
    const uint32_t first = l->scheme, before = (uint32_t)(word & 0xff),
                   after = (uint32_t)((word >> 8) & 0xff);
    const uint32_t schemes[3] = {first, before, after};
    for (int k = 0; k < 3; ++k) {
      bad |= schemes[k] != PSD_SCHEME_PS && schemes[k] != PSD_SCHEME_SFB &&
             schemes[k] != PSD_SCHEME_ALLREDUCE;
      bad |= schemes[k] == PSD_SCHEME_SFB && !buffers;
    }
    if (bad) {
      munmap(data, data_bytes);
      return fail(PSD_INTERNAL, "the agent's layout of layer %u (%s) is invalid", i, l->name);
    }
  }
  ctx->data = data;
  ctx->data_bytes = data_bytes;
  ctx->num_layers = count;
  return PSD_OK;
}

static psd_status check_layer(psd_context* ctx, uint32_t layer) {
  if (ctx == NULL) return fail(PSD_INVALID_ARGUMENT, "ctx is NULL");
  if (ctx->num_layers == 0) return fail(PSD_FAILED_PRECONDITION, "no layers registered yet");
  if (layer >= ctx->num_layers) {
    return fail(PSD_INVALID_ARGUMENT, "layer %u out of range (%u layers)", layer, ctx->num_layers);
  }
  return PSD_OK;
}

PSD_EXPORT psd_status psd_get_layer_info(psd_context* ctx, uint32_t layer, psd_layer_info* out) {
  psd_error[0] = '\0';
  psd_status s = check_layer(ctx, layer);
  if (s != PSD_OK) return s;
  if (out == NULL) return fail(PSD_INVALID_ARGUMENT, "out is NULL");
  const psd_shm_layer* l = &ctx->layers[layer];
  out->scheme = l->scheme;
  out->priority = l->priority;
  out->elements = l->elements;
  out->grad = (float*)(ctx->data + l->grad_offset);
  const int buffers = (l->agent_flags & PSD_LAYER_SFB_BUFFERS) != 0;
  out->u = buffers ? (float*)(ctx->data + l->u_offset) : NULL;
  out->v = buffers ? (float*)(ctx->data + l->v_offset) : NULL;
  return PSD_OK;
}

/* The scheme of `iteration` from the layer's schedule word (the agent writes it atomically, and
 * only for iterations after the next one to be posted). A scheme the layer cannot run means the
 * segment is corrupt: refused. */
static psd_status scheme_at(psd_context* ctx, uint32_t layer, uint64_t iteration, uint32_t* out) {
  const psd_shm_layer* l = &ctx->layers[layer];
  const uint64_t word = load64(&l->schedule);
  const uint32_t scheme = PSD_SCHEDULE_SCHEME(word, iteration);
  if (scheme != PSD_SCHEME_PS && scheme != PSD_SCHEME_ALLREDUCE &&
      !(scheme == PSD_SCHEME_SFB && (l->agent_flags & PSD_LAYER_SFB_BUFFERS) != 0)) {
    return fail(PSD_INTERNAL, "layer %u (%s): the agent's schedule names scheme %u", layer,
                l->name, scheme);
  }
  *out = scheme;
  return PSD_OK;
}

PSD_EXPORT psd_status psd_layer_scheme(psd_context* ctx, uint32_t layer, uint64_t iteration,
                                       uint32_t* scheme) {
  psd_error[0] = '\0';
  psd_status s = check_layer(ctx, layer);
  if (s != PSD_OK) return s;
  if (scheme == NULL) return fail(PSD_INVALID_ARGUMENT, "scheme is NULL");
  const uint64_t posted = load64(&ctx->layers[layer].ready_iteration);
  if (iteration == 0 || iteration <= posted) {
    return fail(PSD_INVALID_ARGUMENT,
                "layer %u (%s): iteration %llu is posted already (ask before posting it)", layer,
                ctx->layers[layer].name, (unsigned long long)iteration);
  }
  return scheme_at(ctx, layer, iteration, scheme);
}

static psd_status check_ready(psd_context* ctx, uint32_t layer, uint64_t iteration) {
  psd_status s = check_layer(ctx, layer);
  if (s != PSD_OK) return s;
  psd_shm_layer* l = &ctx->layers[layer];
  const uint64_t previous = load64(&l->ready_iteration);
  if (iteration != previous + 1) {
    return fail(PSD_INVALID_ARGUMENT, "layer %u (%s): iteration %llu posted after %llu (must be %llu)",
                layer, l->name, (unsigned long long)iteration, (unsigned long long)previous,
                (unsigned long long)(previous + 1));
  }
  /* Only the cheap part of the liveness check (no syscall on this hot path): an agent that
   * reported its end. A vanished process is noticed by psd_wait_layer, which always follows. */
  const uint32_t state = load32(&ctx->header->agent_state);
  if (state == PSD_AGENT_FAILED || state == PSD_AGENT_EXITED) return check_agent(ctx);
  return PSD_OK;
}

PSD_EXPORT psd_status psd_layer_ready(psd_context* ctx, uint32_t layer, uint64_t iteration) {
  psd_error[0] = '\0';
  psd_status s = check_ready(ctx, layer, iteration);
  if (s != PSD_OK) return s;
  uint32_t scheme = 0;
  s = scheme_at(ctx, layer, iteration, &scheme);
  if (s != PSD_OK) return s;
  __atomic_store_n(&ctx->layers[layer].ready_iteration, iteration, __ATOMIC_RELEASE);
  return post_aux(ctx, PSD_EVENT_LAYER_READY, layer, iteration,
                  PSD_READY_AUX(PSD_READY_HOST, scheme));
}

PSD_EXPORT psd_status psd_wait_layer(psd_context* ctx, uint32_t layer, uint64_t iteration,
                                     uint32_t timeout_ms) {
  psd_error[0] = '\0';
  psd_status s = check_layer(ctx, layer);
  if (s != PSD_OK) return s;
  psd_shm_layer* l = &ctx->layers[layer];
  if (iteration == 0 || iteration > load64(&l->ready_iteration)) {
    return fail(PSD_FAILED_PRECONDITION, "layer %u (%s): iteration %llu was never posted ready",
                layer, l->name, (unsigned long long)iteration);
  }
  const uint64_t deadline = now_ns() + (uint64_t)timeout_ms * 1000000ull;
  while (1) {
    const uint32_t generation = load32(&l->done_futex);
    if (load64(&l->done_iteration) >= iteration) return PSD_OK;
    if (__atomic_load_n(&l->done_status, __ATOMIC_ACQUIRE) != 0) {
      char why[sizeof(l->message) + 1];
      memcpy(why, l->message, sizeof(l->message));
      why[sizeof(l->message)] = '\0';
      return fail(PSD_SYNC_FAILED, "layer %u (%s) iteration %llu: %s", layer, l->name,
                  (unsigned long long)iteration, why);
    }
    s = check_agent(ctx);
    if (s != PSD_OK) return s;
    const uint64_t now = now_ns();
    if (now >= deadline) {
      return fail(PSD_TIMEOUT, "layer %u (%s) iteration %llu not synchronised within %u ms", layer,
                  l->name, (unsigned long long)iteration, timeout_ms);
    }
    const uint64_t left = deadline - now;
    futex_wait(&l->done_futex, generation, left < 100000000ull ? left : 100000000ull);
  }
}

PSD_EXPORT psd_status psd_rank(psd_context* ctx, uint32_t* rank, uint32_t* world_size) {
  psd_error[0] = '\0';
  if (ctx == NULL || rank == NULL || world_size == NULL) {
    return fail(PSD_INVALID_ARGUMENT, "ctx, rank and world_size must be set");
  }
  *rank = load32(&ctx->header->rank);
  *world_size = load32(&ctx->header->world_size);
  return PSD_OK;
}

PSD_EXPORT psd_status psd_start_iteration(psd_context* ctx, uint64_t* iteration) {
  psd_error[0] = '\0';
  if (ctx == NULL || iteration == NULL) {
    return fail(PSD_INVALID_ARGUMENT, "ctx and iteration must be set");
  }
  if (load32(&ctx->header->registration_state) != PSD_REG_DONE) {
    return fail(PSD_FAILED_PRECONDITION, "the layers are not registered yet (psd_register_layers)");
  }
  const uint64_t start = load64(&ctx->header->start_iteration);
  *iteration = start == 0 ? 1 : start;
  return PSD_OK;
}

PSD_EXPORT psd_status psd_world(psd_context* ctx, uint32_t* rank, uint32_t* world_size,
                                uint64_t* generation) {
  psd_error[0] = '\0';
  if (ctx == NULL || rank == NULL || world_size == NULL || generation == NULL) {
    return fail(PSD_INVALID_ARGUMENT, "ctx, rank, world_size and generation must be set");
  }
  const uint64_t word = load64(&ctx->header->live_world);
  if (word == 0) {  /* the world the job started with */
    *rank = load32(&ctx->header->rank);
    *world_size = load32(&ctx->header->world_size);
    *generation = 0;
    return PSD_OK;
  }
  *rank = PSD_LIVE_WORLD_RANK(word);
  *world_size = PSD_LIVE_WORLD_SIZE(word);
  *generation = PSD_LIVE_WORLD_GENERATION(word);
  return PSD_OK;
}

PSD_EXPORT psd_status psd_takeovers(psd_context* ctx, uint64_t* takeovers,
                                    uint32_t* rejoin_timeout_ms) {
  psd_error[0] = '\0';
  if (ctx == NULL || takeovers == NULL || rejoin_timeout_ms == NULL) {
    return fail(PSD_INVALID_ARGUMENT, "ctx, takeovers and rejoin_timeout_ms must be set");
  }
  *takeovers = load64(&ctx->header->takeovers);
  *rejoin_timeout_ms = load32(&ctx->header->rejoin_timeout_ms);
  return PSD_OK;
}

PSD_EXPORT psd_status psd_detach(psd_context* ctx) {
  psd_error[0] = '\0';
  if (ctx == NULL) return fail(PSD_INVALID_ARGUMENT, "ctx is NULL");
  (void)post(ctx, PSD_EVENT_DETACH, 0, 0);
  cuda_release(ctx);
  if (ctx->data) munmap(ctx->data, ctx->data_bytes);
  __atomic_store_n(&ctx->header->attached, 0, __ATOMIC_RELEASE);
  munmap(ctx->control, ctx->control_bytes);
  close(ctx->control_fd);
  pthread_mutex_destroy(&ctx->post_mu);
  free(ctx);
  return PSD_OK;
}

/* ---- CUDA ------------------------------------------------------------------------------------
 * The CUDA runtime is loaded at run time (dlopen), so that libposeidon needs nothing beyond libc
 * on a CPU machine and shares the runtime a framework (PyTorch) has already loaded. Only the
 * few stable runtime entry points below are used; the IPC handles are 64-byte structs passed as
 * the runtime declares them. */
typedef int cuda_err;
typedef struct { char reserved[PSD_CUDA_IPC_HANDLE_BYTES]; } cuda_ipc_handle;
#define CUDA_EVENT_DISABLE_TIMING 0x02u
#define CUDA_EVENT_INTERPROCESS 0x04u

static struct {
  pthread_once_t once;
  void* lib;
  char why[256];
  cuda_err (*get_device_count)(int*);
  cuda_err (*set_device)(int);
  cuda_err (*malloc_)(void**, size_t);
  cuda_err (*free_)(void*);
  cuda_err (*memset_)(void*, int, size_t);
  cuda_err (*ipc_get_mem_handle)(cuda_ipc_handle*, void*);
  cuda_err (*event_create_with_flags)(void**, unsigned);
  cuda_err (*event_destroy)(void*);
  cuda_err (*event_record)(void*, void*);
  cuda_err (*ipc_get_event_handle)(cuda_ipc_handle*, void*);
  cuda_err (*ipc_open_event_handle)(void**, cuda_ipc_handle);
  cuda_err (*stream_wait_event)(void*, void*, unsigned);
  const char* (*get_error_string)(cuda_err);
} cuda = {PTHREAD_ONCE_INIT};

static void cuda_load(void) {
  static const char* const names[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so",
                                      "/usr/local/cuda/lib64/libcudart.so"};
  for (size_t i = 0; i < sizeof(names) / sizeof(names[0]) && cuda.lib == NULL; ++i) {
    cuda.lib = dlopen(names[i], RTLD_NOW | RTLD_GLOBAL);
  }
  if (cuda.lib == NULL) {
    snprintf(cuda.why, sizeof(cuda.why), "the CUDA runtime (libcudart.so) could not be loaded");
    return;
  }
#define PSD_CUDA_SYM(field, symbol)                                                        \
  do {                                                                                     \
    *(void**)(&cuda.field) = dlsym(cuda.lib, symbol);                                      \
    if (cuda.field == NULL) {                                                              \
      snprintf(cuda.why, sizeof(cuda.why), "the CUDA runtime lacks %s", symbol);           \
      cuda.lib = NULL;                                                                     \
      return;                                                                              \
    }                                                                                      \
  } while (0)
  PSD_CUDA_SYM(get_device_count, "cudaGetDeviceCount");
  PSD_CUDA_SYM(set_device, "cudaSetDevice");
  PSD_CUDA_SYM(malloc_, "cudaMalloc");
  PSD_CUDA_SYM(free_, "cudaFree");
  PSD_CUDA_SYM(memset_, "cudaMemset");
  PSD_CUDA_SYM(ipc_get_mem_handle, "cudaIpcGetMemHandle");
  PSD_CUDA_SYM(event_create_with_flags, "cudaEventCreateWithFlags");
  PSD_CUDA_SYM(event_destroy, "cudaEventDestroy");
  PSD_CUDA_SYM(event_record, "cudaEventRecord");
  PSD_CUDA_SYM(ipc_get_event_handle, "cudaIpcGetEventHandle");
  PSD_CUDA_SYM(ipc_open_event_handle, "cudaIpcOpenEventHandle");
  PSD_CUDA_SYM(stream_wait_event, "cudaStreamWaitEvent");
  PSD_CUDA_SYM(get_error_string, "cudaGetErrorString");
#undef PSD_CUDA_SYM
}

static const char* cuda_error(cuda_err e) {
  return cuda.get_error_string ? cuda.get_error_string(e) : "unknown CUDA error";
}

static void cuda_release(psd_context* ctx) {
  if (cuda.lib == NULL) return;
  for (uint32_t i = 0; i < ctx->num_layers; ++i) {
    if (ctx->cuda_ready && ctx->cuda_ready[i]) cuda.event_destroy(ctx->cuda_ready[i]);
    if (ctx->cuda_done && ctx->cuda_done[i]) cuda.event_destroy(ctx->cuda_done[i]);
  }
  free(ctx->cuda_ready);
  free(ctx->cuda_done);
  ctx->cuda_ready = ctx->cuda_done = NULL;
  if (ctx->cuda_arena) cuda.free_(ctx->cuda_arena);
  ctx->cuda_arena = NULL;
}

PSD_EXPORT psd_status psd_cuda_enable(psd_context* ctx, int device, uint32_t timeout_ms) {
  psd_error[0] = '\0';
  if (ctx == NULL) return fail(PSD_INVALID_ARGUMENT, "ctx is NULL");
  if (ctx->num_layers == 0) {
    return fail(PSD_FAILED_PRECONDITION, "register the layers before psd_cuda_enable");
  }
  if (ctx->cuda_arena != NULL) return fail(PSD_FAILED_PRECONDITION, "CUDA is already enabled");
  pthread_once(&cuda.once, cuda_load);
  if (cuda.lib == NULL) return fail(PSD_FAILED_PRECONDITION, "%s", cuda.why);
  int devices = 0;
  cuda_err e = cuda.get_device_count(&devices);
  if (e != 0 || devices == 0) {
    return fail(PSD_FAILED_PRECONDITION, "no CUDA device: cudaGetDeviceCount returned %d (%s)", e,
                e ? cuda_error(e) : "0 devices");
  }
  if (device < 0 || device >= devices) {
    return fail(PSD_INVALID_ARGUMENT, "CUDA device %d out of range [0, %d)", device, devices);
  }
  psd_status status = PSD_INTERNAL;
  const uint32_t n = ctx->num_layers;
  psd_shm_header* h = ctx->header;
  if ((e = cuda.set_device(device)) != 0) {
    return fail(PSD_FAILED_PRECONDITION, "cudaSetDevice(%d): %s", device, cuda_error(e));
  }
  ctx->cuda_device = device;
  ctx->cuda_ready = calloc(n, sizeof(void*));
  ctx->cuda_done = calloc(n, sizeof(void*));
  if (ctx->cuda_ready == NULL || ctx->cuda_done == NULL) {
    status = fail(PSD_INTERNAL, "out of memory");
    goto out;
  }
  if ((e = cuda.malloc_((void**)&ctx->cuda_arena, ctx->data_bytes)) != 0) {
    ctx->cuda_arena = NULL;
    status = fail(PSD_INTERNAL, "cudaMalloc of the %llu-byte arena: %s",
                  (unsigned long long)ctx->data_bytes, cuda_error(e));
    goto out;
  }
  cuda_ipc_handle handle;
  if ((e = cuda.memset_(ctx->cuda_arena, 0, ctx->data_bytes)) != 0 ||
      (e = cuda.ipc_get_mem_handle(&handle, ctx->cuda_arena)) != 0) {
    status = fail(PSD_INTERNAL, "exporting the arena: %s", cuda_error(e));
    goto out;
  }
  memcpy(h->cuda_arena_handle, &handle, sizeof(handle));
  for (uint32_t i = 0; i < n; ++i) {
    if ((e = cuda.event_create_with_flags(&ctx->cuda_ready[i], CUDA_EVENT_DISABLE_TIMING |
                                                                   CUDA_EVENT_INTERPROCESS)) != 0 ||
        (e = cuda.ipc_get_event_handle(&handle, ctx->cuda_ready[i])) != 0) {
      status = fail(PSD_INTERNAL, "the ready event of layer %u: %s", i, cuda_error(e));
      goto out;
    }
    memcpy(ctx->layers[i].cuda_ready_event, &handle, sizeof(handle));
  }
  h->cuda_device = device;
  __atomic_store_n(&h->cuda_arena_bytes, (uint64_t)ctx->data_bytes, __ATOMIC_RELEASE);
  const uint32_t generation = load32(&h->registration_futex);
  __atomic_store_n(&h->cuda_state, PSD_CUDA_REQUESTED, __ATOMIC_RELEASE);
  if ((status = post(ctx, PSD_EVENT_CUDA_ATTACH, 0, 0)) != PSD_OK) goto out;
  const uint64_t deadline = now_ns() + (uint64_t)timeout_ms * 1000000ull;
  uint32_t state;
  while ((state = load32(&h->cuda_state)) == PSD_CUDA_REQUESTED) {
    if ((status = check_agent(ctx)) != PSD_OK) goto out;
    const uint64_t now = now_ns();
    if (now >= deadline) {
      status = fail(PSD_TIMEOUT, "the agent did not open the CUDA arena within %u ms", timeout_ms);
      goto out;
    }
    const uint64_t left = deadline - now;
    futex_wait(&h->registration_futex, generation, left < 100000000ull ? left : 100000000ull);
  }
  if (state != PSD_CUDA_READY) {
    char why[PSD_SHM_ERROR_BYTES + 1];
    memcpy(why, h->error, PSD_SHM_ERROR_BYTES);
    why[PSD_SHM_ERROR_BYTES] = '\0';
    status = fail(PSD_FAILED_PRECONDITION, "the agent could not use the CUDA arena: %s", why);
    goto out;
  }
  for (uint32_t i = 0; i < n; ++i) {
    memcpy(&handle, ctx->layers[i].cuda_done_event, sizeof(handle));
    if ((e = cuda.ipc_open_event_handle(&ctx->cuda_done[i], handle)) != 0) {
      ctx->cuda_done[i] = NULL;
      status = fail(PSD_INTERNAL, "opening the agent's done event of layer %u: %s", i,
                    cuda_error(e));
      goto out;
    }
  }
  return PSD_OK;
out:
  cuda_release(ctx);
  __atomic_store_n(&h->cuda_state, PSD_CUDA_OFF, __ATOMIC_RELEASE);
  return status;
}

PSD_EXPORT psd_status psd_cuda_layer_buffers(psd_context* ctx, uint32_t layer, float** grad,
                                             float** u, float** v) {
  psd_error[0] = '\0';
  psd_status s = check_layer(ctx, layer);
  if (s != PSD_OK) return s;
  if (ctx->cuda_arena == NULL) return fail(PSD_FAILED_PRECONDITION, "CUDA is not enabled");
  const psd_shm_layer* l = &ctx->layers[layer];
  const int sfb = (l->agent_flags & PSD_LAYER_SFB_BUFFERS) != 0;
  if (grad) *grad = (float*)(ctx->cuda_arena + l->grad_offset);
  if (u) *u = sfb ? (float*)(ctx->cuda_arena + l->u_offset) : NULL;
  if (v) *v = sfb ? (float*)(ctx->cuda_arena + l->v_offset) : NULL;
  return PSD_OK;
}

PSD_EXPORT psd_status psd_cuda_layer_ready(psd_context* ctx, uint32_t layer, uint64_t iteration,
                                           void* stream) {
  psd_error[0] = '\0';
  psd_status s = check_ready(ctx, layer, iteration);
  if (s != PSD_OK) return s;
  if (ctx->cuda_arena == NULL) return fail(PSD_FAILED_PRECONDITION, "CUDA is not enabled");
  const cuda_err e = cuda.event_record(ctx->cuda_ready[layer], stream);
  if (e != 0) {
    return fail(PSD_INTERNAL, "layer %u: cudaEventRecord on the training stream: %s", layer,
                cuda_error(e));
  }
  uint32_t scheme = 0;
  s = scheme_at(ctx, layer, iteration, &scheme);
  if (s != PSD_OK) return s;
  __atomic_store_n(&ctx->layers[layer].ready_iteration, iteration, __ATOMIC_RELEASE);
  return post_aux(ctx, PSD_EVENT_LAYER_READY, layer, iteration,
                  PSD_READY_AUX(PSD_READY_DEVICE, scheme));
}

PSD_EXPORT psd_status psd_cuda_wait_layer(psd_context* ctx, uint32_t layer, uint64_t iteration,
                                          uint32_t timeout_ms, void* stream) {
  psd_status s = psd_wait_layer(ctx, layer, iteration, timeout_ms);
  if (s != PSD_OK) return s;
  if (ctx->cuda_arena == NULL) return fail(PSD_FAILED_PRECONDITION, "CUDA is not enabled");
  const cuda_err e = cuda.stream_wait_event(stream, ctx->cuda_done[layer], 0);
  if (e != 0) {
    return fail(PSD_INTERNAL, "layer %u: cudaStreamWaitEvent on the agent's copy: %s", layer,
                cuda_error(e));
  }
  return PSD_OK;
}
