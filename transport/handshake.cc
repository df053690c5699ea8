#include "transport/handshake.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <future>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/log.h"
#include "transport/credentials.h"
#include "transport/error_frame.h"

namespace poseidon::transport {
namespace {

constexpr absl::string_view kClientLabel = "poseidon/v1/client";
constexpr absl::string_view kServerLabel = "poseidon/v1/server";

void FillRandom(std::span<std::byte> out) {
  if (RAND_bytes(reinterpret_cast<unsigned char*>(out.data()), static_cast<int>(out.size())) != 1) {
    // OpenSSL's CSPRNG failing means the process cannot do crypto at all.
    PSD_LOG_ERROR("RAND_bytes failed; aborting");
    std::abort();
  }
}

void AppendLe(std::vector<unsigned char>& out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<unsigned char>(value >> (8 * i)));
}

std::array<std::byte, kProofBytes> Proof(absl::string_view secret, absl::string_view label,
                                         uint64_t job_id, uint32_t rank,
                                         std::span<const std::byte> first_nonce,
                                         std::span<const std::byte> second_nonce) {
  std::vector<unsigned char> message(label.begin(), label.end());
  AppendLe(message, job_id, 8);
  AppendLe(message, rank, 4);
  for (auto b : first_nonce) message.push_back(std::to_integer<unsigned char>(b));
  for (auto b : second_nonce) message.push_back(std::to_integer<unsigned char>(b));
  std::array<std::byte, kProofBytes> out{};
  unsigned int len = 0;
  HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()), message.data(), message.size(),
       reinterpret_cast<unsigned char*>(out.data()), &len);
  return out;
}

bool ConstantTimeEqual(std::span<const std::byte> a, std::span<const std::byte> b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

OutFrame MakeFrame(FrameType type, uint64_t job_id, uint32_t rank,
                   std::span<const std::byte> payload) {
  OutFrame f;
  f.header.type = type;
  f.header.job_id = job_id;
  f.header.sender_rank = rank;
  f.header.payload_length = payload.size();
  f.payload.assign(payload.begin(), payload.end());
  return f;
}

absl::Status Expect(const FrameHeader& header, std::span<const std::byte> payload, FrameType type,
                    size_t length) {
  if (header.type != type) {
    return absl::PermissionDeniedError(absl::StrCat("handshake expected a ", FrameTypeName(type),
                                                    " frame, got ", FrameTypeName(header.type)));
  }
  if (payload.size() != length || header.payload_length != length) {
    return absl::PermissionDeniedError(absl::StrCat("handshake ", FrameTypeName(type),
                                                    " frame carries ", payload.size(),
                                                    " bytes, expected ", length));
  }
  return absl::OkStatus();
}

}  // namespace

void SecretStore::Set(uint64_t job_id, std::string secret) {
  std::lock_guard<std::mutex> lock(mu_);
  entries_[job_id] = Entry{std::move(secret), {}};
}

void SecretStore::SetKeys(uint64_t job_id, std::map<uint32_t, std::string> keys) {
  std::lock_guard<std::mutex> lock(mu_);
  entries_[job_id] = Entry{"", std::move(keys)};
}

void SecretStore::Remove(uint64_t job_id) {
  std::lock_guard<std::mutex> lock(mu_);
  entries_.erase(job_id);
}

absl::StatusOr<std::string> SecretStore::KeyFor(uint64_t job_id, uint32_t rank) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = entries_.find(job_id);
  if (it == entries_.end()) return absl::NotFoundError(absl::StrCat("unknown job ", job_id));
  if (it->second.keys.empty()) return RankKey(it->second.secret, job_id, rank);
  const auto key = it->second.keys.find(rank);
  if (key == it->second.keys.end()) {
    return absl::PermissionDeniedError(
        absl::StrCat("rank ", rank, " of job ", job_id, " has no key here"));
  }
  return key->second;
}

// ---- client ----

ClientHandshake::ClientHandshake(uint64_t job_id, uint32_t rank, std::string secret)
    : job_id_(job_id), rank_(rank), secret_(std::move(secret)) {}

OutFrame ClientHandshake::Start() {
  FillRandom(client_nonce_);
  state_ = State::kSentHello;
  return MakeFrame(FrameType::kHello, job_id_, rank_, client_nonce_);
}

