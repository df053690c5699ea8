#include "server/kv_client.h"

#include <algorithm>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "common/status.h"
#include "transport/error_frame.h"
#include "transport/handshake.h"

namespace poseidon::server {

using transport::FrameHeader;
using transport::FrameType;

absl::StatusOr<std::shared_ptr<KvClient>> KvClient::Connect(
    transport::Context& context, const std::string& address, uint64_t job_id, uint32_t rank,
    const std::string& key, absl::Duration timeout, int connections) {
  if (connections < 1 || connections > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("connections per server must be in [1, 64], got ", connections));
  }
  std::vector<std::shared_ptr<transport::Connection>> conns;
  for (int i = 0; i < connections; ++i) {
    auto conn = transport::ConnectAuthenticated(context, address, job_id, rank, key, timeout);
    if (!conn.ok()) {
      for (auto& c : conns) c->Close();
      return conn.status();
    }
    conns.push_back(*conn);
  }
  std::shared_ptr<KvClient> client(new KvClient(std::move(conns), address, job_id, rank));
  for (size_t i = 0; i < client->conns_.size(); ++i) client->ReadLoop(i);
  return client;
}

std::shared_ptr<KvClient> KvClient::Unreachable(const std::string& address, uint64_t job_id,
                                                uint32_t rank, absl::Status why) {
  std::shared_ptr<KvClient> client(new KvClient({}, address, job_id, rank));
  client->broken_ = why.ok() ? absl::UnavailableError(absl::StrCat(address, " unreachable")) : why;
  return client;
}

KvClient::KvClient(std::vector<std::shared_ptr<transport::Connection>> conns, std::string address,
                   uint64_t job_id, uint32_t rank)
    : conns_(std::move(conns)),
      address_(std::move(address)),
      job_id_(job_id),
      rank_(rank),
      error_buffers_(conns_.size()),
      last_heard_ns_(static_cast<int64_t>(MonotonicNs())) {}

KvClient::~KvClient() {
  for (auto& c : conns_) c->Close();
}

void KvClient::Close() {
  FailAll(absl::UnavailableError(absl::StrCat("client of ", address_, " closed")));
}

Ticket KvClient::Start(size_t conn, FrameHeader header, std::vector<transport::ConstBuffer> payload,
                       Pending pending, std::shared_ptr<std::vector<std::byte>> owned) {
  uint64_t seq;
  {
    std::lock_guard<std::mutex> lock(mu_);
    seq = next_sequence_++;
    if (!broken_.ok()) {
      pending.answered = pending.send_done = true;
      pending.status = broken_;
    }
    // An idle connection is not a silent one: FailIfSilent counts from here at the earliest.
    if (pending_.empty()) waiting_since_ns_ = static_cast<int64_t>(MonotonicNs());
    pending_.emplace(seq, std::move(pending));
    if (!broken_.ok()) return seq;
  }
  header.job_id = job_id_;
  header.sender_rank = rank_;
  header.sequence = seq;
  header.payload_length = transport::TotalSize(payload);
  std::weak_ptr<KvClient> weak = weak_from_this();
  conns_[conn]->Send(header, std::move(payload), [weak, seq, owned](absl::Status s) {
    if (auto self = weak.lock()) self->Finish(seq, s, /*answer=*/false);
  });
  return seq;
}

Ticket KvClient::Push(uint64_t key, uint64_t clock, std::span<const float> data, bool init,
                      uint32_t epoch) {
  return PushBytes(key, clock, std::as_bytes(data), epoch, init);
}

Ticket KvClient::PushBytes(uint64_t key, uint64_t clock, std::span<const std::byte> payload,
                           uint32_t epoch, bool init, bool replay, bool exact_wire) {
  FrameHeader h;
  h.type = FrameType::kPush;
  h.key = key;
  h.clock = clock;
  h.epoch = epoch;
  if (init) h.flags |= transport::kFlagInit;
  if (replay) h.flags |= transport::kFlagReplay;
  if (exact_wire) h.flags |= transport::kFlagExactWire;
  Pending p;
  p.what = absl::StrCat(init ? "initial push" : "push", " of key ", key, " clock ", clock, " to ",
                        address_);
  return Start(ConnFor(key), h, {payload}, std::move(p));
}

