#include "transport/frame_server.h"

#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace poseidon::transport {

void PeerSession::PauseReading() {
  std::lock_guard<std::mutex> lock(pause_mu_);
  pause_requested_ = true;
}

void PeerSession::ResumeReading() {
  {
    std::lock_guard<std::mutex> lock(pause_mu_);
    pause_requested_ = false;
    if (!parked_) return;
    parked_ = false;
  }
  if (auto server = server_.lock()) server->ReadNext(shared_from_this());
}

bool PeerSession::ParkIfPaused() {
  std::lock_guard<std::mutex> lock(pause_mu_);
  if (!pause_requested_) return false;
  parked_ = true;
  return true;
}

FrameServer::FrameServer(std::shared_ptr<Listener> listener,
                         std::shared_ptr<const SecretStore> secrets,
                         std::shared_ptr<FrameHandler> handler, FrameServerOptions options)
    : listener_(std::move(listener)),
      secrets_(std::move(secrets)),
      handler_(std::move(handler)),
      options_(options) {}

FrameServer::~FrameServer() {
  Stop();
}

void FrameServer::Start() {
  AcceptNext();
}

void FrameServer::Stop() {
  std::set<std::shared_ptr<Connection>> connections;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) return;
    stopped_ = true;
    connections.swap(connections_);
  }
  listener_->Close();
  for (const auto& c : connections) c->Close();
}

FrameServerStats FrameServer::Stats() const {
  FrameServerStats s;
  s.accepted = accepted_.load();
  s.authenticated = authenticated_.load();
  s.handshake_failures = handshake_failures_.load();
  s.protocol_errors = protocol_errors_.load();
  s.frames = frames_.load();
  s.refused = refused_.load();
  {
    std::lock_guard<std::mutex> lock(const_cast<std::mutex&>(mu_));
    s.active = connections_.size();
    s.handshaking = handshaking_;
  }
  return s;
}

void FrameServer::AcceptNext() {
  std::weak_ptr<FrameServer> weak = weak_from_this();
  listener_->Accept([weak](absl::StatusOr<std::shared_ptr<Connection>> conn) {
    auto self = weak.lock();
    if (!self) {
      if (conn.ok()) (*conn)->Close();
      return;
    }
    if (!conn.ok()) {
      if (absl::IsCancelled(conn.status())) return;  // listener closed
      PSD_LOG_WARN("accept on {} failed: {}", self->Address(), conn.status().message());
      self->AcceptNext();
      return;
    }
    self->OnAccepted(std::move(*conn));
    self->AcceptNext();
  });
}

namespace {

// The host part of "host:port" and "[v6]:port"; an address without a port is its own host.
std::string HostOf(const std::string& address) {
  if (!address.empty() && address[0] == '[') {
    const size_t close = address.find(']');
    return close == std::string::npos ? address : address.substr(0, close + 1);
  }
  const size_t colon = address.find(':');
  if (colon == std::string::npos || address.find(':', colon + 1) != std::string::npos) {
    return address;
  }
  return address.substr(0, colon);
}

}  // namespace

void FrameServer::EndHandshakeLocked(const std::string& host) {
  --handshaking_;
  auto it = handshaking_by_host_.find(host);
  if (it != handshaking_by_host_.end() && --it->second == 0) handshaking_by_host_.erase(it);
}

void FrameServer::OnAccepted(std::shared_ptr<Connection> conn) {
  accepted_.fetch_add(1);
  const std::string host = HostOf(conn->PeerAddress());
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) {
      conn->Close();
      return;
    }
    std::string refusal;
    if (handshaking_ >= options_.max_handshakes) {
      refusal = absl::StrCat("server has ", handshaking_,
                             " connections in their handshake, its limit");
    } else if (handshaking_by_host_[host] >= options_.max_handshakes_per_address) {
      refusal = absl::StrCat("server has ", handshaking_by_host_[host], " connections from ", host,
                             " in their handshake, its limit per address");
    }
    if (!refusal.empty()) {
      if (handshaking_by_host_[host] == 0) handshaking_by_host_.erase(host);
      refused_.fetch_add(1);
      conn->Abort(absl::ResourceExhaustedError(refusal));
      return;
    }
    ++handshaking_;
    ++handshaking_by_host_[host];
    connections_.insert(conn);
  }
  std::weak_ptr<FrameServer> weak = weak_from_this();
  AcceptHandshake(conn, secrets_, options_.handshake_timeout,
                  [weak, conn, host](absl::StatusOr<PeerIdentity> identity) {
                    auto self = weak.lock();
                    if (!self) return;
                    if (!identity.ok()) {
                      self->handshake_failures_.fetch_add(1);
                      PSD_LOG_WARN("rejected connection from {}: {}", conn->PeerAddress(),
                                   identity.status().message());
                      std::lock_guard<std::mutex> lock(self->mu_);
                      self->EndHandshakeLocked(host);
                      self->connections_.erase(conn);
                      return;
                    }
                    {
                      std::lock_guard<std::mutex> lock(self->mu_);
                      self->EndHandshakeLocked(host);
                      const size_t authenticated =
                          self->connections_.size() - self->handshaking_;
                      if (authenticated > self->options_.max_connections) {
                        self->connections_.erase(conn);
                        self->refused_.fetch_add(1);
                        conn->Abort(absl::ResourceExhaustedError(absl::StrCat(
                            "server has reached its limit of ", self->options_.max_connections,
                            " connections")));
                        return;
                      }
                      ++self->peers_[{identity->job_id, identity->rank}];
                    }
                    self->authenticated_.fetch_add(1);
                    auto peer = std::make_shared<PeerSession>(conn, *identity, weak);
                    self->ReadNext(peer);
                  });
}

