#include "coordinator/planner/cost_model.h"

#include "absl/numeric/int128.h"
#include "proto/wire_type.h"

namespace poseidon::planner {

using poseidon::v1::LayerSpec;

SchemeVolume PsElements(uint64_t parameters, const ClusterShape& cluster) {
  const double s = static_cast<double>(parameters);
  const double p1 = cluster.workers;
  const double p2 = cluster.servers;
  SchemeVolume v;
  v.per_worker = 2 * s;
  v.per_server = 2 * p1 * s / p2;
  v.per_machine = 2 * s * (p1 + p2 - 2) / p2;
  return v;
}

SchemeVolume SfbElements(uint64_t m, uint64_t n, const ClusterShape& cluster) {
  const double peers = cluster.workers - 1.0;
  SchemeVolume v;
  v.per_worker = 2.0 * cluster.batch_per_worker * peers * (static_cast<double>(m) + n);
  v.per_server = 0;
  v.per_machine = v.per_worker;
  return v;
}

SchemeVolume AllreduceElements(uint64_t parameters, const ClusterShape& cluster) {
  const double s = static_cast<double>(parameters);
  const double p1 = cluster.workers;
  SchemeVolume v;
  v.per_worker = 4 * s * (p1 - 1) / p1;
  v.per_server = 0;
  v.per_machine = v.per_worker;
  return v;
}

bool SfbNoCostlierThanPs(uint64_t m, uint64_t n, const ClusterShape& cluster) {
  // Both sides divided by 2, in 128 bits: the planner's limits (M·N < 2^64, P1, P2 <= 2^16,
  // K <= 2^20) keep every product below 2^118.
  const absl::uint128 sfb =
      absl::uint128(cluster.batch_per_worker) * (cluster.workers - 1u) * (absl::uint128(m) + n);
  const absl::uint128 mn = absl::uint128(m) * n;
  if (cluster.colocated) {
    const uint64_t p1_plus_p2_minus_2 = uint64_t{cluster.workers} + cluster.servers - 2;
    return sfb * cluster.servers <= mn * p1_plus_p2_minus_2;
  }
  return sfb <= mn;
}

double ComparedVolume(const SchemeVolume& volume, bool colocated) {
  return colocated ? volume.per_machine : volume.per_worker;
}

namespace {

SchemeVolume Scale(SchemeVolume v, uint64_t element_bytes) {
  const double e = static_cast<double>(element_bytes);
  v.per_worker *= e;
  v.per_server *= e;
  v.per_machine *= e;
  return v;
}

}  // namespace

double WireCastSecondsPerElement(poseidon::v1::ElementType wire) {
  switch (wire) {
    case poseidon::v1::ELEMENT_TYPE_BF16:
      return kBf16CastSecondsPerElement;
    case poseidon::v1::ELEMENT_TYPE_F16:
      return kF16CastSecondsPerElement;
    default:
      return 0;
  }
}

bool IsLossyWire(poseidon::v1::ElementType wire) {
  const std::optional<WireType> type = WireFromProto(wire);
  return type.has_value() && IsLossy(*type);
}

const char* WireTypeName(poseidon::v1::ElementType wire) {
  const std::optional<WireType> type = WireFromProto(wire);
  return type.has_value() ? WireName(*type) : "?";
}

std::optional<poseidon::v1::ElementType> ParseWireType(std::string_view name) {
  if (name == "none") return poseidon::v1::ELEMENT_TYPE_F32;
  const std::optional<WireType> type = ParseWireName(name);
  if (!type.has_value()) return std::nullopt;
  return WireToProto(*type);
}

SchemeVolume ScaleVolume(SchemeVolume volume, uint64_t element_bytes) {
  return Scale(volume, element_bytes);
}

LayerCost CostOfLayer(const LayerSpec& layer, uint64_t element_bytes, const ClusterShape& cluster) {
  LayerCost cost;
  cost.element_bytes = element_bytes;
  cost.parameters = 1;
  for (const uint64_t d : layer.shape()) cost.parameters *= d;
  cost.ps_bytes = Scale(PsElements(cost.parameters, cluster), element_bytes);
  if (cluster.workers > 1) {
    cost.allreduce_bytes = Scale(AllreduceElements(cost.parameters, cluster), element_bytes);
  }
  if (layer.kind() == poseidon::v1::LAYER_KIND_FC && layer.shape_size() == 2) {
    const uint64_t m = layer.shape(0);
    const uint64_t n = layer.shape(1);
    cost.sfb_bytes = Scale(SfbElements(m, n, cluster), element_bytes);
    if (SfbNoCostlierThanPs(m, n, cluster)) cost.scheme = poseidon::v1::SYNC_SCHEME_SFB;
  }
  return cost;
}

}  // namespace poseidon::planner