absl::StatusOr<std::optional<OutFrame>> ClientHandshake::OnFrame(
    const FrameHeader& header, std::span<const std::byte> payload) {
  const State state = state_;
  state_ = State::kFailed;
  if (header.type == FrameType::kError) {
    return ParseErrorFrame(header, payload);
  }
  if (header.job_id != job_id_) {
    return absl::PermissionDeniedError(
        absl::StrCat("server answered for job ", header.job_id, ", expected ", job_id_));
  }
  switch (state) {
    case State::kSentHello: {
      if (auto s = Expect(header, payload, FrameType::kChallenge, kNonceBytes); !s.ok()) return s;
      std::copy(payload.begin(), payload.end(), server_nonce_.begin());
      const auto proof = Proof(secret_, kClientLabel, job_id_, rank_, client_nonce_, server_nonce_);
      state_ = State::kSentAuth;
      return std::optional<OutFrame>(MakeFrame(FrameType::kAuth, job_id_, rank_, proof));
    }
    case State::kSentAuth: {
      if (auto s = Expect(header, payload, FrameType::kAuthOk, kProofBytes); !s.ok()) return s;
      const auto expected =
          Proof(secret_, kServerLabel, job_id_, rank_, server_nonce_, client_nonce_);
      if (!ConstantTimeEqual(expected, payload)) {
        return absl::UnauthenticatedError(
            "server failed to prove knowledge of this rank's key (a different job secret on the "
            "server?)");
      }
      state_ = State::kDone;
      return std::optional<OutFrame>();
    }
    case State::kInit:
    case State::kDone:
    case State::kFailed:
      break;
  }
  return absl::FailedPreconditionError("handshake frame received in the wrong state");
}

// ---- server ----

ServerHandshake::ServerHandshake(const SecretStore& secrets) : secrets_(secrets) {}

absl::StatusOr<OutFrame> ServerHandshake::OnFrame(const FrameHeader& header,
                                                  std::span<const std::byte> payload) {
  const State state = state_;
  state_ = State::kFailed;
  switch (state) {
    case State::kWaitHello: {
      if (auto s = Expect(header, payload, FrameType::kHello, kNonceBytes); !s.ok()) return s;
      auto key = secrets_.KeyFor(header.job_id, header.sender_rank);
      if (!key.ok()) return absl::PermissionDeniedError(key.status().message());
      secret_ = *std::move(key);
      peer_.job_id = header.job_id;
      peer_.rank = header.sender_rank;
      std::copy(payload.begin(), payload.end(), client_nonce_.begin());
      FillRandom(server_nonce_);
      state_ = State::kWaitAuth;
      return MakeFrame(FrameType::kChallenge, peer_.job_id, 0, server_nonce_);
    }
    case State::kWaitAuth: {
      if (auto s = Expect(header, payload, FrameType::kAuth, kProofBytes); !s.ok()) return s;
      if (header.job_id != peer_.job_id || header.sender_rank != peer_.rank) {
        return absl::PermissionDeniedError("handshake AUTH changed job or rank");
      }
      const auto expected =
          Proof(secret_, kClientLabel, peer_.job_id, peer_.rank, client_nonce_, server_nonce_);
      if (!ConstantTimeEqual(expected, payload)) {
        return absl::UnauthenticatedError(absl::StrCat("authentication failed for job ",
                                                       peer_.job_id, " rank ", peer_.rank,
                                                       " (a key not derived from this job's secret)"));
      }
      state_ = State::kDone;
      const auto proof =
          Proof(secret_, kServerLabel, peer_.job_id, peer_.rank, server_nonce_, client_nonce_);
      return MakeFrame(FrameType::kAuthOk, peer_.job_id, 0, proof);
    }
    case State::kDone:
    case State::kFailed:
      break;
  }
  return absl::FailedPreconditionError("handshake frame received in the wrong state");
}

// ---- drivers ----
namespace {

// Reads one handshake frame (bounded payload) and hands it to `on_frame`.
struct FrameReader {
  using OnFrame = absl::AnyInvocable<void(absl::StatusOr<FrameHeader>, std::span<const std::byte>)>;

