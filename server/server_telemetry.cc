#include "server/server_telemetry.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace poseidon::server {

namespace v1 = ::poseidon::v1;

ServerTelemetry::ServerTelemetry(Source source, absl::Duration interval, Send send,
                                 TransportOf transport_of, ReplicationOf replication_of)
    : source_(std::move(source)),
      interval_(interval),
      send_(std::move(send)),
      transport_of_(std::move(transport_of)),
      replication_of_(std::move(replication_of)),
      window_start_(absl::Now()) {}

ServerTelemetry::~ServerTelemetry() {
  Stop();
}

v1::ReportTelemetryRequest ServerTelemetry::Collect(absl::Time now) {
  std::lock_guard<std::mutex> lock(mu_);
  v1::ReportTelemetryRequest request;
  const uint64_t window_ns =
      static_cast<uint64_t>(std::max<int64_t>(1, absl::ToInt64Nanoseconds(now - window_start_)));
  window_start_ = now;
  request.set_window_ns(window_ns);
  const double seconds = static_cast<double>(window_ns) / 1e9;

  struct Row {
    const PeerTrafficTotals* totals;
    uint64_t received, sent;
  };
  const std::vector<PeerTrafficTotals> traffic =
      source_ ? source_() : std::vector<PeerTrafficTotals>{};
  std::map<std::pair<uint64_t, uint32_t>, std::pair<uint64_t, uint64_t>> next;
  std::vector<Row> rows;
  for (const PeerTrafficTotals& t : traffic) {
    const std::pair<uint64_t, uint32_t> key{t.job_id, t.rank};
    std::pair<uint64_t, uint64_t> prev{0, 0};
    if (const auto it = prev_.find(key); it != prev_.end()) prev = it->second;
    // Counters start again from 0 when a peer comes back after all its connections closed.
    if (t.received < prev.first || t.sent < prev.second) prev = {0, 0};
    if (t.connections > 0) next[key] = {t.received, t.sent};
    const Row row{&t, t.received - prev.first, t.sent - prev.second};
    if (t.connections > 0 || row.received > 0 || row.sent > 0) rows.push_back(row);
  }
  prev_ = std::move(next);
  if (rows.size() > kMaxLinks) {
    std::partial_sort(rows.begin(), rows.begin() + kMaxLinks, rows.end(),
                      [](const Row& a, const Row& b) {
                        return std::max(a.received, a.sent) > std::max(b.received, b.sent);
                      });
    rows.resize(kMaxLinks);
  }
  for (const Row& row : rows) {
    v1::LinkTelemetry* link = request.add_links();
    link->set_peer_job_id(absl::StrCat(row.totals->job_id));
    link->set_peer_rank(row.totals->rank);
    link->set_transport(transport_of_ ? transport_of_(row.totals->job_id, row.totals->rank)
                                      : v1::TRANSPORT_KIND_TCP);
    link->set_bytes(row.sent);
    link->set_received_bytes(row.received);
    link->set_window_ns(window_ns);
    link->set_bytes_per_second(static_cast<double>(std::max(row.sent, row.received)) / seconds);
  }
  if (replication_of_) {
    for (const ReplicationCounts& c : replication_of_()) {
      v1::ReplicationTelemetry* r = request.add_replication();
      r->set_job_id(absl::StrCat(c.job_id));
      r->set_primary_keys(c.primary_keys);
      r->set_backup_keys(c.backup_keys);
      r->set_degraded_keys(c.degraded_keys);
      r->set_replicating_keys(c.replicating_keys);
      r->set_max_backup_lag_clocks(c.max_backup_lag_clocks);
    }
  }
  return request;
}

void ServerTelemetry::Start() {
  if (!send_ || interval_ <= absl::ZeroDuration()) return;
  periodic_.Start(interval_, [this] {
    const absl::Duration timeout = std::min(interval_, absl::Seconds(2));
    outage_.Note(send_(Collect(absl::Now()), timeout), interval_);
  });
}

void ServerTelemetry::Stop() { periodic_.Stop(); }

}  // namespace poseidon::server
