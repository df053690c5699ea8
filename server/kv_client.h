// KvClient: the C++ client of poseidon-server that agents use, in the manner of ps-lite's
// kv_app.h: Push and Pull start a request and return a Ticket at once; Wait(ticket) blocks until
// it completes (with a timeout, always). Buffers are used in place: a pushed span is sent
// without a copy and must stay unchanged, and a pull's destination written directly, until the
// request's Wait returns.
// Thread-safety: all methods may be called from any thread; tickets are per client.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "poseidon/v1/kv.pb.h"
#include "transport/transport.h"

namespace poseidon::server {

using Ticket = uint64_t;

// A key's progress as its server answers a registration (docs/wire.md): the completed clock (0
// for a new job, a resumed job's restored clock) and, for a lossy key that fell back to float32
// (a rank's divergence guard), the first float32 clock (0: still on its registered wire).
struct KeyProgress {
  uint64_t completed = 0;
  uint64_t exact_from = 0;
  bool operator==(const KeyProgress&) const = default;
};
static_assert(sizeof(KeyProgress) == 16, "the registration answer's layout (docs/wire.md)");
// The key field of a registration's answer (REGISTER_TABLES_ACK) when the registering rank is
// out of the job on that server (removed, not readmitted); 0 otherwise.
inline constexpr uint64_t kRankRemoved = 1;

// The largest PING payload a server reads (a bandwidth probe).
inline constexpr uint64_t kMaxProbeBytes = uint64_t{16} << 20;

class KvClient : public std::enable_shared_from_this<KvClient> {
 public:
  // Connects and authenticates as `rank` of `job_id` with that rank's `key`
  // (transport::RankKey of the job's secret; an agent's Credentials::server_key). With `connections` > 1 the client opens
  // that many connections to the server and spreads keys over them (key % connections), for
  // bandwidth where one TCP stream cannot fill the link; each key's requests stay in order.
  static absl::StatusOr<std::shared_ptr<KvClient>> Connect(
      transport::Context& context, const std::string& address, uint64_t job_id, uint32_t rank,
      const std::string& key, absl::Duration timeout, int connections = 1);
  // A client of a server that could not be reached (`why`): every request fails at once with
  // `why` (an agent's stand-in for a server lost before it connected, whose keys go on at their
  // backups).
  static std::shared_ptr<KvClient> Unreachable(const std::string& address, uint64_t job_id,
                                               uint32_t rank, absl::Status why);
  ~KvClient();

  // Registers the job's tables on this server. `keys` (if set) gets every key's progress in
  // request order, the tables' then the standby tables': all 0 for a new job, the restored
  // state of a resumed one (a standby key's: 0 unless this server holds a copy). `removed` (if
  // set): whether this rank is out of the job on this server (the world shrank without it, and
  // it was not readmitted: RegisterTablesRequest.readmit_from). `silent_after` (non-zero): the
  // server is taken as lost once it said nothing for that long (WaitAlive), before `timeout`.
  absl::Status RegisterTables(const v1::RegisterTablesRequest& request, absl::Duration timeout,
                              std::vector<KeyProgress>* keys = nullptr, bool* removed = nullptr,
                              absl::Duration silent_after = absl::ZeroDuration());

  // Pushes `data` as this rank's gradient of `key` for `clock` (init: the key's initial value,
  // rank 0 only, clock 0). `epoch`: the key's assignment epoch (replicated keys: the position of
  // this server in the key's chain; 0 otherwise).
  Ticket Push(uint64_t key, uint64_t clock, std::span<const float> data, bool init = false,
              uint32_t epoch = 0);

  // Pulls the value of `key` at `clock` into `into` (its size must equal the key's); the server
  // waits up to `server_timeout` for the clock to complete.
  Ticket Pull(uint64_t key, uint64_t clock, std::span<float> into,
              absl::Duration server_timeout = absl::Seconds(30), uint32_t epoch = 0);