void FrameServer::Drop(const std::shared_ptr<PeerSession>& peer,
                       const std::shared_ptr<Connection>& conn, const absl::Status& reason,
                       bool protocol_error) {
  if (protocol_error) {
    protocol_errors_.fetch_add(1);
    conn->Abort(reason);  // logs the reason, tells the peer, closes
  } else {
    conn->Close();
  }
  handler_->OnClose(peer, reason);
  std::lock_guard<std::mutex> lock(mu_);
  connections_.erase(conn);
  const std::pair<uint64_t, uint32_t> who{peer->identity().job_id, peer->identity().rank};
  if (auto it = peers_.find(who); it != peers_.end() && --it->second == 0) peers_.erase(it);
}

void FrameServer::Serve(std::shared_ptr<Connection> conn, PeerIdentity identity) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) {
      conn->Close();
      return;
    }
    connections_.insert(conn);
    ++peers_[{identity.job_id, identity.rank}];
  }
  authenticated_.fetch_add(1);
  ReadNext(std::make_shared<PeerSession>(std::move(conn), identity, weak_from_this()));
}

bool FrameServer::HasPeer(uint64_t job_id, uint32_t rank) {
  std::lock_guard<std::mutex> lock(mu_);
  return peers_.count({job_id, rank}) > 0;
}

void FrameServer::ReadNext(const std::shared_ptr<PeerSession>& peer) {
  std::weak_ptr<FrameServer> weak = weak_from_this();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) return;
  }
  peer->connection().ReadHeader([weak, peer](absl::StatusOr<FrameHeader> header) {
    auto self = weak.lock();
    if (!self) return;
    const std::shared_ptr<Connection>& conn = peer->shared_connection();
    if (!header.ok()) {
      // The connection has already logged and closed for a malformed frame; a clean close by
      // the peer is not a protocol error.
      const bool malformed =
          !absl::IsUnavailable(header.status()) && !absl::IsCancelled(header.status());
      if (malformed) self->protocol_errors_.fetch_add(1);
      self->Drop(peer, conn, header.status(), /*protocol_error=*/false);
      return;
    }
    if (header->job_id != peer->identity().job_id) {
      self->Drop(peer, conn,
                 absl::PermissionDeniedError(absl::StrCat("frame for job ", header->job_id,
                                                          " on a connection authenticated for job ",
                                                          peer->identity().job_id)),
                 true);
      return;
    }
    // The sender is who the handshake proved, not what the header says: a peer with the job's
    // secret must not push as another rank (whose own push would then be dropped as a duplicate).
    if (header->sender_rank != peer->identity().rank) {
      self->Drop(peer, conn,
                 absl::PermissionDeniedError(absl::StrCat(
                     "frame from rank ", header->sender_rank,
                     " on a connection authenticated as rank ", peer->identity().rank)),
                 true);
      return;
    }
    switch (header->type) {
      case FrameType::kHello:
      case FrameType::kChallenge:
      case FrameType::kAuth:
      case FrameType::kAuthOk:
        self->Drop(peer, conn,
                   absl::InvalidArgumentError(absl::StrCat(
                       "handshake frame ", FrameTypeName(header->type), " after authentication")),
                   true);
        return;
      default:
        break;
    }
    auto target = self->handler_->OnHeader(peer, *header);
    if (!target.ok()) {
      self->Drop(peer, conn, target.status(), true);
      return;
    }
    if (header->payload_length == 0) {
      self->frames_.fetch_add(1);
      self->handler_->OnFrame(peer, *header, {});
      if (!peer->ParkIfPaused()) self->ReadNext(peer);
      return;
    }
    auto on_payload = [weak, peer, conn, h = *header,
                       buffer =
                           target->discard ? MutableBuffer{} : target->buffer](absl::Status s) {
      auto server = weak.lock();
      if (!server) return;
      if (!s.ok()) {
        server->Drop(peer, conn, s, false);
        return;
      }
      server->frames_.fetch_add(1);
      server->handler_->OnFrame(peer, h, buffer);
      if (!peer->ParkIfPaused()) server->ReadNext(peer);
    };
    if (target->discard) {
      conn->DiscardPayload(std::move(on_payload));
    } else if (target->buffer.size() != header->payload_length) {
      self->Drop(peer, conn,
                 absl::InternalError(absl::StrCat("handler gave a ", target->buffer.size(),
                                                  "-byte buffer for a ", header->payload_length,
                                                  "-byte payload")),
                 true);
    } else {
      conn->ReadPayload(target->buffer, std::move(on_payload));
    }
  });
}

}  // namespace poseidon::transport