  static void Read(std::shared_ptr<Connection> conn, absl::Time deadline, OnFrame on_frame) {
    const absl::Duration remaining = std::max(deadline - absl::Now(), absl::Milliseconds(1));
    auto* raw = conn.get();
    raw->ReadHeader(
        [conn = std::move(conn),
         on_frame = std::move(on_frame)](absl::StatusOr<FrameHeader> header) mutable {
          if (!header.ok()) {
            on_frame(header.status(), {});
            return;
          }
          const bool is_error = header->type == FrameType::kError;
          const size_t limit = is_error ? kMaxErrorMessageBytes : kMaxHandshakePayload;
          if (header->payload_length > limit) {
            on_frame(absl::PermissionDeniedError(
                         absl::StrCat("handshake ", FrameTypeName(header->type), " frame declares ",
                                      header->payload_length, " payload bytes (max ", limit, ")")),
                     {});
            return;
          }
          if (header->payload_length == 0) {
            on_frame(std::move(header), {});
            return;
          }
          auto buffer = std::make_shared<std::vector<std::byte>>(header->payload_length);
          auto* c = conn.get();
          c->ReadPayload(*buffer, [buffer, h = *header,
                                   on_frame = std::move(on_frame)](absl::Status s) mutable {
            if (!s.ok()) {
              on_frame(s, {});
              return;
            }
            on_frame(h, *buffer);
          });
        },
        remaining);
  }
};

void SendOut(Connection& conn, OutFrame frame, DoneCallback done) {
  auto owned = std::make_shared<OutFrame>(std::move(frame));
  std::vector<ConstBuffer> payload;
  if (!owned->payload.empty()) payload.emplace_back(owned->payload);
  conn.Send(owned->header, std::move(payload),
            [owned, done = std::move(done)](absl::Status s) mutable { done(std::move(s)); });
}

struct ServerRun : std::enable_shared_from_this<ServerRun> {
  ServerRun(std::shared_ptr<Connection> c, std::shared_ptr<const SecretStore> s, absl::Time d,
            HandshakeCallback cb)
      : conn(std::move(c)),
        secrets(std::move(s)),
        machine(*secrets),
        deadline(d),
        done(std::move(cb)) {}

  void Step() {
    FrameReader::Read(conn, deadline,
                      [self = shared_from_this()](absl::StatusOr<FrameHeader> header,
                                                  std::span<const std::byte> payload) {
                        self->OnFrame(std::move(header), payload);
                      });
  }

  void OnFrame(absl::StatusOr<FrameHeader> header, std::span<const std::byte> payload) {
    if (!header.ok()) {
      Fail(header.status(),
           /*tell_peer=*/header.status().code() == absl::StatusCode::kPermissionDenied);
      return;
    }
    auto answer = machine.OnFrame(*header, payload);
    if (!answer.ok()) {
      Fail(answer.status(), /*tell_peer=*/true);
      return;
    }
    const bool finished = machine.done();
    SendOut(*conn, std::move(*answer), [self = shared_from_this(), finished](absl::Status s) {
      if (!s.ok()) {
        self->Fail(s, false);
      } else if (finished) {
        auto cb = std::move(self->done);
        cb(self->machine.peer());
      } else {
        self->Step();
      }
    });
  }

  void Fail(const absl::Status& status, bool tell_peer) {
    const absl::Status annotated(status.code(), absl::StrCat("handshake with ", conn->PeerAddress(),
                                                             " failed: ", status.message()));
    if (tell_peer) {
      conn->Abort(annotated);
    } else {
      conn->Close();
    }
    auto cb = std::move(done);
    cb(annotated);
  }

  std::shared_ptr<Connection> conn;
  std::shared_ptr<const SecretStore> secrets;
  ServerHandshake machine;
  absl::Time deadline;
  HandshakeCallback done;
};

struct ClientRun : std::enable_shared_from_this<ClientRun> {
  ClientRun(std::shared_ptr<Connection> c, uint64_t job, uint32_t rank, std::string secret,
            absl::Time d, HandshakeCallback cb)
      : conn(std::move(c)),
        machine(job, rank, std::move(secret)),
        deadline(d),
        done(std::move(cb)),
        identity{job, rank} {}

  void Begin() {
    SendOut(*conn, machine.Start(), [self = shared_from_this()](absl::Status s) {
      if (!s.ok()) return self->Fail(s);
      self->Step();
    });
  }

