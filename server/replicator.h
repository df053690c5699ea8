// KvReplicaSender: how poseidon-server reaches the backups of the keys it is the primary of
// (KvEngine's ReplicaSender; DESIGN.md "Faults"). One KvClient per (job, backup address),
// authenticated as transport::ServerRank(this server's index) with that rank's key derived from
// the job's secret (which agents never hold). Connections are made on the sender's own thread
// (Connect blocks; Send is called from engine workers), and a backup that answers nothing, not
// even the pings this thread sends every peer_timeout / 3, for peer_timeout while a replica
// waits is failed like a closed one. A backup whose connection failed once is not retried: the
// engine gives it up for good (a copy that missed a clock must never be promoted). The engine
// asks for the connections to its backups when a job registers (Prepare), so a frozen backup's
// handshake runs while the agents register, not after. A backup the coordinator declared dead
// (DeclaredDead, from the server's heartbeats) fails at once, every replica to it from then on.
// Thread-safety: every method may be called from any thread.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/time/time.h"
#include "server/kv_client.h"
#include "server/kv_engine.h"
#include "transport/handshake.h"
#include "transport/transport.h"

namespace poseidon::server {

class KvReplicaSender : public ReplicaSender {
 public:
  static constexpr absl::Duration kConnectTimeout = absl::Seconds(10);
  KvReplicaSender(std::shared_ptr<transport::Context> context,
                  std::shared_ptr<const transport::SecretStore> secrets,
                  absl::Duration peer_timeout, absl::Duration connect_timeout = kConnectTimeout);
  ~KvReplicaSender() override;  // Stop()

  void Send(uint64_t job_id, uint32_t from, uint32_t to, const std::string& address,
            const transport::FrameHeader& header, std::vector<transport::ConstBuffer> payload,
            std::function<void(absl::Status)> done) override;
  // Connects at once (on the sender's thread): a Send that comes later finds the connection,
  // or a frozen backup's silence (the handshake ran out), instead of waiting for the handshake.
  // Any other failure (not up yet, refused) is left to the first Send, which connects again.
  void Prepare(uint64_t job_id, uint32_t from, uint32_t to, const std::string& address) override;

  // The coordinator declared backup `to` of `job_id` dead (HeartbeatResponse.lost_servers):
  // every link to it at one of `addresses` fails with `why` — the replicas waiting on it, those
  // queued for its connection, and every later one — so the engine gives it up at once rather
  // than at peer_timeout. Links to that index at another address (a list that does not name
  // it there) are left alone. Idempotent: the coordinator repeats it at every heartbeat; true
  // the first time only.
  bool DeclaredDead(uint64_t job_id, uint32_t to, const std::vector<std::string>& addresses,
                    const absl::Status& why);

  // Closes every connection (waiting replicas fail with Unavailable) and joins the thread.
  void Stop();

 private:
  struct Queued {
    transport::FrameHeader header;
    std::vector<transport::ConstBuffer> payload;
    std::function<void(absl::Status)> done;
  };
  struct Link {
    std::shared_ptr<KvClient> client;
    absl::Status failed;  // the connection could not be made
    bool connecting = false;
    // The connection in progress was asked for by Prepare (ahead of any replica): if it fails
    // other than by silence (the backup not up yet, refusing), the first replica connects
    // afresh, as it would without Prepare; a silent (frozen) backup is failed for good.
    bool prepared = false;
    std::vector<Queued> queue;  // sends waiting for the connection
  };
  // job, from, to, address: a server that joined the running job at a lost one's address (a
  // restarted daemon) is another link than the lost one, given up for good.
  using LinkId = std::tuple<uint64_t, uint32_t, uint32_t, std::string>;
  // The coordinator's word on (job, to, address) for a link made after it (under mu_).
  void ApplyDeclared(const LinkId& id, Link& link) const;
  static void SendOn(KvClient& client, Queued q);
  void Run();

  std::shared_ptr<transport::Context> context_;
  std::shared_ptr<const transport::SecretStore> secrets_;
  absl::Duration peer_timeout_;
  absl::Duration connect_timeout_;

  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::map<LinkId, Link> links_;
  // (job, to, address) -> why: backups the coordinator declared dead (DeclaredDead).
  std::map<std::tuple<uint64_t, uint32_t, std::string>, absl::Status> declared_;
  std::deque<LinkId> to_connect_;
  std::thread thread_;  // last: starts once the rest exists
};

}  // namespace poseidon::server