Ticket KvClient::Replicate(uint64_t key, uint64_t clock, uint32_t epoch, uint8_t flags,
                           std::vector<transport::ConstBuffer> payload) {
  FrameHeader h;
  h.type = FrameType::kReplicate;
  h.flags = flags & transport::kFlagExactWire;
  h.key = key;
  h.clock = clock;
  h.epoch = epoch;
  Pending p;
  p.what = absl::StrCat("replica of key ", key, " clock ", clock, " to ", address_);
  return Start(ConnFor(key), h, std::move(payload), std::move(p));
}

bool KvClient::Broken() {
  std::lock_guard<std::mutex> lock(mu_);
  return !broken_.ok();
}

bool KvClient::FailIfSilent(absl::Duration limit) {
  int64_t since = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_.ok() || pending_.empty()) return false;
    since = waiting_since_ns_;
  }
  // Silence while requests wait: since the last header, or since requests began to wait on an
  // idle connection (nothing was owed before).
  const int64_t silent =
      static_cast<int64_t>(MonotonicNs()) - std::max(last_heard_ns_.load(), since);
  if (silent < absl::ToInt64Nanoseconds(limit)) return false;
  FailAll(absl::UnavailableError(absl::StrCat(
      "server ", address_, " is silent: nothing on its connection for ",
      absl::FormatDuration(absl::Trunc(absl::Nanoseconds(silent), absl::Milliseconds(100))),
      " while requests wait (a live server answers pings at once: it is frozen, or its network is "
      "cut)")));
  return true;
}

Ticket KvClient::Pull(uint64_t key, uint64_t clock, std::span<float> into,
                      absl::Duration server_timeout, uint32_t epoch) {
  return PullBytes(key, clock, std::as_writable_bytes(into), server_timeout, epoch);
}

Ticket KvClient::PullBytes(uint64_t key, uint64_t clock, std::span<std::byte> into,
                           absl::Duration server_timeout, uint32_t epoch, size_t lossy_bytes,
                           size_t* received) {
  FrameHeader h;
  h.type = FrameType::kPull;
  h.key = key;
  h.clock = clock;
  h.epoch = epoch;
  if (lossy_bytes != 0) h.flags |= transport::kFlagExactWire;
  auto timeout = std::make_shared<std::vector<std::byte>>(8);
  const auto ms = static_cast<uint64_t>(absl::ToInt64Milliseconds(server_timeout));
  for (int i = 0; i < 8; ++i) (*timeout)[i] = std::byte{static_cast<unsigned char>(ms >> (8 * i))};
  Pending p;
  p.what = absl::StrCat("pull of key ", key, " clock ", clock, " from ", address_);
  p.into = into;
  p.lossy_bytes = lossy_bytes;
  p.received = received;
  return Start(ConnFor(key), h, {*timeout}, std::move(p), timeout);
}

absl::Status KvClient::RegisterTables(const v1::RegisterTablesRequest& request,
                                      absl::Duration timeout, std::vector<KeyProgress>* keys,
                                      bool* removed, absl::Duration silent_after) {
  auto bytes = std::make_shared<std::vector<std::byte>>(request.ByteSizeLong());
  request.SerializeToArray(bytes->data(), static_cast<int>(bytes->size()));
  size_t count = 0;
  for (const auto& t : request.tables()) count += static_cast<size_t>(t.keys_size());
  for (const auto& t : request.standby_tables()) count += static_cast<size_t>(t.keys_size());
  // The answer (a KeyProgress per key: the tables', then the standby tables') is read like a
  // pull's, into a buffer that lives until it came; the client takes no other length.
  struct Answer {
    std::vector<KeyProgress> keys;
    uint64_t key_field = 0;
  };
  auto answer = std::make_shared<Answer>();
  answer->keys.resize(count);
  FrameHeader h;
  h.type = FrameType::kRegisterTables;
  Pending p;
  p.what = absl::StrCat("table registration on ", address_);
  p.into = std::as_writable_bytes(std::span(answer->keys));
  p.ack_key = &answer->key_field;
  const Ticket ticket = Start(0, h, {*bytes}, std::move(p), bytes);
  const absl::Status status = WaitAlive(ticket, timeout, silent_after);
  if (absl::IsDeadlineExceeded(status)) OnDone(ticket, [answer](absl::Status) {});
  if (!status.ok()) return status;
  if (keys != nullptr) *keys = answer->keys;
  if (removed != nullptr) *removed = answer->key_field == kRankRemoved;
  return absl::OkStatus();
}

