// libFuzzer target: every read the agent does of the shared-memory control segment that the
// training process writes (common/shm_layout.h, agent/shm_endpoint.h): the event ring
// (NextEvent), the server-side rule (ReadServerRule), the layer table (ReadLayers) and, for the
// layers it accepts, the buffer layout and the plan's validation (BuildLayerTable,
// agent/layer_table.h) and the CUDA attach request (ReadCudaAttach). (CheckFramework is not
// fuzzed: it reads the framework's pid once and then watches that process.) A real
// endpoint (ShmEndpoint::Create) is made once; the fuzzer maps its control segment a second time
// and writes each input into it, as a training process would. A crash, a sanitizer report, or an
// accepted result that breaks what the agent relies on (the CHECKs: buffers inside the data
// segment and disjoint, chunks inside their tensor, valid events) is a finding.
//
// Input (read in order; missing bytes are zeros):
//   the header image (sizeof(psd_shm_header) bytes, copied over the header as is)
//   u8 flags: 1 num_layers := the layer records given; 2 ring tail := head + the events given;
//             4 the CUDA request made consistent (state REQUESTED, arena bytes = data segment)
//   u64 ring head, u64 ring tail; u8 events (mod 16), then 32 bytes each, from slot head
//   u8 layer records (mod 65), then kLayerRecordBytes each (a psd_shm_layer's framework part)
//   the plan: u8 servers (mod 4), u8 options, u32 bucket_bytes, then per accepted layer u8
//   scheme, u8 chunks (mod 5), u8 server, u8 priority; then u8 mutations (mod 4), each u8 layer,
//   u8 chunk, u8 what, u64 value (a chunk's offset, length or server, or the layer's scheme)
//
// POSEIDON_WRITE_SEEDS=<dir> ./shm_fuzzer writes the seed corpus (committed in corpus/shm) and
// exits.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "agent/layer_table.h"
#include "agent/shm_endpoint.h"
#include "common/shm_layout.h"

