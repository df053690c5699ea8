#include "agent/telemetry_reporter.h"

#include <algorithm>
#include <utility>

#include "common/log.h"

namespace poseidon::agent {

namespace v1 = ::poseidon::v1;

namespace {

uint64_t Nanos(absl::Duration d) {
  return static_cast<uint64_t>(std::max<int64_t>(0, absl::ToInt64Nanoseconds(d)));
}

void RaiseTo(std::atomic<uint64_t>& max, uint64_t value) {
  uint64_t seen = max.load(std::memory_order_relaxed);
  while (value > seen && !max.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}

// Lowers `min` to `value`; 0 in `min` means none yet.
void LowerTo(std::atomic<uint64_t>& min, uint64_t value) {
  uint64_t seen = min.load(std::memory_order_relaxed);
  while ((seen == 0 || value < seen) &&
         !min.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}

}  // namespace

TelemetryReporter::TelemetryReporter(coordinator::CoordinatorClient* client,
                                     absl::Duration interval,
                                     std::vector<std::string> server_node_ids,
                                     std::vector<std::string> peer_node_ids, uint32_t rank,
                                     std::function<uint64_t()> iteration)
    : client_(client),
      interval_(interval),
      iteration_(std::move(iteration)),
      servers_(server_node_ids.size()),
      link_ids_(std::move(server_node_ids)) {
  for (size_t p = 0; p < peer_node_ids.size(); ++p) {
    link_ids_.push_back(p == rank ? std::string() : std::move(peer_node_ids[p]));
  }
  links_ = std::make_unique<LinkCounters[]>(link_ids_.size());
  prev_sent_.assign(link_ids_.size(), 0);
  prev_received_.assign(link_ids_.size(), 0);
  window_start_ = absl::Now();
}

TelemetryReporter::~TelemetryReporter() {
  Stop();
}

void TelemetryReporter::AddServerBytes(size_t server, uint64_t sent, uint64_t received) {
  if (server >= servers_) return;
  links_[server].sent.fetch_add(sent, std::memory_order_relaxed);
  links_[server].received.fetch_add(received, std::memory_order_relaxed);
}

void TelemetryReporter::AddServerTransfer(size_t server, uint64_t bytes, absl::Duration busy) {
  if (server >= servers_ || busy <= absl::ZeroDuration()) return;
  links_[server].transfers.store(true, std::memory_order_relaxed);
  const int64_t end = absl::ToUnixNanos(absl::Now());
  const int64_t start = end - absl::ToInt64Nanoseconds(busy);
  std::lock_guard<std::mutex> lock(capacity_mu_);
  // Busy time is the union of the transfers' intervals: concurrent pulls share the link.
  const int64_t from = std::max(start, busy_until_ns_);
  if (end > from) busy_ns_ += static_cast<uint64_t>(end - from);
  busy_until_ns_ = std::max(busy_until_ns_, end);
  capacity_bytes_ += bytes;
}

void TelemetryReporter::SetCapacityMinBytes(uint64_t min_bytes) {
  capacity_min_bytes_.store(min_bytes);
}

void TelemetryReporter::AddPeerBytes(uint32_t rank, uint64_t sent, uint64_t received) {
  const size_t link = servers_ + rank;
  if (link >= link_ids_.size()) return;
  links_[link].sent.fetch_add(sent, std::memory_order_relaxed);
  links_[link].received.fetch_add(received, std::memory_order_relaxed);
}

void TelemetryReporter::SetAllreduceStep(absl::Duration step) {
  allreduce_step_ns_.store(std::max<uint64_t>(1, static_cast<uint64_t>(absl::ToInt64Nanoseconds(step))),
                           std::memory_order_relaxed);
}

void TelemetryReporter::AddServerLatency(size_t server, absl::Duration round_trip) {
  if (server >= servers_) return;
  LowerTo(links_[server].min_rtt_ns, std::max<uint64_t>(1, Nanos(round_trip)));
}

void TelemetryReporter::SetServerTransport(size_t server, v1::TransportKind kind) {
  if (server >= servers_) return;
  links_[server].transport.store(kind, std::memory_order_relaxed);
}

void TelemetryReporter::SetPeerTransport(uint32_t rank, v1::TransportKind kind) {
  const size_t link = servers_ + rank;
  if (link >= link_ids_.size()) return;
  links_[link].transport.store(kind, std::memory_order_relaxed);
}

void TelemetryReporter::SetServerPing(ServerPing ping, int pings) {
  std::lock_guard<std::mutex> lock(ping_mu_);
  ping_ = std::move(ping);
  pings_ = std::max(pings, 0);
}

void TelemetryReporter::PingServers() {
  ServerPing ping;
  int pings = 0;
  {
    std::lock_guard<std::mutex> lock(ping_mu_);
    ping = ping_;
    pings = pings_;
  }
  if (!ping) return;
  const absl::Time deadline = absl::Now() + std::min(interval_ / 2, absl::Seconds(1));
  for (int i = 0; i < pings; ++i) {
    for (size_t s = 0; s < servers_; ++s) {
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) return;
      const absl::StatusOr<absl::Duration> round_trip = ping(s, left);
      if (round_trip.ok()) {
        AddServerLatency(s, *round_trip);
      } else {
        PSD_LOG_DEBUG("ping of KV server {} for telemetry: {}", s, round_trip.status().message());
      }
    }
  }
}

void TelemetryReporter::SetLayers(std::vector<std::string> names) {
  std::lock_guard<std::mutex> lock(mu_);
  if (layer_count_.load() != 0) return;  // once
  layers_ = std::make_unique<LayerCounters[]>(names.size());
  prev_syncs_.assign(names.size(), 0);
  prev_sync_ns_.assign(names.size(), 0);
  layer_names_ = std::move(names);
  layer_count_.store(layer_names_.size(), std::memory_order_release);
}

void TelemetryReporter::LayerReady(uint32_t layer, uint64_t iteration, absl::Time at) {
  if (layer >= layer_count_.load(std::memory_order_acquire)) return;
  LayerCounters& c = layers_[layer];
  c.ready_at_ns.store(absl::ToUnixNanos(at), std::memory_order_relaxed);
  c.ready_iteration.store(iteration, std::memory_order_release);
}

void TelemetryReporter::LayerSynced(uint32_t layer, uint64_t iteration, absl::Duration took) {
  if (layer >= layer_count_.load(std::memory_order_acquire)) return;
  LayerCounters& c = layers_[layer];
  const uint64_t ns = Nanos(took);
  c.sync_ns.fetch_add(ns, std::memory_order_relaxed);
  c.syncs.fetch_add(1, std::memory_order_relaxed);
  RaiseTo(c.window_max_ns, ns);
  c.synced_iteration.store(iteration, std::memory_order_release);
}

void TelemetryReporter::LayerWireFellBack(uint32_t layer) {
  if (layer >= layer_count_.load(std::memory_order_acquire)) return;
  layers_[layer].wire_fell_back.store(true, std::memory_order_relaxed);
}

v1::ReportTelemetryRequest TelemetryReporter::Collect(absl::Time now) {
  std::lock_guard<std::mutex> lock(mu_);
  v1::ReportTelemetryRequest request;
  const uint64_t window_ns = std::max<uint64_t>(1, Nanos(now - window_start_));
  window_start_ = now;
  request.set_window_ns(window_ns);
  request.set_allreduce_step_ns(allreduce_step_ns_.load(std::memory_order_relaxed));
  request.set_iteration(iteration_ ? iteration_() : 0);
  const double seconds = static_cast<double>(window_ns) / 1e9;
  double capacity = 0;  // this window's, over every server link; 0: none
  {
    std::lock_guard<std::mutex> capacity_lock(capacity_mu_);
    // At least min_bytes of large transfers, or the window says nothing about the capacity.
    if (busy_ns_ > 0 && capacity_bytes_ >= capacity_min_bytes_.load()) {
      capacity = static_cast<double>(capacity_bytes_) * 1e9 / static_cast<double>(busy_ns_);
    }
    capacity_bytes_ = 0;
    busy_ns_ = 0;
  }
  for (size_t i = 0; i < link_ids_.size(); ++i) {
    const uint64_t sent = links_[i].sent.load(std::memory_order_relaxed);
    const uint64_t received = links_[i].received.load(std::memory_order_relaxed);
    const uint64_t sent_window = sent - prev_sent_[i];
    const uint64_t received_window = received - prev_received_[i];
    prev_sent_[i] = sent;
    prev_received_[i] = received;
    if (link_ids_[i].empty()) continue;  // ourselves
    v1::LinkTelemetry* link = request.add_links();
    link->set_peer_node_id(link_ids_[i]);
    link->set_transport(
        static_cast<v1::TransportKind>(links_[i].transport.load(std::memory_order_relaxed)));
    link->set_bytes(sent_window);
    link->set_received_bytes(received_window);
    link->set_window_ns(window_ns);
    link->set_bytes_per_second(static_cast<double>(std::max(sent_window, received_window)) /
                               seconds);
    // The latency: the minimum over the recent windows that measured one.
    std::vector<uint64_t>& recent = links_[i].recent_rtt_ns;
    if (const uint64_t rtt = links_[i].min_rtt_ns.exchange(0, std::memory_order_relaxed); rtt > 0) {
      recent.push_back(rtt);
      if (recent.size() > kLatencyWindows) recent.erase(recent.begin());
    }
    link->set_latency_ns(recent.empty() ? 0 : *std::min_element(recent.begin(), recent.end()));
    if (links_[i].transfers.exchange(false, std::memory_order_relaxed) && capacity > 0) {
      link->set_capacity_bytes_per_second(capacity);
    }
  }
  const size_t layers = layer_count_.load(std::memory_order_acquire);
  const int64_t now_ns = absl::ToUnixNanos(now);
  for (size_t l = 0; l < layers; ++l) {
    LayerCounters& c = layers_[l];
    // Synced before ready: a sync completed between the two loads is counted in the next window.
    const uint64_t synced_iteration = c.synced_iteration.load(std::memory_order_acquire);
    const uint64_t ready_iteration = c.ready_iteration.load(std::memory_order_acquire);
    const uint64_t syncs_total = c.syncs.load(std::memory_order_relaxed);
    const uint64_t ns_total = c.sync_ns.load(std::memory_order_relaxed);
    const uint64_t max_ns = c.window_max_ns.exchange(0, std::memory_order_relaxed);
    const uint64_t syncs = syncs_total - prev_syncs_[l];
    const uint64_t ns = ns_total - prev_sync_ns_[l];
    prev_syncs_[l] = syncs_total;
    prev_sync_ns_[l] = ns_total;
    const bool waiting = ready_iteration > synced_iteration;
    const bool fell_back = c.wire_fell_back.load(std::memory_order_relaxed);
    if (syncs == 0 && !waiting && !fell_back) continue;
    v1::LayerTelemetry* layer = request.add_layers();
    layer->set_index(static_cast<uint32_t>(l));
    layer->set_name(layer_names_[l]);
    layer->set_syncs(syncs);
    if (fell_back) layer->set_wire_fell_back(true);
    if (syncs > 0) {
      layer->set_mean_sync_seconds(static_cast<double>(ns) / static_cast<double>(syncs) / 1e9);
      layer->set_max_sync_seconds(static_cast<double>(max_ns) / 1e9);
    }
    if (waiting) {
      layer->set_waiting_iteration(ready_iteration);
      const int64_t ready_at = c.ready_at_ns.load(std::memory_order_relaxed);
      layer->set_waiting_seconds(static_cast<double>(std::max<int64_t>(0, now_ns - ready_at)) /
                                 1e9);
    }
  }
  return request;
}

void TelemetryReporter::Start() {
  if (client_ == nullptr || interval_ <= absl::ZeroDuration()) return;
  periodic_.Start(interval_, [this] { Tick(); });
}

void TelemetryReporter::Stop() { periodic_.Stop(); }

void TelemetryReporter::Tick() {
  PingServers();
  const absl::Duration timeout = std::min(interval_, absl::Seconds(2));
  outage_.Note(client_->ReportTelemetry(Collect(absl::Now()), timeout), interval_);
}

}  // namespace poseidon::agent
