// libFuzzer target: the handshake state machines fed arbitrary frames. The input is a sequence
// of records [64-byte header][payload of its declared length, capped at 64]; records go
// alternately to a server and a client machine. Neither may crash, and the server must never
// report success to a peer that does not know the secret (the fuzzer cannot compute HMACs).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "transport/frame.h"
#include "transport/credentials.h"
#include "transport/handshake.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace poseidon::transport;
  SecretStore secrets;
  secrets.Set(1, "fuzz-secret");
  secrets.Set(0, "");
  ServerHandshake server(secrets);
  ClientHandshake client(1, 0, RankKey("fuzz-secret", 1, 0));
  (void)client.Start();
  bool to_server = true;
  while (size >= kFrameHeaderSize) {
    EncodedHeader bytes;
    std::memcpy(bytes.data(), data, kFrameHeaderSize);
    data += kFrameHeaderSize;
    size -= kFrameHeaderSize;
    auto header = DecodeHeader(bytes, FrameLimits{.max_payload_bytes = kMaxHandshakePayload});
    if (!header.ok()) continue;
    const size_t n = header->payload_length < size ? header->payload_length : size;
    std::span<const std::byte> payload(reinterpret_cast<const std::byte*>(data), n);
    data += n;
    size -= n;
    if (to_server) {
      (void)server.OnFrame(*header, payload);
      // Job 0 has the empty secret, which a fuzzer could in principle compute; only job 1
      // (a real secret) must be unreachable.
      if (server.done() && server.peer().job_id == 1) std::abort();
    } else {
      (void)client.OnFrame(*header, payload);
      if (client.done()) std::abort();  // the server proof needs the secret
    }
    to_server = !to_server;
  }
  return 0;
}