namespace {

using namespace poseidon;         // NOLINT: a fuzzer's one translation unit
using namespace poseidon::agent;  // NOLINT

#define CHECK(cond)                                              \
  do {                                                           \
    if (!(cond)) {                                               \
      std::fprintf(stderr, "shm_fuzzer: CHECK failed: %s\n", #cond); \
      __builtin_trap();                                          \
    }                                                            \
  } while (0)

// The part of a psd_shm_layer the framework writes before registration (name .. shape).
constexpr size_t kLayerRecordBytes = offsetof(psd_shm_layer, scheme);
constexpr uint64_t kDataBytes = 64;  // the data segment made once for ReadCudaAttach

class Input {
 public:
  Input(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  void Bytes(void* out, size_t n) {
    const size_t have = std::min(n, size_ - pos_);
    std::memcpy(out, data_ + pos_, have);
    std::memset(static_cast<char*>(out) + have, 0, n - have);
    pos_ += have;
  }
  template <typename T>
  T Get() {
    T v{};
    Bytes(&v, sizeof(v));
    return v;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

struct Fixture {
  std::unique_ptr<ShmEndpoint> endpoint;
  unsigned char* control = nullptr;  // the segment as the framework maps it
  std::vector<uint32_t> dirty_slots;
  uint32_t dirty_layers = 0;
  psd_shm_header* header() const { return reinterpret_cast<psd_shm_header*>(control); }
  psd_shm_ring* ring() const {
    return reinterpret_cast<psd_shm_ring*>(control + PSD_SHM_TO_AGENT_OFFSET);
  }
  psd_shm_layer* layers() const {
    return reinterpret_cast<psd_shm_layer*>(control + PSD_SHM_LAYERS_OFFSET);
  }
};

Fixture* fixture = nullptr;
bool verbose = false;  // POSEIDON_FUZZ_VERBOSE=1: print what each read said (checking seeds)

void SetUp() {
  fixture = new Fixture;
  const std::string name = "/psd-shmfuzz-" + std::to_string(getpid());
  auto ep = ShmEndpoint::Create(name, 0, 1, 7);
  if (!ep.ok()) {
    std::fprintf(stderr, "shm_fuzzer: %s\n", std::string(ep.status().message()).c_str());
    std::abort();
  }
  fixture->endpoint = *std::move(ep);
  // A registered endpoint of one layer, so that ReadCudaAttach gets past its first check.
  LayerDesc desc;
  desc.name = "l";
  desc.kind = PSD_KIND_OTHER;
  desc.shape = {16};
  desc.elements = 16;
  if (!fixture->endpoint->PublishLayout({desc}, {LayerLayout{}}, kDataBytes).ok()) std::abort();
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) std::abort();
  void* p = mmap(nullptr, PSD_SHM_CONTROL_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) std::abort();
  fixture->control = static_cast<unsigned char*>(p);
  // Nothing is left in /dev/shm however the fuzzer ends (the mappings keep the memory).
  shm_unlink(name.c_str());
  shm_unlink((name + ".data").c_str());
}

// Writes the input's image into the segment (after clearing what the previous one wrote).
struct Image {
  uint8_t flags = 0;
  uint64_t head = 0;
  uint32_t events = 0;
  uint32_t records = 0;
};

Image WriteImage(Input& in) {
  Fixture& f = *fixture;
  Image im;
  std::memset(f.header(), 0, sizeof(psd_shm_header));
  for (const uint32_t slot : f.dirty_slots) f.ring()->events[slot] = psd_shm_event{};
  f.dirty_slots.clear();
  std::memset(f.layers(), 0, sizeof(psd_shm_layer) * f.dirty_layers);
  in.Bytes(f.header(), sizeof(psd_shm_header));
  im.flags = in.Get<uint8_t>();
  im.head = in.Get<uint64_t>();
  uint64_t tail = in.Get<uint64_t>();
  im.events = in.Get<uint8_t>() % 16;
  for (uint32_t j = 0; j < im.events; ++j) {
    const uint32_t slot = static_cast<uint32_t>((im.head + j) % PSD_SHM_RING_CAPACITY);
    in.Bytes(&f.ring()->events[slot], sizeof(psd_shm_event));
    f.dirty_slots.push_back(slot);
  }
  if (im.flags & 2) tail = im.head + im.events;
  f.ring()->head = im.head;
  f.ring()->tail = tail;
  f.ring()->doorbell = 0;
  f.ring()->consumer_sleeping = 0;
  im.records = in.Get<uint8_t>() % 65;
  for (uint32_t i = 0; i < im.records; ++i) in.Bytes(&f.layers()[i], kLayerRecordBytes);
  f.dirty_layers = im.records;
  if (im.flags & 1) f.header()->num_layers = im.records;
  if (im.flags & 4) {
    f.header()->cuda_state = PSD_CUDA_REQUESTED;
    f.header()->cuda_arena_bytes = kDataBytes;
  }
  return im;
}

// ---- The reads and what their accepted results must satisfy ----------------------------------

void CheckEvents(const Image& im) {
  Fixture& f = *fixture;
  for (uint32_t j = 0; j <= im.events; ++j) {
    const uint64_t head = f.ring()->head, tail = f.ring()->tail;
    auto e = f.endpoint->NextEvent(absl::ZeroDuration());
    if (verbose) {
      std::fprintf(stderr, "NextEvent: %s %u\n", e.status().ToString().c_str(),
                   e.ok() && e->has_value() ? (*e)->type : 0u);
    }
    const uint64_t new_head = f.ring()->head;
    if (!e.ok()) {
      // A malformed event is consumed; corrupt indices skip to the tail.
      CHECK(new_head == head + 1 || new_head == tail);
      continue;
    }
    if (!e->has_value()) {
      CHECK(head == tail && new_head == head);
      break;
    }
    const Event& ev = **e;
    CHECK(new_head == head + 1 && tail - head <= PSD_SHM_RING_CAPACITY && tail > head);
    CHECK(ev.type == PSD_EVENT_REGISTER || ev.type == PSD_EVENT_LAYER_READY ||
          ev.type == PSD_EVENT_DETACH || ev.type == PSD_EVENT_CUDA_ATTACH);
    if (ev.type == PSD_EVENT_LAYER_READY) {
      CHECK(ev.location == PSD_READY_HOST || ev.location == PSD_READY_DEVICE);
      CHECK(ev.scheme == 0 || ev.scheme == PSD_SCHEME_PS || ev.scheme == PSD_SCHEME_SFB ||
            ev.scheme == PSD_SCHEME_ALLREDUCE);
    }
  }
}

void CheckDescs(const std::vector<LayerDesc>& descs) {
  CHECK(!descs.empty() && descs.size() <= PSD_SHM_MAX_LAYERS);
  CHECK(descs.size() == fixture->header()->num_layers);
  for (const LayerDesc& d : descs) {
    CHECK(!d.name.empty() && d.name.size() < PSD_SHM_NAME_BYTES);
    CHECK(d.name.find('\0') == std::string::npos);
    CHECK(d.kind >= PSD_KIND_FC && d.kind <= PSD_KIND_OTHER);
    CHECK(!d.shape.empty() && d.shape.size() <= PSD_SHM_MAX_DIMS);
    uint64_t elements = 1;
    for (const uint64_t s : d.shape) {
      CHECK(s > 0 && s <= (uint64_t{1} << 32));
      CHECK(!__builtin_mul_overflow(elements, s, &elements));
    }
    CHECK(elements == d.elements && elements <= (uint64_t{1} << 34));
    if (d.kind == PSD_KIND_FC) {
      CHECK(d.shape.size() == 2 && d.batch_k > 0 && d.batch_k <= (1u << 20));
    }
  }
}

// A plan for the layers the agent accepted, shaped by the input (and then possibly broken).
v1::Plan MakePlan(Input& in, const std::vector<LayerDesc>& descs, LayerTableOptions* options) {
  v1::Plan plan;
  const uint32_t servers = in.Get<uint8_t>() % 4;
  for (uint32_t s = 0; s < servers; ++s) plan.add_servers()->set_node_id("s" + std::to_string(s));
  const uint8_t o = in.Get<uint8_t>();
  options->world_size = 1 + (o & 3);
  options->sfb_possible = (o & 4) != 0;
  options->force_sfb = (o & 8) != 0;
  options->allreduce_possible = (o & 16) != 0;
  options->force_allreduce = (o & 32) != 0;
  options->bucket_bytes = (o & 64) ? in.Get<uint32_t>() : 0;
  for (size_t i = 0; i < descs.size(); ++i) {
    v1::LayerPlan* l = plan.add_layers();
    l->set_layer_index(static_cast<uint32_t>(i));
    l->set_scheme(static_cast<v1::SyncScheme>(in.Get<uint8_t>() % 4));
    const uint32_t chunks = in.Get<uint8_t>() % 5;
    const uint32_t server = in.Get<uint8_t>();
    l->set_priority(in.Get<uint8_t>());
    // Split into `chunks` pieces of whole floats (fewer when the layer is small).
    const uint64_t elements = descs[i].elements;
    const uint64_t per = std::max<uint64_t>(1, elements / std::max<uint32_t>(chunks, 1));
    for (uint64_t at = 0, c = 0; c < chunks && at < elements; ++c) {
      const uint64_t n = c + 1 == chunks ? elements - at : std::min(per, elements - at);
      auto* chunk = l->add_chunks();
      chunk->set_key((uint64_t{i} << 8) | c);
      chunk->set_offset(at * 4);
      chunk->set_length(n * 4);
      chunk->set_server_index(servers == 0 ? 0 : server % servers);
      at += n;
    }
  }
  const uint32_t mutations = in.Get<uint8_t>() % 4;
  for (uint32_t m = 0; m < mutations; ++m) {
    v1::LayerPlan* l = plan.mutable_layers(in.Get<uint8_t>() % plan.layers_size());
    const uint8_t c = in.Get<uint8_t>();
    const uint8_t what = in.Get<uint8_t>() % 4;
    const uint64_t value = in.Get<uint64_t>();
    if (what == 3) {
      l->set_scheme(static_cast<v1::SyncScheme>(value % 8));
    } else if (l->chunks_size() > 0) {
      auto* chunk = l->mutable_chunks(c % l->chunks_size());
      if (what == 0) chunk->set_offset(value);
      if (what == 1) chunk->set_length(value);
      if (what == 2) chunk->set_server_index(static_cast<uint32_t>(value));
    }
  }
  if (in.Get<uint8_t>() & 1) plan.add_layers();  // a plan for another model
  return plan;
}

struct Range {
  uint64_t begin, end;
};

void CheckTable(const std::vector<LayerDesc>& descs, const v1::Plan& plan,
                const LayerTableOptions& options, const LayerTable& table) {
  CHECK(table.layers.size() == descs.size());
  CHECK(table.data_bytes >= kBufferAlign && table.data_bytes <= kMaxDataBytes);
  std::vector<Range> buffers;
  const auto inside = [&](uint64_t offset, uint64_t bytes) {
    CHECK(offset % kBufferAlign == 0);
    CHECK(offset <= table.data_bytes && bytes <= table.data_bytes - offset);
    if (bytes > 0) buffers.push_back({offset, offset + bytes});
  };
  const uint32_t servers = static_cast<uint32_t>(std::max(plan.servers_size(), 1));
  for (size_t i = 0; i < table.layers.size(); ++i) {
    const LayerSpec& st = table.layers[i];
    const uint64_t bytes = st.desc.elements * 4;
    CHECK(st.desc.name == descs[i].name && st.desc.elements == descs[i].elements);
    inside(st.layout.grad_offset, bytes);
    CHECK(st.layout.sfb_buffers == st.sfb_capable);
    if (st.sfb_capable) {
      CHECK(st.desc.kind == PSD_KIND_FC && options.sfb_possible);
      CHECK(st.m == st.desc.shape[0] && st.n == st.desc.shape[1] && st.k == st.desc.batch_k);
      inside(st.layout.u_offset, st.k * st.m * 4);
      inside(st.layout.v_offset, st.k * st.n * 4);
    }
    const uint32_t scheme = st.layout.scheme;
    CHECK(scheme == PSD_SCHEME_PS || scheme == PSD_SCHEME_SFB || scheme == PSD_SCHEME_ALLREDUCE);
    if (scheme == PSD_SCHEME_SFB) CHECK(st.sfb_capable);
    if (scheme == PSD_SCHEME_PS) CHECK(!st.chunks.empty());
    if (scheme == PSD_SCHEME_ALLREDUCE) CHECK(options.allreduce_possible);
    for (const PsChunk& c : st.chunks) {
      CHECK(c.length > 0 && c.length % 4 == 0);
      CHECK(c.offset <= bytes && c.length <= bytes - c.offset);
      CHECK(c.server < servers);
    }
  }
  // No two buffers share a byte.
  std::sort(buffers.begin(), buffers.end(),
            [](const Range& a, const Range& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < buffers.size(); ++i) CHECK(buffers[i - 1].end <= buffers[i].begin);
  for (size_t b = 0; b < table.buckets.size(); ++b) {
    const BucketSpec& bucket = table.buckets[b];
    CHECK(bucket.members.size() >= 2 && options.bucket_bytes > 0);
    for (size_t j = 0; j < bucket.members.size(); ++j) {
      const uint32_t m = bucket.members[j];
      CHECK(m < table.layers.size());
      if (j > 0) CHECK(m == bucket.members[j - 1] + 1);
      const LayerSpec& st = table.layers[m];
      CHECK(st.bucket == static_cast<int>(b) && st.desc.fusable);
      CHECK(st.layout.scheme == PSD_SCHEME_PS && st.chunks.size() == 1);
    }
    const LayerSpec& first = table.layers[bucket.members.front()];
    const LayerSpec& last = table.layers[bucket.members.back()];
    const uint64_t end = last.layout.grad_offset + last.desc.elements * 4;
    CHECK(bucket.chunk.offset == 0 && bucket.chunk.length == end - first.layout.grad_offset);
    CHECK(bucket.chunk.length <= options.bucket_bytes);
    CHECK(end <= table.data_bytes && bucket.chunk.server < servers);
  }
  for (const LayerSpec& st : table.layers) {
    if (st.bucket >= 0) CHECK(static_cast<size_t>(st.bucket) < table.buckets.size());
  }
}

void CheckRegistration(Input& in) {
  auto rule = fixture->endpoint->ReadServerRule();
  if (verbose) std::fprintf(stderr, "ReadServerRule: %s\n", rule.status().ToString().c_str());
  if (rule.ok()) {
    CHECK(rule->rule == 0 || rule->rule == 2 || rule->rule == 3 || rule->rule == 4);
  }
  auto descs = fixture->endpoint->ReadLayers();
  if (verbose) std::fprintf(stderr, "ReadLayers: %s\n", descs.status().ToString().c_str());
  if (!descs.ok()) return;
  CheckDescs(*descs);
  LayerTableOptions options;
  const v1::Plan plan = MakePlan(in, *descs, &options);
  auto table = BuildLayerTable(*descs, plan, options);
  if (verbose) {
    std::fprintf(stderr, "BuildLayerTable: %s (%zu buckets)\n", table.status().ToString().c_str(),
                 table.ok() ? table->buckets.size() : 0);
  }
  if (table.ok()) CheckTable(*descs, plan, options, *table);
}

void CheckCuda() {
  auto attach = fixture->endpoint->ReadCudaAttach();
  if (verbose) std::fprintf(stderr, "ReadCudaAttach: %s\n", attach.status().ToString().c_str());
  if (!attach.ok()) return;
  CHECK(attach->device >= 0 && attach->arena_bytes == kDataBytes);
  CHECK(attach->arena_bytes == fixture->endpoint->data_bytes());
  CHECK(attach->ready_events.size() == 1);
}

// ---- The seed corpus ---------------------------------------------------------------------------

class SeedWriter {
 public:
  template <typename T>
  SeedWriter& Put(const T& v) {
    const auto* p = reinterpret_cast<const char*>(&v);
    bytes_.insert(bytes_.end(), p, p + sizeof(T));
    return *this;
  }
  void Save(const std::string& path) const {
    std::ofstream(path, std::ios::binary).write(bytes_.data(),
                                                static_cast<std::streamsize>(bytes_.size()));
  }

 private:
  std::vector<char> bytes_;
};

psd_shm_layer LayerRecord(const char* name, uint32_t kind, std::vector<uint64_t> shape,
                          uint32_t k, uint32_t flags) {
  psd_shm_layer l{};
  std::snprintf(l.name, sizeof(l.name), "%s", name);
  l.kind = kind;
  l.dtype = PSD_DTYPE_F32;
  l.ndim = static_cast<uint32_t>(shape.size());
  l.batch_k = k;
  l.flags = flags;
  for (size_t i = 0; i < shape.size(); ++i) l.shape[i] = shape[i];
  return l;
}

void WriteSeeds(const std::string& dir) {
  struct Seed {
    std::string name;
    uint32_t rule;
    std::vector<psd_shm_layer> layers;
    std::vector<psd_shm_event> events;
    uint8_t servers, options, chunks;
    std::vector<uint8_t> schemes;  // per layer
  };
  const std::vector<psd_shm_layer> mlp = {
      LayerRecord("fc1.weight", PSD_KIND_FC, {256, 784}, 32, 0),
      LayerRecord("fc1.bias", PSD_KIND_BIAS, {256}, 0, 1),
      LayerRecord("fc2.weight", PSD_KIND_FC, {10, 256}, 32, 0),
      LayerRecord("fc2.bias", PSD_KIND_BIAS, {10}, 0, 1),
      LayerRecord("bn.weight", PSD_KIND_OTHER, {10}, 0, 1),
  };
  const std::vector<psd_shm_layer> conv = {
      LayerRecord("conv1.weight", PSD_KIND_CONV, {64, 3, 7, 7}, 0, 0),
      LayerRecord("conv1.bias", PSD_KIND_BIAS, {64}, 0, 1),
  };
  const std::vector<psd_shm_event> events = {
      {PSD_EVENT_REGISTER, 0, 0, 0, 0, 0},
      {PSD_EVENT_LAYER_READY, 1, 1, 0, 0, PSD_READY_AUX(PSD_READY_HOST, PSD_SCHEME_PS)},
      {PSD_EVENT_LAYER_READY, 0, 1, 0, 0, PSD_READY_AUX(PSD_READY_DEVICE, PSD_SCHEME_SFB)},
      {PSD_EVENT_CUDA_ATTACH, 0, 0, 0, 0, 0},
      {PSD_EVENT_DETACH, 0, 0, 0, 0, 0},
  };
  const std::vector<Seed> seeds = {
      {"mlp-ps", 0, mlp, events, 1, 0, 2, {1, 1, 1, 1, 1}},
      {"mlp-sfb-buckets", 0, mlp, {}, 2, 4 | 64 | 1, 1, {2, 1, 2, 1, 1}},
      {"mlp-allreduce", 0, mlp, {}, 0, 16 | 3, 0, {3, 3, 3, 3, 3}},
      {"conv-adam", 4, conv, events, 3, 0, 3, {1, 1}},
  };
  for (const Seed& s : seeds) {
    psd_shm_header h{};
    h.num_layers = static_cast<uint32_t>(s.layers.size());
    h.server_rule = s.rule;
    h.server_lr = 0.01;
    h.server_beta1 = 0.9;
    h.server_beta2 = 0.999;
    h.server_eps = 1e-8;
    h.cuda_state = PSD_CUDA_REQUESTED;
    h.cuda_arena_bytes = kDataBytes;
    SeedWriter w;
    w.Put(h).Put(uint8_t{1 | 2 | 4}).Put(uint64_t{4090}).Put(uint64_t{0});
    w.Put(static_cast<uint8_t>(s.events.size()));
    for (const psd_shm_event& e : s.events) w.Put(e);
    w.Put(static_cast<uint8_t>(s.layers.size()));
    for (const psd_shm_layer& l : s.layers) {
      const auto* p = reinterpret_cast<const char*>(&l);
      for (size_t i = 0; i < kLayerRecordBytes; ++i) w.Put(p[i]);
    }
    w.Put(s.servers).Put(s.options);
    if (s.options & 64) w.Put(uint32_t{8192});
    for (const uint8_t scheme : s.schemes) {
      w.Put(scheme).Put(s.chunks).Put(uint8_t{1}).Put(uint8_t{0});
    }
    w.Put(uint8_t{0}).Put(uint8_t{0});
    w.Save(dir + "/" + s.name);
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (const char* dir = std::getenv("POSEIDON_WRITE_SEEDS")) {
    WriteSeeds(dir);
    std::exit(0);
  }
  verbose = std::getenv("POSEIDON_FUZZ_VERBOSE") != nullptr;
  SetUp();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Input in(data, size);
  const Image im = WriteImage(in);
  (void)fixture->endpoint->attached();
  CheckEvents(im);
  CheckCuda();
  CheckRegistration(in);
  return 0;
}