Ticket KvClient::Ping(size_t connection) {
  FrameHeader h;
  h.type = FrameType::kPing;
  Pending p;
  p.what = absl::StrCat("ping of ", address_);
  return Start(ConnFor(connection), h, {}, std::move(p));
}

absl::StatusOr<absl::Duration> KvClient::MeasureRoundTrip(absl::Duration timeout,
                                                          size_t connection) {
  const absl::Time start = absl::Now();
  const Ticket ticket = Ping(connection);
  const absl::Status status = Wait(ticket, timeout);
  if (absl::IsDeadlineExceeded(status)) {
    OnDone(ticket, [](absl::Status) {});  // forget the ticket once the PONG (or failure) comes
  }
  if (!status.ok()) return status;
  return absl::Now() - start;
}

absl::StatusOr<KvClient::Probe> KvClient::MeasureBandwidth(uint64_t bytes, int probes,
                                                           absl::Duration timeout) {
  if (bytes == 0 || bytes > kMaxProbeBytes || probes < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("a probe of ", bytes, " bytes (1..", kMaxProbeBytes, "), ", probes, " times"));
  }
  auto payload = std::make_shared<std::vector<std::byte>>(bytes);
  Probe best;
  best.round_trip = absl::InfiniteDuration();
  for (int i = 0; i < probes; ++i) {
    // The shortest of a few empty round trips: one alone is mostly the scheduler's noise on a
    // loaded host, and the planner reads it as the link's latency.
    absl::Duration empty = absl::InfiniteDuration();
    for (int j = 0; j < kRoundTripSamples; ++j) {
      ASSIGN_OR_RETURN(const absl::Duration sample, MeasureRoundTrip(timeout));
      empty = std::min(empty, sample);
    }
    best.round_trip = std::min(best.round_trip, empty);
    FrameHeader h;
    h.type = FrameType::kPing;
    Pending p;
    p.what = absl::StrCat("bandwidth probe of ", address_);
    const absl::Time start = absl::Now();
    const Ticket ticket = Start(0, h, {*payload}, std::move(p), payload);
    const absl::Status status = Wait(ticket, timeout);
    if (absl::IsDeadlineExceeded(status)) OnDone(ticket, [](absl::Status) {});
    RETURN_IF_ERROR(status);
    const double seconds =
        std::max(absl::ToDoubleSeconds(absl::Now() - start - empty), 1e-6);
    best.bytes_per_second = std::max(best.bytes_per_second, static_cast<double>(bytes) / seconds);
  }
  return best;
}

absl::Status KvClient::Checkpoint(absl::Duration timeout, uint64_t iteration) {
  FrameHeader h;
  h.type = FrameType::kCheckpoint;
  h.clock = iteration;
  Pending p;
  p.what = absl::StrCat("checkpoint on ", address_);
  return Wait(Start(0, h, {}, std::move(p)), timeout);
}

std::optional<absl::Status> KvClient::WaitUpTo(Ticket ticket, absl::Duration timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = pending_.find(ticket);
  if (it == pending_.end()) {
    return absl::InvalidArgumentError(absl::StrCat("unknown or already waited ticket ", ticket));
  }
  const bool done = cv_.wait_for(lock, absl::ToChronoNanoseconds(timeout),
                                 [&] { return it->second.answered && it->second.send_done; });
  if (!done) return std::nullopt;
  absl::Status status = std::move(it->second.status);
  pending_.erase(it);
  return status;
}

absl::Status KvClient::NoAnswerWithin(Ticket ticket, absl::Duration timeout) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = pending_.find(ticket);
  return absl::DeadlineExceededError(
      absl::StrCat(it == pending_.end() ? absl::StrCat("ticket ", ticket) : it->second.what,
                   " got no answer within ", absl::FormatDuration(timeout)));
}

