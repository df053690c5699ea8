// Validation of every field of every Coordinator request (sizes, counts, enums, empty strings,
// finite numbers): INVALID_ARGUMENT whose message starts with the field ("endpoints[1].address: ").
// Thread-safety: pure functions, safe from any thread.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "coordinator/store_limits.h"
#include "poseidon/v1/coordinator.pb.h"

namespace poseidon::coordinator {

// Limits on what a request may carry. They bound the coordinator's memory per node and per job,
// so a malicious or broken client cannot make it allocate without limit.
inline constexpr size_t kMaxIdBytes = 128;  // job ids, node ids, request ids
inline constexpr size_t kMaxTokenBytes = 4096;
inline constexpr size_t kMaxHostBytes = 255;
inline constexpr int kMaxEndpoints = 16;
inline constexpr size_t kMaxAddressBytes = 300;
inline constexpr uint32_t kMaxGpuIndex = 4095;
inline constexpr uint32_t kMaxWorldSize = 65536;  // planner::kMaxWorkers
inline constexpr int kMaxLinks = 4096;
// A running plan's servers (RegisterModelRequest.running_plan), and the servers that joined.
inline constexpr int kMaxPlanServers = 65536;
inline constexpr size_t kMaxReasonBytes = 1024;
inline constexpr int kMaxLayers = 100000;
inline constexpr size_t kMaxLayerNameBytes = 1024;
inline constexpr int kMaxShapeRank = 16;
inline constexpr size_t kMaxModelNameBytes = 256;
inline constexpr size_t kMaxDescriptionBytes = 64 * 1024;
inline constexpr uint32_t kMaxStaleness = 1000000;
inline constexpr uint64_t kMaxLatencyNs = uint64_t{3600} * 1000000000;  // an hour

// A job or node id: 1..kMaxIdBytes of [A-Za-z0-9._:-]. `what` names the field in the error.
absl::Status ValidateId(absl::string_view what, absl::string_view id);

// "host:port" or "[v6 address]:port", port in [1, 65535]. `what` names the field.
absl::Status ValidateHostPort(absl::string_view what, absl::string_view address);

// The header of any request: job_id empty (cluster scope) or an id; token at most
// kMaxTokenBytes (an empty token is left to authentication, which answers UNAUTHENTICATED);
// node_id empty or an id; request_id at most kMaxIdBytes.
absl::Status ValidateHeader(const poseidon::v1::RequestHeader& header);

// The rest of each request (not the header: ValidateHeader checks it before authentication).
// Requests of registered nodes (Rendezvous, RegisterModel, ReportTelemetry, Heartbeat, Deregister)
// need header.node_id.
absl::Status ValidateRequest(const poseidon::v1::RegisterServerRequest& request);
absl::Status ValidateRequest(const poseidon::v1::RegisterAgentRequest& request);
absl::Status ValidateRequest(const poseidon::v1::RendezvousRequest& request);
absl::Status ValidateRequest(const poseidon::v1::RegisterModelRequest& request);
absl::Status ValidateRequest(const poseidon::v1::GetPlanRequest& request);
absl::Status ValidateRequest(const poseidon::v1::ReportTelemetryRequest& request);
absl::Status ValidateRequest(const poseidon::v1::HeartbeatRequest& request);
absl::Status ValidateRequest(const poseidon::v1::DeregisterRequest& request);
absl::Status ValidateRequest(const poseidon::v1::GetClusterStatusRequest& request);
// job_id: an id, required with the cluster token (empty header.job_id); schemes: 1..kMaxLayers
// entries, names non-empty and at most kMaxLayerNameBytes, values known SyncSchemes; reason at
// most kMaxReasonBytes.
absl::Status ValidateRequest(const poseidon::v1::SetLayerSchemesRequest& request);
// The job's store (store_limits.h): header.job_id (the store is a job's) and header.node_id
// required; key 1..kMaxStoreKeyBytes, value at most kMaxStoreValueBytes; StoreGet 1..
// kMaxStoreGetKeys keys, each 1..kMaxStoreKeyBytes. Keys and values are bytes (any, not UTF-8).
absl::Status ValidateRequest(const poseidon::v1::StoreSetRequest& request);
absl::Status ValidateRequest(const poseidon::v1::StoreGetRequest& request);

// The model on its own ("model.layers[3].shape: ..."), including the planner's checks
// (ValidateModelSpec: unique names, known kinds, FC shapes [M, N], element types).
absl::Status ValidateModel(const poseidon::v1::ModelSpec& model);

}  // namespace poseidon::coordinator
