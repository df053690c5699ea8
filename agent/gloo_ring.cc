#include "agent/gloo_ring.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gloo/allreduce.h"
#include "gloo/math.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/store.h"
#include "gloo/transport/tcp/device.h"

namespace poseidon::agent {

absl::StatusOr<std::shared_ptr<gloo::transport::Device>> MakeGlooDevice(std::string host) {
  if (host.empty()) host = "127.0.0.1";
  if (host.size() > 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = host;
    return gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("all-reduce: Gloo's TCP device on ", host, ": ", e.what()));
  }
}

absl::StatusOr<GlooRing> ConnectGlooRing(gloo::rendezvous::Store& store, uint32_t rank,
                                         uint32_t world, std::string host,
                                         absl::Duration timeout) {
  if (world < 2 || rank >= world) {
    return absl::InvalidArgumentError(
        absl::StrCat("all-reduce: a Gloo ring needs rank < world >= 2, not rank ", rank, " of ",
                     world));
  }
  if (host.empty()) host = "127.0.0.1";
  if (host.size() > 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
  const auto millis =
      std::chrono::milliseconds(std::max<int64_t>(1, absl::ToInt64Milliseconds(timeout)));
  GlooRing ring;
  {
    auto device = MakeGlooDevice(host);
    if (!device.ok()) return device.status();
    ring.device = *std::move(device);
  }
  try {
    auto context = std::make_shared<gloo::rendezvous::Context>(static_cast<int>(rank),
                                                               static_cast<int>(world));
    context->setTimeout(millis);
    context->connectFullMesh(store, ring.device);
    ring.context = std::move(context);
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("all-reduce: connecting the Gloo ring of ", world, " ranks on ", host,
                     " (rendezvous through the coordinator): ", e.what()));
  }
  std::vector<double> seconds;
  for (int i = 0; i < kGlooStepProbes; ++i) {
    float one = 1;
    const absl::Time start = absl::Now();
    try {
      gloo::AllreduceOptions opts(ring.context);
      opts.setOutput(&one, 1);
      opts.setReduceFunction(
          static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
      opts.setTag(kGlooProbeTag);
      opts.setTimeout(millis);
      gloo::allreduce(opts);
    } catch (const std::exception& e) {
      return absl::UnavailableError(
          absl::StrCat("all-reduce: measuring the Gloo ring of ", world, " ranks: ", e.what()));
    }
    if (one != static_cast<float>(world)) {
      return absl::InternalError(
          absl::StrCat("all-reduce: the ring's probe summed to ", one, ", not ", world));
    }
    seconds.push_back(absl::ToDoubleSeconds(absl::Now() - start));
  }
  std::nth_element(seconds.begin(), seconds.begin() + kGlooStepProbes / 2, seconds.end());
  ring.step = absl::Seconds(seconds[kGlooStepProbes / 2] / (2.0 * (world - 1)));
  return ring;
}

}  // namespace poseidon::agent