  void Step() {
    FrameReader::Read(conn, deadline,
                      [self = shared_from_this()](absl::StatusOr<FrameHeader> header,
                                                  std::span<const std::byte> payload) {
                        if (!header.ok()) return self->Fail(header.status());
                        auto next = self->machine.OnFrame(*header, payload);
                        if (!next.ok()) return self->Fail(next.status());
                        if (!next->has_value()) {
                          auto cb = std::move(self->done);
                          cb(self->identity);
                          return;
                        }
                        SendOut(*self->conn, std::move(**next), [self](absl::Status s) {
                          if (!s.ok()) return self->Fail(s);
                          self->Step();
                        });
                      });
  }

  void Fail(const absl::Status& status) {
    conn->Close();
    auto cb = std::move(done);
    cb(absl::Status(status.code(), absl::StrCat("handshake with ", conn->PeerAddress(),
                                                " failed: ", status.message())));
  }

  std::shared_ptr<Connection> conn;
  ClientHandshake machine;
  absl::Time deadline;
  HandshakeCallback done;
  PeerIdentity identity;
};

}  // namespace

void AcceptHandshake(std::shared_ptr<Connection> conn, std::shared_ptr<const SecretStore> secrets,
                     absl::Duration timeout, HandshakeCallback done) {
  auto run = std::make_shared<ServerRun>(std::move(conn), std::move(secrets), absl::Now() + timeout,
                                         std::move(done));
  run->Step();
}

void StartClientHandshake(std::shared_ptr<Connection> conn, uint64_t job_id, uint32_t rank,
                          std::string secret, absl::Duration timeout, HandshakeCallback done) {
  auto run = std::make_shared<ClientRun>(std::move(conn), job_id, rank, std::move(secret),
                                         absl::Now() + timeout, std::move(done));
  run->Begin();
}

absl::Status AuthenticateClient(const std::shared_ptr<Connection>& conn, uint64_t job_id,
                                uint32_t rank, std::string secret, absl::Duration timeout) {
  auto result = std::make_shared<std::promise<absl::Status>>();
  auto future = result->get_future();
  StartClientHandshake(
      conn, job_id, rank, std::move(secret), timeout, [result](absl::StatusOr<PeerIdentity> peer) {
        // A status of its own (code, message, payloads), not a reference to the I/O thread's:
        // the caller reads and replaces it while that thread may still drop its copy.
        absl::Status own(peer.status().code(), std::string(peer.status().message()));
        peer.status().ForEachPayload([&own](absl::string_view url, const absl::Cord& payload) {
          own.SetPayload(url, absl::Cord(std::string(payload)));
        });
        result->set_value(std::move(own));
      });
  // The reads are bounded by `timeout`; the margin covers a send that never completes.
  if (future.wait_for(absl::ToChronoNanoseconds(timeout + absl::Seconds(1))) !=
      std::future_status::ready) {
    conn->Close();
    return absl::DeadlineExceededError(absl::StrCat("handshake with ", conn->PeerAddress(),
                                                    " did not finish within ",
                                                    absl::FormatDuration(timeout)));
  }
  return future.get();
}

absl::StatusOr<std::shared_ptr<Connection>> ConnectAuthenticated(Context& context,
                                                                 absl::string_view address,
                                                                 uint64_t job_id, uint32_t rank,
                                                                 std::string secret,
                                                                 absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  auto conn = context.Connect(address, timeout);
  if (!conn.ok()) return conn.status();
  const absl::Duration remaining = std::max(deadline - absl::Now(), absl::Milliseconds(1));
  if (auto s = AuthenticateClient(*conn, job_id, rank, std::move(secret), remaining); !s.ok()) {
    // The handshake's reads are bounded by the deadline, and every backend fails a read that
    // ran out with DeadlineExceeded ("no frame from … within …", a stalled header or TLS
    // handshake), as AuthenticateClient does when the send never completes: silence. A
    // refusal (a bad key: Unauthenticated or PermissionDenied) or a closed socket
    // (Unavailable) is not, whenever it comes.
    if (absl::IsDeadlineExceeded(s)) {
      s = absl::Status(s.code(), absl::StrCat(s.message(),
                                              " (it took the connection and said "
                                              "nothing: frozen, or hung)"));
      s.SetPayload(kPeerSilentPayload, absl::Cord("1"));
    }
    return s;
  }
  if (auto s = (*conn)->WaitEstablished(std::max(deadline - absl::Now(), absl::Milliseconds(1)));
      !s.ok()) {
    (*conn)->Close();
    return s;
  }
  return conn;
}

}  // namespace poseidon::transport
