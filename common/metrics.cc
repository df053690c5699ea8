#include "common/metrics.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "prometheus/check_names.h"
#include "prometheus/exposer.h"
#include "prometheus/text_serializer.h"

namespace poseidon {
namespace {

// prometheus-cpp reports every misuse by throwing; turn that into a Status at this boundary.
template <typename T>
absl::StatusOr<prometheus::Family<T>*> GetFamily(prometheus::Registry& registry,
                                                 prometheus::detail::Builder<T> builder,
                                                 absl::string_view name, absl::string_view help) {
  const std::string metric_name(name);
  if (!prometheus::CheckMetricName(metric_name)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "invalid metric name '", name, "' (expected [a-zA-Z_:][a-zA-Z0-9_:]*, no leading __)"));
  }
  try {
    return &builder.Name(metric_name).Help(std::string(help)).Register(registry);
  } catch (const std::exception& e) {
    return absl::AlreadyExistsError(
        absl::StrCat("metric family '", name, "' clashes with an existing one: ", e.what()));
  }
}

absl::Status CheckLabels(absl::string_view name, const MetricLabels& labels) {
  for (const auto& [label, value] : labels) {
    if (!prometheus::CheckLabelName(label)) {
      return absl::InvalidArgumentError(absl::StrCat("metric '", name, "': invalid label name '",
                                                     label, "' (expected [a-zA-Z_][a-zA-Z0-9_]*)"));
    }
  }
  return absl::OkStatus();
}

template <typename T, typename... Args>
absl::StatusOr<T*> AddMetric(prometheus::Family<T>& family, absl::string_view name,
                             const MetricLabels& labels, Args&&... args) {
  if (absl::Status s = CheckLabels(name, labels); !s.ok()) return s;
  try {
    return &family.Add(labels, std::forward<Args>(args)...);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("metric '", name, "': ", e.what()));
  }
}

struct HostPort {
  std::string host;  // as civetweb wants it: "1.2.3.4", "[::1]", or empty for all interfaces
  int port = 0;
};

absl::StatusOr<HostPort> ParseHostPort(absl::string_view host_port) {
  const auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid metrics address '", host_port, "': ", why));
  };
  const size_t colon = host_port.rfind(':');
  if (colon == absl::string_view::npos) return bad("expected host:port");
  HostPort out;
  out.host = std::string(host_port.substr(0, colon));
  const absl::string_view port = host_port.substr(colon + 1);
  if (port.empty() || port.size() > 5 ||
      !std::all_of(port.begin(), port.end(), [](char c) { return absl::ascii_isdigit(c); }) ||
      !absl::SimpleAtoi(port, &out.port) || out.port > 65535) {
    return bad("port must be a number in [0, 65535]");
  }
  if (out.host == "localhost") out.host = "127.0.0.1";
  if (out.host.find(':') != std::string::npos &&
      !(out.host.front() == '[' && out.host.back() == ']')) {
    return bad("write an IPv6 host in brackets, e.g. [::1]:9100");
  }
  if (out.host.find_first_of(",/ ") != std::string::npos) return bad("unexpected character");
  return out;
}

}  // namespace

std::vector<double> ExponentialBuckets(double start, double factor, int count) {
  std::vector<double> buckets;
  buckets.reserve(static_cast<size_t>(std::max(count, 0)));
  double bound = start;
  for (int i = 0; i < count; ++i) {
    buckets.push_back(bound);
    bound *= factor;
  }
  return buckets;
}

MetricsRegistry::MetricsRegistry() : registry_(std::make_shared<prometheus::Registry>()) {}

MetricsRegistry::MetricsRegistry(std::shared_ptr<prometheus::Registry> registry)
    : registry_(registry ? std::move(registry) : std::make_shared<prometheus::Registry>()) {}

absl::StatusOr<prometheus::Family<prometheus::Counter>*> MetricsRegistry::CounterFamily(
    absl::string_view name, absl::string_view help) const {
  return GetFamily(*registry_, prometheus::BuildCounter(), name, help);
}

absl::StatusOr<prometheus::Family<prometheus::Gauge>*> MetricsRegistry::GaugeFamily(
    absl::string_view name, absl::string_view help) const {
  return GetFamily(*registry_, prometheus::BuildGauge(), name, help);
}

