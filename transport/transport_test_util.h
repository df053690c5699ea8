// Blocking helpers over the asynchronous Connection API, for tests and benchmarks.
// Never call them from a transport callback. Thread-safety: as the Connection methods.
#pragma once

#include <future>
#include <memory>
#include <string>
#include <vector>

#include "transport/transport.h"

namespace poseidon::transport::testing {

inline absl::Status SyncSend(Connection& conn, const FrameHeader& header,
                             std::vector<ConstBuffer> payload) {
  std::promise<absl::Status> p;
  auto f = p.get_future();
  conn.Send(header, std::move(payload), [&p](absl::Status s) { p.set_value(std::move(s)); });
  return f.get();
}

// Starts a send and returns its completion. Use it when the same thread reads next: a send may
// complete only once the peer reads (in-process transport, or a full socket buffer).
inline std::future<absl::Status> SendAsync(Connection& conn, const FrameHeader& header,
                                           std::vector<ConstBuffer> payload) {
  auto p = std::make_shared<std::promise<absl::Status>>();
  auto f = p->get_future();
  conn.Send(header, std::move(payload), [p](absl::Status s) { p->set_value(std::move(s)); });
  return f;
}

inline absl::StatusOr<FrameHeader> SyncReadHeader(
    Connection& conn, absl::Duration timeout = absl::InfiniteDuration()) {
  std::promise<absl::StatusOr<FrameHeader>> p;
  auto f = p.get_future();
  conn.ReadHeader([&p](absl::StatusOr<FrameHeader> h) { p.set_value(std::move(h)); }, timeout);
  return f.get();
}

inline absl::Status SyncReadPayload(Connection& conn, MutableBuffer into) {
  std::promise<absl::Status> p;
  auto f = p.get_future();
  conn.ReadPayload(into, [&p](absl::Status s) { p.set_value(std::move(s)); });
  return f.get();
}

inline absl::Status SyncDiscardPayload(Connection& conn) {
  std::promise<absl::Status> p;
  auto f = p.get_future();
  conn.DiscardPayload([&p](absl::Status s) { p.set_value(std::move(s)); });
  return f.get();
}

// Reads a whole frame, payload into a fresh vector.
struct ReceivedFrame {
  FrameHeader header;
  std::vector<std::byte> payload;
};
inline absl::StatusOr<ReceivedFrame> SyncReadFrame(
    Connection& conn, absl::Duration timeout = absl::InfiniteDuration()) {
  auto h = SyncReadHeader(conn, timeout);
  if (!h.ok()) return h.status();
  ReceivedFrame frame{*h, std::vector<std::byte>(h->payload_length)};
  if (h->payload_length > 0) {
    if (auto s = SyncReadPayload(conn, frame.payload); !s.ok()) return s;
  }
  return frame;
}

inline absl::StatusOr<std::shared_ptr<Connection>> SyncAccept(Listener& listener) {
  std::promise<absl::StatusOr<std::shared_ptr<Connection>>> p;
  auto f = p.get_future();
  listener.Accept(
      [&p](absl::StatusOr<std::shared_ptr<Connection>> c) { p.set_value(std::move(c)); });
  return f.get();
}

// A data frame of job 1 for `key`, carrying `length` bytes.
inline FrameHeader DataHeader(uint64_t key, uint64_t length) {
  FrameHeader h;
  h.type = FrameType::kData;
  h.job_id = 1;
  h.key = key;
  h.payload_length = length;
  return h;
}

inline std::vector<std::byte> Pattern(size_t n, uint64_t seed) {
  std::vector<std::byte> v(n);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    v[i] = std::byte{static_cast<unsigned char>(x)};
  }
  return v;
}

}  // namespace poseidon::transport::testing