absl::Status KvClient::Wait(Ticket ticket, absl::Duration timeout) {
  if (std::optional<absl::Status> done = WaitUpTo(ticket, timeout)) return *std::move(done);
  return NoAnswerWithin(ticket, timeout);
}

absl::Status KvClient::WaitAlive(Ticket ticket, absl::Duration timeout,
                                 absl::Duration silent_after) {
  if (silent_after <= absl::ZeroDuration()) return Wait(ticket, timeout);
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return NoAnswerWithin(ticket, timeout);
    if (std::optional<absl::Status> done = WaitUpTo(ticket, std::min(left, silent_after / 3))) {
      return *std::move(done);
    }
    // Failed: the ticket is answered with the failure, which the next round returns.
    if (FailIfSilent(silent_after)) continue;
    // On the last connection: the first may be busy with what the ticket asked.
    OnDone(Ping(conns_.empty() ? 0 : conns_.size() - 1), [](absl::Status) {});
  }
}

void KvClient::Finish(uint64_t sequence, absl::Status status, bool answer) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = pending_.find(sequence);
  if (it == pending_.end()) return;
  Pending& p = it->second;
  if (answer) {
    p.answered = true;
  } else {
    p.send_done = true;
    if (!status.ok()) {
      p.answered = true;  // it never reached the server
      // A stream that failed a send is lost (what Broken tells callers, before the read loop
      // notices).
      if (broken_.ok()) broken_ = status;
    }
  }
  if (!status.ok() && p.status.ok()) {
    p.status = absl::Status(status.code(), absl::StrCat(p.what, ": ", status.message()));
  }
  if (p.answered && p.send_done && p.on_done) {
    RunCallbackLocked(lock, sequence);
    return;
  }
  lock.unlock();
  cv_.notify_all();
}

void KvClient::RunCallbackLocked(std::unique_lock<std::mutex>& lock, uint64_t sequence) {
  auto it = pending_.find(sequence);
  auto done = std::move(it->second.on_done);
  absl::Status status = std::move(it->second.status);
  pending_.erase(it);
  lock.unlock();
  done(std::move(status));
}

void KvClient::OnDone(Ticket ticket, std::function<void(absl::Status)> done) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = pending_.find(ticket);
  if (it == pending_.end()) {
    lock.unlock();
    done(absl::InvalidArgumentError(absl::StrCat("unknown or already waited ticket ", ticket)));
    return;
  }
  it->second.on_done = std::move(done);
  if (it->second.answered && it->second.send_done) RunCallbackLocked(lock, ticket);
}

void KvClient::Fail(const absl::Status& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_.ok()) return;
  }
  FailAll(why);
}

void KvClient::FailAll(const absl::Status& status) {
  // Every connection goes (below), so that every send still in flight completes (with an error,
  // or OK if it was handed to the network first). A request whose send is not done yet keeps its
  // callback until it is (Finish): the transport may still be reading its buffers, which the
  // caller may reuse once the callback ran (a server's key state, replicated without a copy,
  // is overwritten by the next clock). The requests take `status` before the connections close:
  // closing them fails the read loop, whose "closed locally" must not be what they report.
  std::vector<std::pair<std::function<void(absl::Status)>, absl::Status>> callbacks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (broken_.ok()) broken_ = status;
    for (auto it = pending_.begin(); it != pending_.end();) {
      Pending& p = it->second;
      if (!p.answered || !p.send_done) {
        p.answered = true;
        if (p.status.ok()) {
          p.status = absl::Status(status.code(), absl::StrCat(p.what, ": ", status.message()));
          if (p.answer_started) p.status.SetPayload(kAnswerStarted, absl::Cord("1"));
        }
        if (p.on_done && p.send_done) {
          callbacks.emplace_back(std::move(p.on_done), p.status);
          it = pending_.erase(it);
          continue;
        }
      }
      ++it;
    }
  }
  for (auto& c : conns_) c->Close();
  cv_.notify_all();
  for (auto& [done, s] : callbacks) done(s);
}