absl::StatusOr<prometheus::Family<prometheus::Histogram>*> MetricsRegistry::HistogramFamily(
    absl::string_view name, absl::string_view help) const {
  return GetFamily(*registry_, prometheus::BuildHistogram(), name, help);
}

absl::StatusOr<prometheus::Counter*> MetricsRegistry::GetCounter(absl::string_view name,
                                                                 absl::string_view help,
                                                                 const MetricLabels& labels) const {
  absl::StatusOr<prometheus::Family<prometheus::Counter>*> family = CounterFamily(name, help);
  if (!family.ok()) return family.status();
  return AddMetric(**family, name, labels);
}

absl::StatusOr<prometheus::Gauge*> MetricsRegistry::GetGauge(absl::string_view name,
                                                             absl::string_view help,
                                                             const MetricLabels& labels) const {
  absl::StatusOr<prometheus::Family<prometheus::Gauge>*> family = GaugeFamily(name, help);
  if (!family.ok()) return family.status();
  return AddMetric(**family, name, labels);
}

absl::StatusOr<prometheus::Histogram*> MetricsRegistry::GetHistogram(
    absl::string_view name, absl::string_view help, const MetricLabels& labels,
    const std::vector<double>& buckets) const {
  for (size_t i = 0; i < buckets.size(); ++i) {
    if (!std::isfinite(buckets[i]) || (i > 0 && !(buckets[i - 1] < buckets[i]))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "histogram '", name, "': bucket bounds must be finite and strictly increasing"));
    }
  }
  absl::StatusOr<prometheus::Family<prometheus::Histogram>*> family = HistogramFamily(name, help);
  if (!family.ok()) return family.status();
  const prometheus::Histogram::BucketBoundaries bounds(buckets.begin(), buckets.end());
  return AddMetric(**family, name, labels, bounds);
}

std::string MetricsRegistry::TextExposition() const {
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, registry_->Collect());
  return out.str();
}

absl::StatusOr<std::unique_ptr<MetricsExposer>> MetricsExposer::Start(
    absl::string_view host_port, const MetricsRegistry& registry, int num_threads) {
  absl::StatusOr<HostPort> parsed = ParseHostPort(host_port);
  if (!parsed.ok()) return parsed.status();
  if (num_threads < 1) return absl::InvalidArgumentError("metrics exposer needs >= 1 thread");
  const std::string listen = parsed->host.empty() ? absl::StrCat(parsed->port)
                                                  : absl::StrCat(parsed->host, ":", parsed->port);
  std::unique_ptr<prometheus::Exposer> exposer;
  std::vector<int> ports;
  try {
    // A client that stalls in its request holds a worker thread only until request_timeout_ms
    // (civetweb's default is 30 s), and there are enough workers for a few such clients besides
    // the scrapers (a hardening finding: two slow clients blinded the old two-thread exposer).
    exposer = std::make_unique<prometheus::Exposer>(std::vector<std::string>{
        "listening_ports", listen, "num_threads", absl::StrCat(num_threads),
        "request_timeout_ms", absl::StrCat(kMetricsRequestTimeoutMs)});
    exposer->RegisterCollectable(registry.registry());
    ports = exposer->GetListeningPorts();
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on '", host_port, "': ", e.what()));
  }
  if (ports.empty() || ports.front() <= 0) {
    return absl::InternalError(
        absl::StrCat("metrics exposer on '", host_port, "' reports no listening port"));
  }
  const std::string host = parsed->host.empty() ? "0.0.0.0" : parsed->host;
  return std::unique_ptr<MetricsExposer>(
      new MetricsExposer(std::move(exposer), registry.registry(), ports.front(),
                         absl::StrCat(host, ":", ports.front())));
}

MetricsExposer::MetricsExposer(std::unique_ptr<prometheus::Exposer> exposer,
                               std::shared_ptr<prometheus::Registry> registry, int port,
                               std::string address)
    : registry_(std::move(registry)),
      exposer_(std::move(exposer)),
      port_(port),
      address_(std::move(address)) {}

MetricsExposer::~MetricsExposer() = default;

}  // namespace poseidon
