#include "agent/layer_table.h"

#include "absl/strings/str_cat.h"
#include "proto/wire_type.h"

namespace poseidon::agent {
namespace {

uint64_t AlignUp(uint64_t x) {
  return (x + kBufferAlign - 1) / kBufferAlign * kBufferAlign;
}

}  // namespace

const char* SchemeName(uint32_t scheme) {
  return scheme == PSD_SCHEME_SFB         ? "SFB"
         : scheme == PSD_SCHEME_PS        ? "PS"
         : scheme == PSD_SCHEME_ALLREDUCE ? "all-reduce"
                                          : "unknown";
}

bool SfbCapable(const LayerDesc& desc, bool planned_sfb) {
  if (desc.kind != PSD_KIND_FC || desc.shape.size() != 2 || desc.batch_k == 0) return false;
  if (planned_sfb) return true;
  const uint64_t m = desc.shape[0], n = desc.shape[1], k = desc.batch_k;
  return k * (m + n) <= m * n;
}

absl::StatusOr<LayerTable> BuildLayerTable(const std::vector<LayerDesc>& descs,
                                           const v1::Plan& plan, const LayerTableOptions& options) {
  if (plan.layers_size() != static_cast<int>(descs.size())) {
    return absl::InternalError(absl::StrCat("the plan covers ", plan.layers_size(), " layers, the ",
                                            "framework registered ", descs.size()));
  }
  LayerTable table;
  table.layers.resize(descs.size());
  uint64_t offset = 0;
  for (size_t i = 0; i < descs.size(); ++i) {
    const v1::LayerPlan& lp = plan.layers(static_cast<int>(i));
    LayerSpec& st = table.layers[i];
    st.desc = descs[i];
    bool sfb = lp.scheme() == v1::SYNC_SCHEME_SFB;
    if (options.force_sfb && descs[i].kind == PSD_KIND_FC) sfb = true;
    if (options.force_allreduce || descs[i].by_servers) sfb = false;
    if (sfb && (descs[i].kind != PSD_KIND_FC || !options.sfb_possible)) {
      return absl::InternalError(
          absl::StrCat("the plan puts layer ", descs[i].name, " on SFB, which it cannot run"));
    }
    st.sfb_capable = options.sfb_possible && !descs[i].by_servers && SfbCapable(descs[i], sfb);
    // A plan's all-reduce where the job cannot run it (a scheme forced to PS, a server-side
    // rule, a layer that goes by the servers) is PS: every rank of the job has the same
    // options and layers, so all of them fall back alike.
    st.allreduce_capable = options.allreduce_possible && !descs[i].by_servers;
    const bool allreduce = !sfb && st.allreduce_capable &&
                           (options.force_allreduce || lp.scheme() == v1::SYNC_SCHEME_ALLREDUCE);
    if (options.force_wire.has_value()) {
      st.wire = *options.force_wire;
    } else {
      const std::optional<WireType> planned = WireFromProto(lp.wire_type());
      if (!planned.has_value()) {
        return absl::InternalError(absl::StrCat("the plan gives layer ", descs[i].name,
                                                " wire type ", static_cast<int>(lp.wire_type()),
                                                " (float32, bfloat16 or float16 expected)"));
      }
      st.wire = options.lossy_possible ? *planned : WireType::kF32;
    }
    const uint32_t lowrank = options.force_lowrank.value_or(lp.lowrank_rank());
    if (allreduce && options.lossy_possible &&
        LowRankPays(descs[i].shape, lowrank, &st.lowrank_view) &&
        st.lowrank_view.rows * st.lowrank_view.cols == descs[i].elements) {
      st.lowrank = lowrank;
    }
    LayerLayout& lay = st.layout;
    lay.scheme = sfb ? PSD_SCHEME_SFB : allreduce ? PSD_SCHEME_ALLREDUCE : PSD_SCHEME_PS;
    lay.priority = lp.priority();
    lay.grad_offset = offset;
    offset = AlignUp(offset + descs[i].elements * sizeof(float));
    if (st.sfb_capable) {
      lay.sfb_buffers = true;
      st.m = descs[i].shape[0];
      st.n = descs[i].shape[1];
      st.k = descs[i].batch_k;
      lay.u_offset = offset;
      offset = AlignUp(offset + st.k * st.m * sizeof(float));
      lay.v_offset = offset;
      offset = AlignUp(offset + st.k * st.n * sizeof(float));
    }
    for (const auto& c : lp.chunks()) {
      if (c.length() == 0 || c.length() % sizeof(float) != 0 ||
          c.offset() + c.length() > descs[i].elements * sizeof(float) ||
          c.offset() + c.length() < c.offset()) {
        return absl::InternalError(absl::StrCat("bad chunk of layer ", descs[i].name, ": [",
                                                c.offset(), ", +", c.length(), ")"));
      }
      if (c.server_index() >= static_cast<uint32_t>(std::max(plan.servers_size(), 1))) {
        return absl::InternalError(absl::StrCat("a chunk of layer ", descs[i].name,
                                                " is on server ", c.server_index(), " of ",
                                                plan.servers_size()));
      }
      st.chunks.push_back({c.key(), c.offset(), c.length(), c.server_index()});
    }
    if (lay.scheme == PSD_SCHEME_PS && st.chunks.empty()) {
      return absl::InternalError(absl::StrCat("layer ", descs[i].name, " has no PS chunks"));
    }
    // Sizes come from the training process: refuse a layout that cannot be mapped rather than
    // let offsets wrap around (a layer adds at most ~2^55 bytes: this check cannot overflow).
    if (offset > kMaxDataBytes) {
      return absl::ResourceExhaustedError(absl::StrCat("the layers' buffers need more than ",
                                                       kMaxDataBytes, " bytes (at layer ", i, ", ",
                                                       descs[i].name, ")"));
    }
  }
  table.data_bytes = std::max<uint64_t>(offset, kBufferAlign);
  if (options.fusion_from_plan) {
    std::vector<uint32_t> plan_buckets;
    plan_buckets.reserve(descs.size());
    for (const v1::LayerPlan& lp : plan.layers()) plan_buckets.push_back(lp.bucket());
    table.buckets = FormBuckets(table.layers, plan.max_chunk_bytes(), &plan_buckets);
  } else {
    table.buckets = FormBuckets(table.layers, options.bucket_bytes);
  }
  table.ring_groups = FormRingGroups(table.layers, options.allreduce_bucket_bytes);
  return table;
}

namespace {

// A run of consecutive layers fused into one buffer span: [start, end) of the data segment.
struct LayerRun {
  std::vector<uint32_t> members;
  uint64_t start = 0, end = 0;
};

// The runs of at least two consecutive layers that `member` accepts (each smaller than `bytes`),
// adjacent in the data segment (nothing but alignment between them: an SFB-capable layer's
// factors sit between it and the next gradient, so it ends a run), on one wire, spanning at most
// `bytes`, where `joins(previous, next)` holds between neighbours.
template <typename Member, typename Joins>
std::vector<LayerRun> AdjacentRuns(const std::vector<LayerSpec>& layers, uint64_t bytes,
                                   Member member, Joins joins) {
  std::vector<LayerRun> runs;
  if (bytes == 0) return runs;
  LayerRun run;
  auto close = [&] {
    if (run.members.size() >= 2) runs.push_back(run);
    run.members.clear();
  };
  for (uint32_t i = 0; i < layers.size(); ++i) {
    const LayerSpec& st = layers[i];
    const uint64_t size = st.desc.elements * sizeof(float);
    if (!st.desc.fusable || size >= bytes || !member(i)) {
      close();
      continue;
    }
    const uint64_t start = st.layout.grad_offset;
    if (!run.members.empty() &&
        (start != AlignUp(run.end) || start + size - run.start > bytes ||
         layers[run.members.back()].wire != st.wire || !joins(run.members.back(), i))) {
      close();
    }
    if (run.members.empty()) run.start = start;
    run.members.push_back(i);
    run.end = start + size;
  }
  close();
  return runs;
}

std::string RunName(const char* what, const std::vector<LayerSpec>& layers, const LayerRun& run) {
  return absl::StrCat(what, " ", layers[run.members.front()].desc.name, " .. ",
                      layers[run.members.back()].desc.name);
}

}  // namespace

std::vector<RingGroupSpec> FormRingGroups(std::vector<LayerSpec>& layers, uint64_t bytes) {
  std::vector<RingGroupSpec> groups;
  const auto runs = AdjacentRuns(
      layers, bytes, [&](uint32_t i) { return layers[i].layout.scheme == PSD_SCHEME_ALLREDUCE; },
      [](uint32_t, uint32_t) { return true; });
  for (const LayerRun& run : runs) {
    for (uint32_t l : run.members) layers[l].ring_group = static_cast<int>(groups.size());
    groups.push_back({run.members, run.end - run.start, RunName("all-reduce bucket", layers, run)});
  }
  return groups;
}

std::vector<BucketSpec> FormBuckets(std::vector<LayerSpec>& layers, uint64_t bucket_bytes,
                                    const std::vector<uint32_t>* plan_buckets) {
  std::vector<BucketSpec> buckets;
  auto planned = [&](uint32_t i) { return plan_buckets != nullptr ? (*plan_buckets)[i] : 1u; };
  const auto runs = AdjacentRuns(
      layers, bucket_bytes,
      [&](uint32_t i) {
        return layers[i].layout.scheme == PSD_SCHEME_PS && layers[i].chunks.size() == 1 &&
               planned(i) != 0;
      },
      // Never across two of the plan's buckets, nor between an averaged layer and a summed one
      // (a bucket is one key: averaged or not).
      [&](uint32_t previous, uint32_t next) {
        return planned(previous) == planned(next) &&
               layers[previous].desc.average == layers[next].desc.average &&
               layers[previous].desc.counters == layers[next].desc.counters;
      });
  for (const LayerRun& run : runs) {
    BucketSpec b;
    b.members = run.members;
    b.chunk.key =
        (uint64_t{1} << 63) | (uint64_t{run.members.front()} << 32) | run.members.size();
    b.chunk.offset = 0;
    b.chunk.length = run.end - run.start;
    b.chunk.server = layers[run.members.front()].chunks[0].server;
    b.name = RunName("bucket", layers, run);
    b.wire = layers[run.members.front()].wire;
    for (uint32_t l : run.members) layers[l].bucket = static_cast<int>(buckets.size());
    buckets.push_back(std::move(b));
  }
  return buckets;
}

Schedule Schedule::Unpack(uint64_t word) {
  return {static_cast<uint32_t>(word & 0xff), static_cast<uint32_t>((word >> 8) & 0xff),
          word >> 16};
}

ScheduleChange ComposeSchedule(const LayerSpec& layer, const Schedule& current, uint32_t scheme,
                               uint64_t switch_at, uint64_t next_post) {
  ScheduleChange change;
  change.schedule = current;
  auto refuse = [&](std::string why) {
    change.outcome = ScheduleChange::kRefused;
    change.why = std::move(why);
    return change;
  };
  if (scheme != PSD_SCHEME_PS && scheme != PSD_SCHEME_SFB && scheme != PSD_SCHEME_ALLREDUCE) {
    return refuse(absl::StrCat("unknown scheme ", scheme));
  }
  if (scheme == PSD_SCHEME_ALLREDUCE && !layer.allreduce_capable) {
    return refuse("all-reduce is off for this job (one rank, no coordinator for the "
                  "rendezvous, a server-side update rule, or the scheme forced)");
  }
  if (scheme == PSD_SCHEME_SFB && !layer.sfb_capable) {
    return refuse("it has no SFB buffers (not an FC layer with factors no larger than its "
                  "gradient, or SFB is off for this job)");
  }
  if (scheme != PSD_SCHEME_PS && layer.bucket >= 0) {
    return refuse("it is fused into a bucket, which stays on PS");
  }
  if (scheme != PSD_SCHEME_ALLREDUCE && layer.ring_group >= 0) {
    return refuse("it is fused into an all-reduce bucket, which stays on all-reduce");
  }
  if (scheme != PSD_SCHEME_ALLREDUCE && layer.lowrank > 0) {
    return refuse("it is sent at low rank, which stays on all-reduce (its residual is there)");
  }
  if (scheme == PSD_SCHEME_PS && layer.chunks.empty()) {
    return refuse("the plan gave it no PS chunks");
  }
  // Nothing to do for a layer that runs `scheme` from next_post on already (however late the
  // plan comes: it changes nothing here).
  const bool settled = current.switch_at <= next_post || current.before == current.after;
  if (settled && current.At(next_post) == scheme) {
    change.changed = false;
    return change;
  }
  // Iterations up to next_post keep their scheme (the framework may have read it).
  if (switch_at <= next_post) {
    return refuse(absl::StrCat("too late: the switch to ", SchemeName(scheme), " at iteration ",
                               switch_at, " comes after this rank reached iteration ",
                               next_post));
  }
  // The schedule must be one scheme over [next_post, switch_at): a switch of the current
  // schedule inside that range is still to come.
  if (current.switch_at > next_post && current.switch_at < switch_at &&
      current.before != current.after) {
    change.outcome = ScheduleChange::kDefer;
    return change;
  }
  const uint32_t base = current.At(switch_at - 1);
  change.schedule = {base, scheme, switch_at};
  // The same schemes before and after: an equivalent schedule that needs no publication unless
  // it cancels a pending switch at or after switch_at.
  if (base == scheme && (current.switch_at <= next_post || current.before == current.after)) {
    change.schedule = current;
    change.changed = false;
    return change;
  }
  change.changed = true;
  return change;
}

}  // namespace poseidon::agent