void KvClient::SetPullObserver(uint64_t min_bytes,
                               std::function<void(uint64_t, absl::Duration)> f) {
  observe_min_bytes_ = min_bytes;
  pull_observer_ = std::move(f);
}

void KvClient::ReadLoop(size_t conn) {
  std::weak_ptr<KvClient> weak = weak_from_this();
  conns_[conn]->ReadHeader([weak, conn](absl::StatusOr<FrameHeader> header) {
    auto self = weak.lock();
    if (!self) return;
    if (!header.ok()) {
      self->FailAll(header.status());
      return;
    }
    self->last_heard_ns_.store(static_cast<int64_t>(MonotonicNs()));
    self->OnResponse(conn, *header);
  });
}

void KvClient::OnResponse(size_t conn, const FrameHeader& h) {
  transport::Connection& c = *conns_[conn];
  std::vector<std::byte>& error_buffer = error_buffers_[conn];
  std::weak_ptr<KvClient> weak = weak_from_this();
  switch (h.type) {
    case FrameType::kPushAck:
    case FrameType::kCheckpointAck:
    case FrameType::kReplicateAck:
    case FrameType::kPong:
      Finish(h.sequence, absl::OkStatus(), true);
      ReadLoop(conn);
      return;
    case FrameType::kError: {
      error_buffer.resize(h.payload_length);
      auto after = [weak, h, conn](absl::Status s) {
        auto self = weak.lock();
        if (!self) return;
        if (!s.ok()) return self->FailAll(s);
        self->Finish(h.sequence, transport::ParseErrorFrame(h, self->error_buffers_[conn]), true);
        self->ReadLoop(conn);
      };
      if (h.payload_length > transport::kMaxErrorMessageBytes) {
        return c.DiscardPayload([weak, h, conn](absl::Status s) {
          auto self = weak.lock();
          if (!self) return;
          if (!s.ok()) return self->FailAll(s);
          self->Finish(h.sequence, absl::InternalError("server sent an oversized error"), true);
          self->ReadLoop(conn);
        });
      }
      if (h.payload_length == 0) return after(absl::OkStatus());
      return c.ReadPayload(error_buffer, std::move(after));
    }
    case FrameType::kPullResponse:
    case FrameType::kRegisterTablesAck: {  // its key clocks, read like a pull's answer
      std::span<std::byte> into;
      bool known = false;
      size_t* received = nullptr;
      bool fits = false;
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = pending_.find(h.sequence);
        if (it != pending_.end()) {
          into = it->second.into;
          known = true;
          received = it->second.received;
          // A registration's answer says in its key field whether this rank is out of the job.
          if (it->second.ack_key != nullptr) *it->second.ack_key = h.key;
          // A lossy key's pull takes its 16-bit answer, or float32 where the key fell back.
          fits = into.size_bytes() == h.payload_length ||
                 (it->second.lossy_bytes != 0 && it->second.lossy_bytes == h.payload_length);
          it->second.answer_started = fits;
        }
      }
      const absl::Time header_at = absl::Now();
      auto after = [weak, h, fits, known, conn, size = into.size_bytes(), header_at,
                    received](absl::Status s) {
        auto self = weak.lock();
        if (!self) return;
        if (!s.ok()) return self->FailAll(s);
        if (fits && received != nullptr) *received = h.payload_length;
        if (fits && self->pull_observer_ && h.payload_length >= self->observe_min_bytes_) {
          self->pull_observer_(h.payload_length, absl::Now() - header_at);
        }
        if (known) {
          self->Finish(h.sequence,
                       fits ? absl::OkStatus()
                            : absl::InvalidArgumentError(
                                  absl::StrCat("server sent ", h.payload_length, " bytes for a ",
                                               size, "-byte destination")),
                       true);
        }
        self->ReadLoop(conn);
      };
      if (h.payload_length == 0) return after(absl::OkStatus());
      if (fits) return c.ReadPayload(into.first(h.payload_length), std::move(after));
      return c.DiscardPayload(std::move(after));
    }
    default:
      FailAll(absl::InternalError(
          absl::StrCat("server sent an unexpected ", transport::FrameTypeName(h.type), " frame")));
      return;
  }
}

}  // namespace poseidon::server
