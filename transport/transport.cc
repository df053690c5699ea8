#include "transport/transport.h"

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status.h"
#include "transport/checksum.h"
#include "transport/inproc/inproc_context.h"
#include "transport/rdma/rdma_context.h"
#include "transport/tcp/tcp_context.h"

namespace poseidon::transport {
namespace {

class PlainMemoryRegion final : public MemoryRegion {
 public:
  explicit PlainMemoryRegion(MutableBuffer buffer) : buffer_(buffer) {}
  MutableBuffer Buffer() const override { return buffer_; }

 private:
  MutableBuffer buffer_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<MemoryRegion>> Context::RegisterMemory(MutableBuffer buffer) {
  return std::make_unique<PlainMemoryRegion>(buffer);
}

absl::StatusOr<std::shared_ptr<Context>> MakeContext(absl::string_view kind, const TcpOptions& tcp,
                                                     [[maybe_unused]] const RdmaOptions& rdma) {
  if (kind == "tcp") return CreateTcpContext(tcp);
  if (kind == "inproc") return CreateInprocContext(tcp);
  if (kind == "rdma" || kind == "auto") {
#ifdef POSEIDON_HAVE_RDMA
    auto ctx = CreateRdmaContext(rdma);
    if (!ctx.ok()) return ctx.status();
    if ((*ctx)->IsViable()) {
      PSD_LOG_INFO("transport: rdma (--transport={})", kind);
      return ctx;
    }
    (*ctx)->Close();
    const absl::Status why = RdmaDeviceStatus(rdma);
    if (kind == "rdma") {
      return absl::FailedPreconditionError(
          absl::StrCat("--transport=rdma, but RDMA is not usable here: ", why.message()));
    }
    PSD_LOG_INFO("transport: tcp (--transport=auto; RDMA not usable: {})", why.message());
#else
    if (kind == "rdma") {
      return absl::UnimplementedError(
          "--transport=rdma, but this build has no RDMA transport (libibverbs-dev was missing at "
          "configure time, or -DPOSEIDON_WITH_RDMA=OFF)");
    }
    PSD_LOG_INFO("transport: tcp (--transport=auto; built without RDMA)");
#endif
    return CreateTcpContext(tcp);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown transport '", kind, "' (tcp, rdma, auto or inproc)"));
}

absl::StatusOr<std::shared_ptr<Context>> MakeContext(absl::string_view kind,
                                                     const ContextOptions& options) {
  TcpOptions tcp;
  static_cast<ContextOptions&>(tcp) = options;
  RdmaOptions rdma;
  static_cast<ContextOptions&>(rdma) = options;
  return MakeContext(kind, tcp, rdma);
}

void TransportSet::Close() const {
  if (rdma) rdma->Close();
  if (tcp) tcp->Close();
}

absl::StatusOr<TransportSet> MakeTransportSet(absl::string_view kind, const TcpOptions& tcp,
                                              [[maybe_unused]] const RdmaOptions& rdma) {
  if (kind != "tcp" && kind != "rdma" && kind != "auto") {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown transport '", kind, "' (auto, tcp or rdma)"));
  }
  TransportSet set;
  if (kind == "rdma" || kind == "auto") {
#ifdef POSEIDON_HAVE_RDMA
    // The device is probed first, so that a machine without one logs only the choice.
    absl::Status why = RdmaDeviceStatus(rdma);
    std::shared_ptr<Context> ctx;
    if (why.ok()) {
      ASSIGN_OR_RETURN(ctx, CreateRdmaContext(rdma));
      if (!ctx->IsViable()) why = absl::UnavailableError("the device went away");
    }
    if (why.ok()) {
      set.rdma = ctx;
      set.choice = kind == "rdma" ? "rdma (--transport=rdma)"
                                  : "rdma and tcp (--transport=auto: an RDMA device is usable; "
                                    "TCP serves the peers without one)";
    } else {
      if (ctx) ctx->Close();
      if (kind == "rdma") {
        return absl::FailedPreconditionError(
            absl::StrCat("--transport=rdma, but RDMA is not usable here: ", why.message()));
      }
      set.choice = absl::StrCat("tcp (--transport=auto; RDMA not usable: ", why.message(), ")");
    }
#else
    if (kind == "rdma") {
      return absl::UnimplementedError(
          "--transport=rdma, but this build has no RDMA transport (libibverbs-dev was missing at "
          "configure time, or -DPOSEIDON_WITH_RDMA=OFF)");
    }
    set.choice = "tcp (--transport=auto; built without RDMA)";
#endif
  } else {
    set.choice = "tcp (--transport=tcp)";
  }
  if (kind == "rdma") return set;
  auto ctx = CreateTcpContext(tcp);
  if (!ctx.ok()) {
    set.Close();
    return ctx.status();
  }
  set.tcp = *ctx;
  return set;
}

size_t TotalSize(std::span<const ConstBuffer> buffers) {
  size_t total = 0;
  for (const auto& b : buffers) total += b.size();
  return total;
}

absl::Status PrepareSend(FrameHeader& header, std::span<const ConstBuffer> payload,
                         const ContextOptions& options) {
  const size_t total = TotalSize(payload);
  if (total != header.payload_length) {
    return absl::InvalidArgumentError(absl::StrCat(
        "payload buffers hold ", total, " bytes but the header declares ", header.payload_length));
  }
  if (header.payload_length > options.limits.max_payload_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("payload of ", header.payload_length,
                                                     " bytes exceeds the maximum of ",
                                                     options.limits.max_payload_bytes));
  }
  if (options.payload_checksums) {
    uint32_t crc = 0;
    for (const auto& b : payload) crc = Crc32c(crc, b);
    header.flags |= kFlagPayloadChecksum;
    header.payload_checksum = crc;
  }
  return absl::OkStatus();
}

ConnectionStats ConnectionCounters::Snapshot() const {
  ConnectionStats s;
  s.frames_sent = frames_sent.load(std::memory_order_relaxed);
  s.frames_received = frames_received.load(std::memory_order_relaxed);
  s.bytes_sent = bytes_sent.load(std::memory_order_relaxed);
  s.bytes_received = bytes_received.load(std::memory_order_relaxed);
  return s;
}

}  // namespace poseidon::transport
