// Prometheus metrics for Poseidon processes: a MetricsRegistry context object (passed in, never a
// global) with get-or-create helpers, and a MetricsExposer serving a registry over HTTP /metrics.
// Thread-safety: all of it is safe from any thread (prometheus-cpp locks; metrics are atomic).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace prometheus {
class Exposer;
}  // namespace prometheus

namespace poseidon {

// Label name -> value (prometheus::Labels).
using MetricLabels = std::map<std::string, std::string>;

// Bucket upper bounds start, start*factor, ..., `count` of them (for latencies and sizes).
std::vector<double> ExponentialBuckets(double start, double factor, int count);

// A handle on one prometheus::Registry. Copies share the registry. Families are created on first
// use and found again by name afterwards; pointers it returns stay valid while any copy of the
// registry is alive (families are never removed through this class). prometheus-cpp throws on bad
// names and type clashes; these calls return InvalidArgument / AlreadyExists instead.
class MetricsRegistry {
 public:
  // A new, empty registry.
  MetricsRegistry();
  // Wraps an existing registry (must not be null).
  explicit MetricsRegistry(std::shared_ptr<prometheus::Registry> registry);

  const std::shared_ptr<prometheus::Registry>& registry() const { return registry_; }

  // The family `name` (created with `help` if new). A name already used by another metric type is
  // AlreadyExists; a name that is not a valid Prometheus metric name is InvalidArgument.
  absl::StatusOr<prometheus::Family<prometheus::Counter>*> CounterFamily(
      absl::string_view name, absl::string_view help) const;
  absl::StatusOr<prometheus::Family<prometheus::Gauge>*> GaugeFamily(absl::string_view name,
                                                                     absl::string_view help) const;
  absl::StatusOr<prometheus::Family<prometheus::Histogram>*> HistogramFamily(
      absl::string_view name, absl::string_view help) const;

  // The metric with `labels` in family `name`, created if new.
  absl::StatusOr<prometheus::Counter*> GetCounter(absl::string_view name, absl::string_view help,
                                                  const MetricLabels& labels = {}) const;
  absl::StatusOr<prometheus::Gauge*> GetGauge(absl::string_view name, absl::string_view help,
                                              const MetricLabels& labels = {}) const;
  // `buckets` must be strictly increasing and finite (+Inf is implicit). When the histogram
  // already exists, the existing one (with its original buckets) is returned.
  absl::StatusOr<prometheus::Histogram*> GetHistogram(absl::string_view name,
                                                      absl::string_view help,
                                                      const MetricLabels& labels,
                                                      const std::vector<double>& buckets) const;

  // The Prometheus text exposition format of everything in the registry.
  std::string TextExposition() const;

 private:
  std::shared_ptr<prometheus::Registry> registry_;
};

// Serves a registry at http://host:port/metrics on its own threads (civetweb, in prometheus-cpp).
// Stops serving when destroyed.
// How long the /metrics server waits for a request or a client's reading (milliseconds).
inline constexpr int kMetricsRequestTimeoutMs = 5000;

class MetricsExposer {
 public:
  // `host_port` is "host:port", "[v6addr]:port" or ":port" (all interfaces); "localhost" means
  // 127.0.0.1; port 0 picks a free port (see port()). Bind failures and bad addresses are errors.
  static absl::StatusOr<std::unique_ptr<MetricsExposer>> Start(absl::string_view host_port,
                                                               const MetricsRegistry& registry,
                                                               int num_threads = 8);
  ~MetricsExposer();
  MetricsExposer(const MetricsExposer&) = delete;
  MetricsExposer& operator=(const MetricsExposer&) = delete;

  // The port actually bound.
  int port() const { return port_; }
  // "host:port" with the bound port, for logs and scrape configs.
  const std::string& address() const { return address_; }

 private:
  MetricsExposer(std::unique_ptr<prometheus::Exposer> exposer,
                 std::shared_ptr<prometheus::Registry> registry, int port, std::string address);

  std::shared_ptr<prometheus::Registry> registry_;  // kept alive: the exposer holds a weak_ptr
  std::unique_ptr<prometheus::Exposer> exposer_;
  int port_;
  std::string address_;
};

}  // namespace poseidon