  // The same on raw payloads, for a key whose wire type is not float32 (bf16: 2 bytes per
  // element, common/bf16.h), or a server-side rule's initial value (init).
  // exact_wire: a float32 payload for a key on a lossy wire (transport::kFlagExactWire: the
  // rank's divergence guard fell back).
  Ticket PushBytes(uint64_t key, uint64_t clock, std::span<const std::byte> payload,
                   uint32_t epoch = 0, bool init = false, bool replay = false,
                   bool exact_wire = false);

  // A pull that failed after its answer had begun to land in its destination (the destination
  // may be partly overwritten) carries this payload in its status (absl::Status::GetPayload):
  // the server had completed that clock.
  static constexpr char kAnswerStarted[] = "poseidon.kv/answer-started";
  // A key on a lossy wire: `into` holds the float32 value, and `lossy_bytes` (non-zero) is the
  // size of its 16-bit answer; either size is accepted (the pull says so, kFlagExactWire), the
  // answer lands at the start of `into` and `*received` (set before the ticket finishes) says
  // how many bytes it had.
  Ticket PullBytes(uint64_t key, uint64_t clock, std::span<std::byte> into,
                   absl::Duration server_timeout = absl::Seconds(30), uint32_t epoch = 0,
                   size_t lossy_bytes = 0, size_t* received = nullptr);

  // Replication between servers (a client authenticated as transport::ServerRank): the key's
  // state after `clock` at assignment `epoch`, in `payload` (gathered, used in place until the
  // ticket finishes); answered by REPLICATE_ACK or an error (Aborted: the backup is at a later
  // epoch).
  // `flags`: transport::kFlagExactWire where the key fell back to float32 at or before `clock`.
  Ticket Replicate(uint64_t key, uint64_t clock, uint32_t epoch, uint8_t flags,
                   std::vector<transport::ConstBuffer> payload);

  // Whether the connection failed or was closed (requests then fail at once): what tells a
  // lost server from an error the server sent.
  bool Broken();

  // Fails every pending request and closes the connection when requests are outstanding and
  // nothing (no answer, no PONG) came from the server for `limit` while they waited (time the
  // connection was idle, nothing owed, does not count): a frozen server. The caller pings it
  // more often than that. Returns whether it did.
  bool FailIfSilent(absl::Duration limit);

  // Waits for a ticket. DeadlineExceeded names the request if `timeout` passes first (the
  // request stays pending and may still be waited for).
  absl::Status Wait(Ticket ticket, absl::Duration timeout);
  // Wait, telling a frozen server from a slow one: while the ticket waits, the server is pinged
  // every third of `silent_after` (a live one answers at once, whatever it is busy with), and
  // once nothing came from it for `silent_after` the client fails (FailIfSilent: the ticket
  // fails Unavailable, "... is silent ...", and Broken() holds). Zero: Wait.
  absl::Status WaitAlive(Ticket ticket, absl::Duration timeout, absl::Duration silent_after);

  // Instead of Wait: `done` runs once with the ticket's result (on a transport I/O thread: it
  // must not block), and the ticket may not be waited for. If the ticket already finished,
  // `done` runs at once on the calling thread.
  void OnDone(Ticket ticket, std::function<void(absl::Status)> done);

  // A PING the server answers with PONG at once (from its I/O thread, after whatever this
  // connection has queued before it): Wait on the ticket for the round trip. On connection
  // `connection` % connections (default the first).
  Ticket Ping(size_t connection = 0);
  // Ping and Wait: the round-trip time, or the error (DeadlineExceeded after `timeout`; a late
  // PONG is then dropped).
  absl::StatusOr<absl::Duration> MeasureRoundTrip(absl::Duration timeout, size_t connection = 0);

  // The link's capacity towards the server: a PING carrying `bytes` of payload (a probe the
  // server reads and drops; at most kMaxProbeBytes), timed to its PONG, minus an empty PING's
  // round trip; the best of `probes` (bytes per second), and the shortest empty round trip
  // (kRoundTripSamples of them before each probe).
  static constexpr int kRoundTripSamples = 5;
  struct Probe {
    double bytes_per_second = 0;
    absl::Duration round_trip;
  };
  absl::StatusOr<Probe> MeasureBandwidth(uint64_t bytes, int probes, absl::Duration timeout);

