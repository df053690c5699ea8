#include "server/replicator.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace poseidon::server {

KvReplicaSender::KvReplicaSender(std::shared_ptr<transport::Context> context,
                                 std::shared_ptr<const transport::SecretStore> secrets,
                                 absl::Duration peer_timeout, absl::Duration connect_timeout)
    : context_(std::move(context)),
      secrets_(std::move(secrets)),
      peer_timeout_(peer_timeout),
      connect_timeout_(connect_timeout),
      thread_([this] { Run(); }) {}

KvReplicaSender::~KvReplicaSender() { Stop(); }

void KvReplicaSender::Stop() {
  std::vector<std::shared_ptr<KvClient>> clients;
  std::vector<Queued> queued;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_ && !thread_.joinable()) return;
    stop_ = true;
    for (auto& [id, link] : links_) {
      if (link.client) clients.push_back(link.client);
      for (auto& q : link.queue) queued.push_back(std::move(q));
      link.queue.clear();
    }
  }
  cv_.notify_all();
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
  for (auto& c : clients) c->Close();
  for (auto& q : queued) q.done(absl::UnavailableError("the server is stopping"));
}

void KvReplicaSender::SendOn(KvClient& client, Queued q) {
  const Ticket t = client.Replicate(q.header.key, q.header.clock, q.header.epoch, q.header.flags,
                                    std::move(q.payload));
  client.OnDone(t, std::move(q.done));
}

void KvReplicaSender::Send(uint64_t job_id, uint32_t from, uint32_t to,
                           const std::string& address,
                           const transport::FrameHeader& header,
                           std::vector<transport::ConstBuffer> payload,
                           std::function<void(absl::Status)> done) {
  Queued q{header, std::move(payload), std::move(done)};
  std::shared_ptr<KvClient> client;
  absl::Status refused;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) {
      refused = absl::UnavailableError("the server is stopping");
    } else {
      const LinkId id{job_id, from, to, address};
      Link& link = links_[id];
      ApplyDeclared(id, link);
      if (link.client) {
        client = link.client;
      } else if (!link.failed.ok()) {
        refused = link.failed;
      } else {
        link.queue.push_back(std::move(q));
        if (!link.connecting) {
          link.connecting = true;
          to_connect_.push_back(id);
          cv_.notify_all();
        }
        return;
      }
    }
  }
  if (!refused.ok()) return q.done(refused);
  SendOn(*client, std::move(q));
}

void KvReplicaSender::Prepare(uint64_t job_id, uint32_t from, uint32_t to,
                              const std::string& address) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stop_) return;
  const LinkId id{job_id, from, to, address};
  Link& link = links_[id];
  ApplyDeclared(id, link);
  if (link.client || !link.failed.ok() || link.connecting) return;
  link.connecting = true;
  link.prepared = true;
  to_connect_.push_back(id);
  cv_.notify_all();
}

void KvReplicaSender::ApplyDeclared(const LinkId& id, Link& link) const {
  if (link.client || !link.failed.ok() || declared_.empty()) return;
  const auto& [job, from, to, address] = id;
  if (auto d = declared_.find({job, to, address}); d != declared_.end()) link.failed = d->second;
}

bool KvReplicaSender::DeclaredDead(uint64_t job_id, uint32_t to,
                                   const std::vector<std::string>& addresses,
                                   const absl::Status& why) {
  std::vector<std::shared_ptr<KvClient>> clients;
  std::vector<Queued> queued;
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return false;
    for (const std::string& address : addresses) {
      if (!declared_.emplace(std::make_tuple(job_id, to, address), why).second) continue;
      first = true;
      for (auto& [id, link] : links_) {
        const auto& [job, from, link_to, link_address] = id;
        if (job != job_id || link_to != to || link_address != address) continue;
        // A connection in progress is closed when it returns (Run sees `failed`).
        link.failed = why;
        if (link.client) clients.push_back(std::exchange(link.client, nullptr));
        for (auto& q : link.queue) queued.push_back(std::move(q));
        link.queue.clear();
      }
    }
  }
  for (auto& c : clients) {
    c->Fail(why);  // its waiting replicas fail with `why`
    c->Close();
  }
  for (auto& q : queued) q.done(why);
  return first;
}

void KvReplicaSender::Run() {
  const absl::Duration tick =
      peer_timeout_ > absl::ZeroDuration() ? peer_timeout_ / 3 : absl::Seconds(5);
  absl::Time next_ping = absl::Now() + tick;
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    if (to_connect_.empty()) {
      cv_.wait_for(lock, absl::ToChronoNanoseconds(std::max(next_ping - absl::Now(),
                                                            absl::Milliseconds(1))));
    }
    if (stop_) break;
    if (!to_connect_.empty()) {
      const LinkId id = to_connect_.front();
      to_connect_.pop_front();
      const auto& [job, from, to, address] = id;
      lock.unlock();
      absl::StatusOr<std::shared_ptr<KvClient>> client;
      const absl::StatusOr<std::string> key = secrets_->KeyFor(job, transport::ServerRank(from));
      if (key.ok()) {
        client = KvClient::Connect(*context_, address, job, transport::ServerRank(from), *key,
                                   connect_timeout_);
      } else {
        client = key.status();
      }
      std::vector<Queued> queued;
      absl::Status failed;
      lock.lock();
      Link& link = links_[id];
      link.connecting = false;
      const bool prepared = std::exchange(link.prepared, false);
      if (!link.failed.ok()) {
        // Declared dead by the coordinator while this connection was made (DeclaredDead
        // failed what was queued).
        lock.unlock();
        if (client.ok()) (*client)->Close();
        lock.lock();
        continue;
      }
      if (prepared && !client.ok() && !stop_ &&
          !client.status().GetPayload(transport::kPeerSilentPayload).has_value()) {
        // Asked for ahead of the replicas, and not up yet or refused: the first replica asks
        // again (at once if one waits already).
        if (!link.queue.empty()) {
          link.connecting = true;
          to_connect_.push_back(id);
        }
        continue;
      }
      queued.swap(link.queue);
      if (client.ok() && !stop_) {
        // The queued replicas go first, in order, before any Send can use the client (a clock's
        // replica must never overtake the previous one's); callbacks only post to the engine.
        for (auto& q : queued) SendOn(**client, std::move(q));
        queued.clear();
        link.client = *client;
      } else {
        failed = client.ok() ? absl::UnavailableError("the server is stopping")
                             : absl::UnavailableError(absl::StrCat(
                                   "backup ", address, " of job ", job,
                                   " cannot be reached: ", client.status().message()));
        link.failed = failed;
        if (client.ok()) (*client)->Close();
      }
      lock.unlock();
      for (auto& q : queued) q.done(failed);
      lock.lock();
      continue;
    }
    if (absl::Now() < next_ping) continue;
    next_ping = absl::Now() + tick;
    std::vector<std::shared_ptr<KvClient>> clients;
    for (auto& [id, link] : links_) {
      if (link.client) clients.push_back(link.client);
    }
    lock.unlock();
    for (auto& c : clients) {
      if (peer_timeout_ > absl::ZeroDuration() && c->FailIfSilent(peer_timeout_)) {
        PSD_LOG_WARN("backup {} is silent: its replicas fail", c->server());
        continue;
      }
      c->OnDone(c->Ping(), [](absl::Status) {});
    }
    lock.lock();
  }
}

}  // namespace poseidon::server