  // Asks the server to checkpoint this job now and waits for it.
  // Asks the server to write a checkpoint of the job: iteration 0, at its next clock boundary
  // (every key at one clock); else every key's completed state at once, labelled `iteration`,
  // which the caller (rank 0's agent) sends between two of its iterations.
  absl::Status Checkpoint(absl::Duration timeout, uint64_t iteration = 0);

  // Called (on an I/O thread) for every pull response of at least `min_bytes` once its payload is
  // in, with the time from its header's arrival: the rate the link delivered it at, for a
  // capacity estimate (TelemetryReporter). Set before the first request.
  void SetPullObserver(uint64_t min_bytes, std::function<void(uint64_t bytes, absl::Duration)> f);

  // Closes the connection; pending requests fail with Unavailable.
  void Close();
  // The server is lost by someone else's word (the coordinator declared it dead): every pending
  // request fails with `why`, and so does every later one; Broken() holds. No-op when broken.
  void Fail(const absl::Status& why);

  const std::string& server() const { return address_; }

 private:
  struct Pending {
    std::string what;        // for errors: "push key 3 clock 7"
    std::span<std::byte> into;  // pulls
    size_t lossy_bytes = 0;     // a lossy key's pull: the other size its answer may have
    size_t* received = nullptr;  // where that pull reports the size it got
    uint64_t* ack_key = nullptr;  // a registration: where its answer's key field goes
    bool answer_started = false;  // a pull's payload began to be read into `into`
    bool send_done = false;  // the push payload has left our buffer
    bool answered = false;
    absl::Status status;
    std::function<void(absl::Status)> on_done;  // OnDone's callback, if any
  };
  // Runs and forgets the callback of a finished ticket. Called with mu_ held: unlocks it.
  void RunCallbackLocked(std::unique_lock<std::mutex>& lock, uint64_t sequence);
  // Wait's body: the ticket's result, or nullopt (the ticket still pending) if `timeout` passed.
  std::optional<absl::Status> WaitUpTo(Ticket ticket, absl::Duration timeout);
  absl::Status NoAnswerWithin(Ticket ticket, absl::Duration timeout);  // DeadlineExceeded

  KvClient(std::vector<std::shared_ptr<transport::Connection>> conns, std::string address,
           uint64_t job_id, uint32_t rank);
  Ticket Start(size_t conn, transport::FrameHeader header,
               std::vector<transport::ConstBuffer> payload, Pending pending,
               std::shared_ptr<std::vector<std::byte>> owned = nullptr);
  // The connection of a key (or a connection index); 0 for an Unreachable client, whose Start
  // fails before it touches a connection.
  size_t ConnFor(uint64_t n) const { return conns_.empty() ? 0 : n % conns_.size(); }
  void ReadLoop(size_t conn);
  void OnResponse(size_t conn, const transport::FrameHeader& header);
  void Finish(uint64_t sequence, absl::Status status, bool answer);
  void FailAll(const absl::Status& status);

  std::vector<std::shared_ptr<transport::Connection>> conns_;
  std::string address_;
  uint64_t job_id_;
  uint32_t rank_;

  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t next_sequence_ = 1;
  std::map<uint64_t, Pending> pending_;
  absl::Status broken_;                                // set once the connection failed
  std::vector<std::vector<std::byte>> error_buffers_;  // one per connection (its read loop's)
  std::atomic<int64_t> last_heard_ns_{0};               // a header arrived (CLOCK_MONOTONIC)
  int64_t waiting_since_ns_ = 0;  // under mu_: when pending_ last became non-empty (monotonic)
  uint64_t observe_min_bytes_ = 0;                     // set before use, then read-only
  std::function<void(uint64_t, absl::Duration)> pull_observer_;
};

}  // namespace poseidon::server
