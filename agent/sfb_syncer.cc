// The sufficient-factor-broadcasting syncer: an FC layer's factors U (K x M) and V (K x N) go
// from shared memory to every other agent, and the summed gradient sum_p U_p^T V_p is rebuilt
// locally, ranks in order (on the GPU with one cuBLAS GEMM when the layer is on the device).
// Received factors land in two slots per layer (iteration parity: a peer is at most one
// iteration ahead of us on a layer). The credit of a layer's task covers its sends and is held
// until every peer's factors are in (parked once our sends are out). Frames carry the job's
// iteration (SyncEnv::clock_base). In a job that takes restarted ranks back (--rejoin_timeout)
// our own factors of the last two iterations are kept in our slots of the inbox: a restarted
// rank that takes up the job at iteration T gets them again (PeerBack: its predecessor may have
// died before they arrived, and ours in shared memory may be a later iteration's by then), and
// its factors of an iteration we have are taken as a retransmission.
// A rank removed from the job (--min_workers, PeerRemoved) may have died while sending its
// factors of an iteration, so that some agents have them and others not, and some may have
// completed that iteration with them. Each live agent therefore sends every other the removed
// rank's factors it holds of its last two iterations (relayed frames), then the highest iteration
// it holds them of (a HELD frame, on the same connection: after the relays). Once every live
// agent told, each layer's cut is the highest of those, the same on every agent: the removed
// rank's factors count up to the cut (those anyone has are relayed to all) and not after. A
// layer that averages (PSD_LAYER_AVERAGE) divides each iteration's sum by the ranks it counted.
// A removed rank that comes back (ComeBack, a readmitted replacement) asks every live agent
// where its SFB layers are (a RETURN frame); each answers, once it has removed the rank and
// agreed its cut on every layer, with the highest iteration b it sent factors of, and from then
// on its layers wait for the rank from b + 1 on. Under BSP the answers differ by at most one
// (an agent cannot send b + 1 before every other sent b), so F = min(b) + 2 is past every
// agent's held iteration and the agents still reach F - 1 (each can complete what it holds
// below F once it knows F, and push its PS layers of F - 1). The rank takes up the job at F:
// its PING names F, and from F on every agent counts it again and sends it its factors (those
// of F it sent already go again, PeerBack).
// Thread model: Start, CheckDeadlines, PeerRemoved, ComeBack (which waits on answered_) and
// Waiting on the agent's main thread; the send task and large rebuilds on scheduler workers; the
// inbound path (OnHeader/OnFrame, which also takes the HELD and RETURN frames, may start a
// rebuild and, for a RETURN, PeerRemoved), PeerBack and send completions on transport I/O
// threads. mu_ guards every inbox, its cuts, the removed and returning ranks, the answers to our
// return and the held credits; it is never held across a transport call, a GEMM or a callback
// into the agent.
#include <cblas.h>

#include <algorithm>
#include <condition_variable>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "agent/syncer.h"
#include "agent/telemetry_reporter.h"
#include "agent/timeline.h"
#include "common/log.h"
#include "common/status.h"
#include "transport/handshake.h"

namespace poseidon::agent {
namespace {

using transport::FrameHeader;
using transport::FrameType;

// A small host rebuild (at most this many multiply-adds: ~1 ms on one core) runs at once on the
// thread that completed its inputs (the last factors' receive or our last send): handing it to
// a worker costs a wake-up, which on a loaded machine is longer than the GEMMs. Larger ones, and
// the GPU's, go through the queue in priority order.
constexpr uint64_t kInlineRebuildMacs = uint64_t{1} << 22;

// Up to which iteration the factors of a rank removed from the job count on one layer.
struct Cut {
  std::optional<uint64_t> own;        // the highest we held, once this agent removed the rank
  std::map<uint32_t, uint64_t> told;  // by live peer: the highest it held (its HELD frame)
  std::optional<uint64_t> agreed;     // the highest of all, once every live agent told
  std::optional<uint64_t> back_from;  // the rank came back: it counts again from here
};

// A removed rank that asked to come back (its RETURN frame).
struct Returning {
  std::shared_ptr<transport::Connection> link;  // its connection to us: our answer goes there
  std::optional<uint64_t> hold_from;            // answered: our layers wait for it from here
};

struct Inbox {
  uint64_t floats = 0;           // k * (m + n)
  std::vector<float> data[2];    // world_size * floats each
  std::vector<uint64_t> tag[2];  // per peer: the iteration held, 0 if none
  // Progress of the current iteration.
  uint64_t sent = 0;      // iteration whose factors we have started sending
  int sends_pending = 0;  // our sends of `sent` not yet handed to the network
  absl::Status send_error;
  uint64_t rebuild_queued = 0;  // iteration whose rebuild is queued
  uint64_t finished = 0;        // iteration completed or failed
  bool on_device = false;       // `sent` was posted on the GPU
  absl::Time started;           // when `sent` began (the watchdog's clock)
  uint32_t priority = 0;
  std::shared_ptr<Credit> credit;  // of `sent`, until every peer's factors are in
  std::map<uint32_t, Cut> cuts;    // by rank removed from the job (or told of by a peer)
  bool average = false;            // the result is the mean over the ranks counted
};

class SfbSyncer final : public Syncer, public transport::FrameHandler {
 public:
  explicit SfbSyncer(SyncEnv& env)
      : env_(env),
        keep_own_(env.config->rejoin_timeout > absl::ZeroDuration() || env.config->rejoin),
        // A rank that may be restarted gets our factors again from our slot (PeerBack); one
        // that may be removed is no longer waited for (PeerRemoved): a failed send to either
        // is not the layer's failure (one to a rank that stays fails its own wait, and ours
        // for its factors names it).
        tolerate_failed_sends_(keep_own_ || env.config->min_workers > 0) {
    const uint32_t world = env.config->world_size;
    for (uint32_t i = 0; i < env.table->layers.size(); ++i) {
      const LayerSpec& st = env.table->layers[i];
      if (!st.sfb_capable) continue;
      Inbox& box = inbox_[i];
      box.floats = st.k * (st.m + st.n);
      box.average = st.desc.average;
      for (int s = 0; s < 2; ++s) {
        box.data[s].assign(box.floats * world, 0.0f);
        box.tag[s].assign(world, 0);
      }
    }
  }

  int Parts(uint32_t) const override { return 1; }
  transport::FrameHandler* peer_handler() override { return this; }

  void Start(const Post& process_post) override {
    Post post = process_post;
    post.iteration += env_.clock_base;  // the job's iteration, as our frames carry it
    const LayerSpec& st = env_.table->layers[post.layer];
    const uint64_t factor_bytes = st.k * (st.m + st.n) * sizeof(float);
    Scheduler::Task task;
    task.priority = post.priority;
    task.bytes = factor_bytes * std::max<uint32_t>(1, env_.config->world_size - 1);
    const absl::Time queued = absl::Now();
    task.run = [this, post, queued](std::shared_ptr<Credit> credit) {
      SendFactors(post, queued, std::move(credit));
    };
    if (!post.on_device) {
      env_.scheduler->Submit(std::move(task));
      return;
    }
    // Once both factors are on the host.
    auto staged = std::make_shared<Scheduler::Task>(std::move(task));
    const DeviceRange ranges[2] = {{st.layout.u_offset, st.k * st.m * sizeof(float)},
                                   {st.layout.v_offset, st.k * st.n * sizeof(float)}};
    const absl::Status s = env_.stager->load(std::memory_order_acquire)
                               ->StageOut(post.layer, ranges, [this, staged](size_t i) {
                                 if (i == 1) env_.scheduler->Submit(std::move(*staged));
                               });
    if (!s.ok()) Finish(post.layer, post.iteration, s);
  }

  std::string Waiting(uint32_t layer, uint64_t iteration,
                      const std::vector<uint8_t>&) const override {
    std::lock_guard<std::mutex> lock(mu_);
    return absl::StrCat("SFB factors from ranks [",
                        absl::StrJoin(MissingLocked(layer, iteration + env_.clock_base), ", "),
                        "]");
  }

  // The watchdog: layers whose peers' factors did not all arrive in time fail, naming the
  // ranks that are missing.
  void PeersGone(const std::map<uint32_t, std::string>& gone) override {
    std::lock_guard<std::mutex> lock(mu_);
    gone_ = gone;
  }

  void CheckDeadlines(absl::Time now) override {
    std::vector<std::pair<std::pair<uint32_t, uint64_t>, absl::Status>> expired;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [layer, box] : inbox_) {
        if (box.sent == 0 || box.finished == box.sent || box.rebuild_queued == box.sent) continue;
        const std::vector<uint32_t> missing = MissingLocked(layer, box.sent);
        if (auto g = std::find_if(missing.begin(), missing.end(),
                                  [&](uint32_t r) {
                                    return gone_.contains(r) && !removed_.contains(r);
                                  });
            g != missing.end()) {
          box.finished = box.sent;
          box.credit.reset();
          expired.push_back({{layer, box.sent},
                             absl::UnavailableError(absl::StrCat(
                                 gone_.at(*g), "; SFB factors of clock ", box.sent,
                                 " from it cannot arrive"))});
          continue;
        }
        if (now - box.started < env_.config->sync_timeout) continue;
        box.finished = box.sent;
        box.credit.reset();
        expired.push_back(
            {{layer, box.sent},
             absl::DeadlineExceededError(absl::StrCat(
                 "SFB factors of clock ", box.sent, " not received from ranks [",
                 absl::StrJoin(missing, ", "), "] within ",
                 absl::FormatDuration(env_.config->sync_timeout)))});
      }
    }
    for (auto& [at, status] : expired) Finish(at.first, at.second, status);
  }

  // A restarted agent took up `rank` at iteration `clock`: our kept factors of that iteration
  // and the next, where we have them, go to it again (the frames we sent before went to the
  // agent it replaces, or nowhere). Transport I/O thread. The slots sent from are not rewritten
  // before the restarted rank has them: our factors of T + 2 need its factors of T + 1, which
  // it computes once it has ours of T.
  // A removed rank that came back (it asked, ComeBack) counts again from `clock` on every layer:
  // what we held for it below `clock` completes without it.
  void PeerBack(uint32_t rank, uint64_t clock) override {
    if (!keep_own_ || rank >= env_.config->world_size || rank == env_.config->rank) return;
    std::vector<Rebuild> ready;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (auto back = returning_.find(rank); back != returning_.end()) {
        if (!back->second.hold_from || clock < *back->second.hold_from) {
          // Cannot happen under BSP (ComeBack checks the answers): say so rather than diverge
          // silently; its layers wait for it and fail at sync_timeout, naming it.
          PSD_LOG_ERROR("rank {} takes up the job at iteration {}, before the iteration this "
                        "agent's SFB layers wait for it from ({}): its factors are not counted",
                        rank, clock,
                        back->second.hold_from ? absl::StrCat(*back->second.hold_from)
                                               : "this agent never answered its return");
        } else {
          removed_.erase(rank);
          returning_.erase(back);  // no longer held: each layer waits as its cut says
          for (auto& [layer, box] : inbox_) box.cuts[rank].back_from = clock;
          ready = RebuildsDueLocked();
          PSD_LOG_WARN("rank {} came back: its SFB factors count again from iteration {}", rank,
                       clock);
        }
      }
    }
    for (const Rebuild& r : ready) StartRebuild(r);
    const std::shared_ptr<transport::Connection> link = env_.peers.Get(rank);
    if (link == nullptr) return;
    const uint32_t me = env_.config->rank;
    struct Resend {
      uint32_t layer;
      uint64_t clock;
      const float* data;
      uint64_t floats;
    };
    std::vector<Resend> resend;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& [layer, box] : inbox_) {
        for (int slot = 0; slot < 2; ++slot) {
          if (box.tag[slot][me] >= clock) {
            resend.push_back({layer, box.tag[slot][me], box.data[slot].data() + me * box.floats,
                              box.floats});
          }
        }
      }
    }
    for (const Resend& r : resend) {
      link->Send(FactorsHeader(r.layer, r.clock, r.floats * sizeof(float)),
                 {std::as_bytes(std::span(r.data, r.floats))},
                 [layer = r.layer, c = r.clock, rank](absl::Status s) {
                   if (!s.ok()) {
                     PSD_LOG_WARN("layer {}: SFB factors of clock {} not sent again to rank {}: {}",
                                  layer, c, rank, s.message());
                   }
                 });
    }
    if (!resend.empty()) {
      PSD_LOG_INFO("sent rank {} again {} SFB factor frames of iteration {} on", rank,
                   resend.size(), clock);
    }
  }

  // `rank` left the job for good: send every live peer its factors we hold of its last two
  // iterations, then the highest iteration we hold them of, for every layer; the cut of each
  // layer follows once every live peer told us theirs (TryAgreeLocked).
  void PeerRemoved(uint32_t rank) override {
    const uint32_t me = env_.config->rank;
    if (rank >= env_.config->world_size || rank == me) return;
    struct Relay {
      uint32_t layer;
      uint64_t clock;
      std::shared_ptr<std::vector<float>> factors;  // a copy: a relay may refill the slot
    };
    std::vector<Relay> relays;
    std::vector<std::pair<uint32_t, uint64_t>> held;  // by layer
    std::vector<Rebuild> ready;
    std::vector<uint32_t> live;
    std::vector<Answer> answers;  // to ranks coming back, now that the cuts are agreed
    // A rank that died before it announced itself (its PING) is no longer waited for by the
    // first iteration's layers (SendFactors): they go on without it once the cut is agreed.
    env_.peer_gate->MarkReady(rank);
    DropReturn(rank);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!removed_.insert(rank).second) return;
      for (uint32_t p = 0; p < env_.config->world_size; ++p) {
        if (p != me && !removed_.contains(p)) live.push_back(p);
      }
      for (auto& [layer, box] : inbox_) {
        const uint64_t top = std::max(box.tag[0][rank], box.tag[1][rank]);
        CutLocked(box, rank).own = top;
        held.emplace_back(layer, top);
        for (int slot = 0; slot < 2; ++slot) {
          const uint64_t c = box.tag[slot][rank];
          if (c == 0 || c + 1 < top || c <= env_.clock_base) continue;
          const float* from = box.data[slot].data() + rank * box.floats;
          relays.push_back(
              {layer, c, std::make_shared<std::vector<float>>(from, from + box.floats)});
        }
        // Fewer live peers: a cut waiting for this rank's word is agreed without it.
        for (auto& [removed, cut] : box.cuts) TryAgreeLocked(layer, box, removed);
      }
      ready = RebuildsDueLocked();
      answers = AnswersLocked();
    }
    SendAnswers(answers);
    for (uint32_t p : live) {
      const std::shared_ptr<transport::Connection> link = env_.peers.Get(p);
      if (link == nullptr) continue;
      auto logged = [p, rank](absl::Status s) {
        if (!s.ok()) {
          PSD_LOG_WARN("rank {}'s SFB factors not passed on to rank {}: {}", rank, p,
                       s.message());
        }
      };
      for (const Relay& r : relays) {
        FrameHeader h = FactorsHeader(r.layer, r.clock, r.factors->size() * sizeof(float));
        h.flags |= transport::kFlagRelayed;
        h.sequence = rank;
        link->Send(h, {std::as_bytes(std::span(*r.factors))}, [keep = r.factors, logged](
                                                                  absl::Status s) { logged(s); });
      }
      for (const auto& [layer, top] : held) {
        FrameHeader h = FactorsHeader(layer, top, 0);
        h.flags |= transport::kFlagRelayed;
        h.sequence = rank;
        link->Send(h, {}, logged);
      }
    }
    PSD_LOG_INFO("rank {} removed: its SFB factors of {} layer iterations passed on to the {} "
                 "live peers, with the highest iteration held of each layer",
                 rank, relays.size(), live.size());
    for (const Rebuild& r : ready) StartRebuild(r);
  }

  // `rank` asked to come back (ComeBack) and is gone before it took up the job: what waited for
  // its word goes on without it, and it stays removed at the cut agreed before.
  void DropReturn(uint32_t rank) {
    std::vector<Rebuild> ready;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (returning_.erase(rank) == 0) return;
      ready = RebuildsDueLocked();
    }
    PSD_LOG_WARN("rank {} asked to come back and is gone before it took up the job: its SFB "
                 "factors count up to the cut agreed before, not after",
                 rank);
    for (const Rebuild& r : ready) StartRebuild(r);
  }

  // ---- Inbound factors (transport I/O threads) ----

  absl::StatusOr<transport::PayloadTarget> OnHeader(
      const std::shared_ptr<transport::PeerSession>& peer, const FrameHeader& h) override {
    if (h.type != FrameType::kFactors) {
      return absl::InvalidArgumentError("agents only exchange SFB factors");
    }
    const uint32_t from = peer->identity().rank;
    const uint32_t world = env_.config->world_size;
    if (from >= world || from == env_.config->rank || h.sender_rank != from) {
      return absl::PermissionDeniedError(
          absl::StrCat("factors from rank ", h.sender_rank, " on a connection of rank ", from));
    }
    if (h.key >= env_.table->layers.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("factors for layer ", h.key, " of ", env_.table->layers.size()));
    }
    if ((h.flags & transport::kFlagReturn) != 0) return OnReturnFrame(peer, h);
    const bool relayed = (h.flags & transport::kFlagRelayed) != 0;
    if (relayed && (h.sequence >= world || h.sequence == env_.config->rank || h.sequence == from)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rank ", from, " passes on factors of rank ", h.sequence, " (of ", world, ")"));
    }
    const auto origin = relayed ? static_cast<uint32_t>(h.sequence) : from;
    std::optional<Rebuild> rebuild;
    std::vector<Answer> answers;
    absl::StatusOr<transport::PayloadTarget> target = transport::PayloadTarget::Discard();
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = inbox_.find(static_cast<uint32_t>(h.key));
      if (it == inbox_.end()) {
        return absl::InvalidArgumentError(
            absl::StrCat("layer ", h.key, " cannot run SFB here (no factor buffers)"));
      }
      Inbox& box = it->second;
      if (relayed && h.payload_length == 0) {  // HELD: the highest iteration `from` holds
        Cut& cut = CutLocked(box, origin);
        if (!cut.told.emplace(from, h.clock).second) {
          return absl::InvalidArgumentError(absl::StrCat(
              "rank ", from, " told twice which factors of rank ", origin, " it holds"));
        }
        TryAgreeLocked(it->first, box, origin);
        if (box.sent != 0) rebuild = MaybeRebuildLocked(it->first, box.sent);
        answers = AnswersLocked();
      } else {
        target = InboundLocked(box, h, origin, relayed);
      }
    }
    if (rebuild) StartRebuild(*rebuild);
    SendAnswers(answers);
    return target;
  }

  // This rank was removed and comes back (Agent::ReadmitToJob): every live peer says the highest
  // iteration it sent SFB factors of, and holds its layers from the next; this rank takes up the
  // job two past the lowest (the header comment says why).
  absl::StatusOr<uint64_t> ComeBack(absl::Time deadline) override {
    const uint32_t me = env_.config->rank;
    const uint32_t world = env_.config->world_size;
    if (inbox_.empty() || world < 2) return uint64_t{0};
    {
      std::lock_guard<std::mutex> lock(mu_);
      answers_.emplace();
    }
    for (uint32_t p = 0; p < world; ++p) {
      if (p == me) continue;
      std::shared_ptr<transport::Connection> link = env_.peers.Get(p);
      if (link == nullptr) {
        return absl::FailedPreconditionError(
            absl::StrCat("no connection to the peer agent of rank ", p));
      }
      link->Send(ReturnHeader(0, 0), {}, [p](absl::Status s) {
        if (!s.ok()) PSD_LOG_WARN("asking rank {} to count this rank again: {}", p, s.message());
      });
    }
    std::unique_lock<std::mutex> lock(mu_);
    const bool all = answered_.wait_until(lock, absl::ToChronoTime(deadline),
                                          [&] { return answers_->size() + 1 == world; });
    const std::map<uint32_t, uint64_t> answers = *std::move(answers_);
    answers_.reset();
    if (!all) {
      std::vector<uint32_t> silent;
      for (uint32_t p = 0; p < world; ++p) {
        if (p != me && !answers.contains(p)) silent.push_back(p);
      }
      return absl::DeadlineExceededError(absl::StrCat(
          "rank ", me, " comes back to job ", env_.config->job_id, ", and the peer agents of "
          "ranks [", absl::StrJoin(silent, ", "), "] did not say where their SFB layers are by ",
          absl::FormatTime(deadline), " (an agent answers once it removed this rank and agreed "
          "with the others up to which iteration its factors count)"));
    }
    uint64_t low = std::numeric_limits<uint64_t>::max(), high = 0;
    for (const auto& [p, sent] : answers) {
      low = std::min(low, sent);
      high = std::max(high, sent);
    }
    if (high > low + 1) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rank ", me, " cannot come back to job ", env_.config->job_id, ": the peer agents sent "
          "SFB factors up to iterations ", low, " to ", high, ", more than one apart (no "
          "iteration is past every one's and reachable by all)"));
    }
    PSD_LOG_INFO("the peer agents sent SFB factors up to iterations {} to {}: this rank's count "
                 "again from iteration {}",
                 low, high, low + 2);
    return low + 2;
  }

  // A RETURN frame (transport I/O thread): a removed rank asks to come back (sequence 0), or a
  // peer answers ours (sequence 1, ComeBack).
  absl::StatusOr<transport::PayloadTarget> OnReturnFrame(
      const std::shared_ptr<transport::PeerSession>& peer, const FrameHeader& h) {
    const uint32_t from = peer->identity().rank;
    // An ask carries nothing but itself; an answer its clock. Neither names a layer.
    if (h.payload_length != 0 || (h.flags & transport::kFlagRelayed) != 0 || h.sequence > 1 ||
        h.key != 0 || (h.sequence == 0 && h.clock != 0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rank ", from, " sent a malformed RETURN frame (sequence ", h.sequence, ", layer ",
          h.key, ", clock ", h.clock, ", flags ", h.flags, ", ", h.payload_length,
          " bytes of payload)"));
    }
    std::vector<Answer> answers;
    bool removal = false;  // the rank asks before this agent heard it was removed
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (h.sequence == 1) {
        if (!answers_) {
          return absl::FailedPreconditionError(
              absl::StrCat("rank ", from, " answers a return this agent did not ask for"));
        }
        if (!answers_->emplace(from, h.clock).second) {
          return absl::InvalidArgumentError(
              absl::StrCat("rank ", from, " answered this agent's return twice"));
        }
        answered_.notify_all();
        return transport::PayloadTarget::Discard();
      }
      if (!keep_own_) {
        return absl::FailedPreconditionError(absl::StrCat(
            "rank ", from, " asks to come back, and this job takes no rank back (no "
            "--rejoin_timeout)"));
      }
      removal = !removed_.contains(from);
    }
    if (removal) {
      // Only a rank the KV servers removed asks (Agent::ReadmitToJob). The coordinator may
      // never call its agent dead here (replaced on the same GPU within its lease): its factors
      // stop counting now, and the answer follows the agreed cut.
      PSD_LOG_WARN("rank {} asks to come back: the KV servers removed it, so this agent does too",
                   from);
      PeerRemoved(from);
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      // A second ask (an earlier replacement died meanwhile) is answered again, on its link.
      returning_[from].link = peer->shared_connection();
      answers = AnswersLocked();
    }
    SendAnswers(answers);
    return transport::PayloadTarget::Discard();
  }

  // Where factors of rank `from` (the sender, or a removed rank whose factors it passes on) go.
  absl::StatusOr<transport::PayloadTarget> InboundLocked(Inbox& box, const FrameHeader& h,
                                                         uint32_t from, bool relayed) {
    if (h.payload_length != box.floats * sizeof(float)) {
      return absl::InvalidArgumentError(absl::StrCat("factors of layer ", h.key, " carry ",
                                                     h.payload_length, " bytes, expected ",
                                                     box.floats * sizeof(float)));
    }
    if (h.clock == 0) return absl::InvalidArgumentError("iterations start at 1");
    // A rank removed before this iteration (alive after all): its factors no longer count.
    if (ExcludedLocked(box, from, h.clock)) return transport::PayloadTarget::Discard();
    // Relayed factors: needed only where we have not had them (nor later ones), and never past
    // the agreed cut (no agent holds those).
    if (relayed) {
      const uint64_t held = box.tag[h.clock % 2][from];
      auto cut = box.cuts.find(from);
      if (h.clock <= env_.clock_base || (held != 0 && (h.clock <= held || box.finished < held)) ||
          (cut != box.cuts.end() && cut->second.agreed && h.clock > *cut->second.agreed)) {
        return transport::PayloadTarget::Discard();
      }
    }
    // Taking up the running job at clock_base + 1: the others' factors of an earlier iteration
    // (sent again to this rank, PeerBack) are not needed.
    if (h.clock <= env_.clock_base) return transport::PayloadTarget::Discard();
    const int slot = static_cast<int>(h.clock % 2);
    const uint64_t held = box.tag[slot][from];
    // A restarted rank sends again the factors of the iteration it took up (its predecessor's
    // may have arrived): one we hold, or held before, is a retransmission.
    if (keep_own_ && held != 0 && h.clock <= held) return transport::PayloadTarget::Discard();
    // The slot may be reused once what it holds is consumed (a plan change can leave iterations
    // on PS in between, so the held clock need not be h.clock - 2).
    if (held != 0 && (h.clock <= held || box.finished < held)) {
      return absl::FailedPreconditionError(
          absl::StrCat("factors of layer ", h.key, " clock ", h.clock, " from rank ", from,
                       " arrive while the slot holds clock ", held));
    }
    box.tag[slot][from] = 0;  // being overwritten
    return transport::PayloadTarget::Into(
        std::as_writable_bytes(std::span(box.data[slot].data() + from * box.floats, box.floats)));
  }

  void OnFrame(const std::shared_ptr<transport::PeerSession>& peer, const FrameHeader& h,
               transport::MutableBuffer payload) override {
    if (payload.empty()) return;  // discarded by OnHeader: not needed, or had already
    const uint32_t sender = peer->identity().rank;
    const uint32_t from = (h.flags & transport::kFlagRelayed) != 0
                              ? static_cast<uint32_t>(h.sequence)
                              : sender;
    const auto layer = static_cast<uint32_t>(h.key);
    DeviceStager* stager = env_.stager->load(std::memory_order_acquire);
    bool on_device = false;
    const float* factors = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const Inbox& box = inbox_.at(layer);
      // A peer is at most one iteration ahead: its factors for box.sent + 1 belong to an
      // iteration we have not posted yet, whose location we do not know (staged by the rebuild).
      on_device = box.on_device && box.sent == h.clock;
      factors = box.data[h.clock % 2].data() + from * box.floats;
    }
    if (stager && on_device) {
      // The GPU rebuild needs every rank's factors on the device: copy these now, while the
      // other ranks' are still on the network (pinned inbox, asynchronous).
      if (absl::Status s = stager->StagePeerFactors(layer, Shape(layer), h.clock, from, factors);
          !s.ok()) {
        PSD_LOG_WARN("layer {}: staging rank {}'s factors: {} (the rebuild copies them)", layer,
                     from, s.message());
      }
    }
    std::optional<Rebuild> rebuild;
    {
      std::lock_guard<std::mutex> lock(mu_);
      inbox_.at(layer).tag[h.clock % 2][from] = h.clock;
      if (env_.metrics.sfb_received_bytes) {
        env_.metrics.sfb_received_bytes->Increment(static_cast<double>(h.payload_length));
      }
      if (env_.telemetry) env_.telemetry->AddPeerBytes(sender, 0, h.payload_length);
      rebuild = MaybeRebuildLocked(layer, h.clock);
    }
    if (rebuild) StartRebuild(*rebuild);
  }

  // Pins the inboxes for the GPU path (peers' factors are copied to the device from them).
  // Pageable memory still works, only slower: a failure is not fatal.
  void AttachDevice(DeviceStager& stager) override {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [layer, box] : inbox_) {
      for (auto& d : box.data) {
        if (absl::Status s = stager.PinHost(d.data(), d.size() * sizeof(float)); !s.ok()) {
          PSD_LOG_WARN("layer {}: SFB inbox stays pageable: {}", layer, s.message());
        }
      }
    }
  }

 private:
  struct Rebuild {
    uint32_t layer;
    uint64_t iteration;
    uint32_t priority;
    bool on_device;
    absl::Time queued_at;
  };

  // Our answer to a rank coming back: the highest iteration we sent factors of.
  struct Answer {
    std::shared_ptr<transport::Connection> link;
    uint32_t rank;
    uint64_t sent;
  };

  // With mu_ held: the answers due to ranks coming back, once this agent removed each and agreed
  // its cut on every layer; from then on our layers wait for it past what we sent.
  std::vector<Answer> AnswersLocked() {
    std::vector<Answer> out;
    for (auto& [rank, back] : returning_) {
      if (back.link == nullptr || !removed_.contains(rank)) continue;  // answered, or not yet
      bool agreed = true;
      uint64_t sent = 0;
      for (const auto& [layer, box] : inbox_) {
        auto cut = box.cuts.find(rank);
        agreed &= cut != box.cuts.end() && cut->second.agreed.has_value();
        sent = std::max(sent, box.sent);
      }
      if (!agreed) continue;
      back.hold_from = std::min(back.hold_from.value_or(sent + 1), sent + 1);
      out.push_back({std::move(back.link), rank, sent});  // the link left null: answered
    }
    return out;
  }

  void SendAnswers(const std::vector<Answer>& answers) {
    for (const Answer& a : answers) {
      PSD_LOG_WARN("rank {} comes back: this agent's SFB layers wait for it from iteration {} "
                   "until it says where it takes up the job",
                   a.rank, a.sent + 1);
      a.link->Send(ReturnHeader(1, a.sent), {}, [rank = a.rank](absl::Status s) {
        if (!s.ok()) PSD_LOG_WARN("answering rank {}'s return: {}", rank, s.message());
      });
    }
  }

  // A RETURN frame: ask (sequence 0) or answer (1, with the highest iteration sent).
  FrameHeader ReturnHeader(uint64_t sequence, uint64_t clock) const {
    FrameHeader h = FactorsHeader(0, clock, 0);
    h.flags |= transport::kFlagReturn;
    h.sequence = sequence;
    return h;
  }

  // A layer's cut of `rank`; one of an earlier removal the rank came back from starts afresh.
  static Cut& CutLocked(Inbox& box, uint32_t rank) {
    Cut& cut = box.cuts[rank];
    if (cut.back_from) cut = Cut{};
    return cut;
  }

  DeviceStager::SfbShape Shape(uint32_t layer) const {
    const LayerSpec& st = env_.table->layers[layer];
    DeviceStager::SfbShape shape;
    shape.m = st.m;
    shape.n = st.n;
    shape.k = st.k;
    shape.world = env_.config->world_size;
    shape.me = env_.config->rank;
    shape.grad_offset = st.layout.grad_offset;
    shape.u_offset = st.layout.u_offset;
    shape.v_offset = st.layout.v_offset;
    return shape;
  }

  std::vector<uint32_t> MissingLocked(uint32_t layer, uint64_t iteration) const {
    std::vector<uint32_t> missing;
    auto it = inbox_.find(layer);
    if (it == inbox_.end()) return missing;
    const int slot = static_cast<int>(iteration % 2);
    for (uint32_t p = 0; p < env_.config->world_size; ++p) {
      if (WaitsForLocked(it->second, slot, p, iteration)) missing.push_back(p);
    }
    return missing;
  }

  // Whether the layer's `iteration` still needs rank p's factors, or waits for p to say where it
  // comes back (held: we answered its return, it has not taken up the job yet).
  bool WaitsForLocked(const Inbox& box, int slot, uint32_t p, uint64_t iteration) const {
    if (p == env_.config->rank) return false;
    if (auto back = returning_.find(p); back != returning_.end() && back->second.hold_from &&
                                        iteration >= *back->second.hold_from) {
      return true;
    }
    return box.tag[slot][p] != iteration && !ExcludedLocked(box, p, iteration);
  }

  // Whether rank p's factors are left out of the layer's `iteration` (removed before it, and not
  // back by then).
  static bool ExcludedLocked(const Inbox& box, uint32_t p, uint64_t iteration) {
    auto it = box.cuts.find(p);
    if (it == box.cuts.end() || !it->second.agreed || iteration <= *it->second.agreed) return false;
    return !it->second.back_from || iteration < *it->second.back_from;
  }

  // The cut of `rank` on `layer`, once this agent removed it and every live peer told what it
  // holds (the highest iteration of all: the same on every agent).
  void TryAgreeLocked(uint32_t layer, Inbox& box, uint32_t rank) {
    Cut& cut = box.cuts[rank];
    if (cut.agreed || !cut.own) return;
    uint64_t top = *cut.own;
    for (uint32_t p = 0; p < env_.config->world_size; ++p) {
      if (p == env_.config->rank || removed_.contains(p)) continue;
      auto told = cut.told.find(p);
      if (told == cut.told.end()) return;
      top = std::max(top, told->second);
    }
    cut.agreed = top;
    PSD_LOG_WARN("layer {}: rank {}'s SFB factors count up to iteration {}, not after", layer,
                 rank, top);
  }

  // First half: broadcast our factors (straight from shared memory) to every other agent. The
  // rebuild goes once our sends are out and every peer's factors are in.
  void SendFactors(const Post& post, absl::Time queued, std::shared_ptr<Credit> credit) {
    const LayerSpec& st = env_.table->layers[post.layer];
    const uint32_t me = env_.config->rank;
    const uint32_t world = env_.config->world_size;
    if (env_.timeline) {
      env_.timeline->Span("queue", post.layer, st.desc.name, post.iteration, queued, absl::Now());
    }
    // Every peer must have registered (its PING) before it can take our factors: a wait of the
    // first iteration only (bounded; a stopping agent ends it).
    if (const std::vector<uint32_t> missing = env_.peer_gate->Wait(me, env_.config->sync_timeout);
        !missing.empty()) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        inbox_.at(post.layer).finished = post.iteration;
      }
      Finish(post.layer, post.iteration,
                    absl::DeadlineExceededError(
                        absl::StrCat("peer agents of ranks [", absl::StrJoin(missing, ", "),
                                     "] never registered their model")));
      return;
    }
    const float* u = env_.shm->FactorU(post.layer);
    const float* v = env_.shm->FactorV(post.layer);
    const uint64_t ku = st.k * st.m, kv = st.k * st.n;
    std::optional<Rebuild> rebuild;
    std::vector<uint32_t> removed;  // peers removed from the job: sent nothing (none, usually)
    {
      std::lock_guard<std::mutex> lock(mu_);
      removed.assign(removed_.begin(), removed_.end());
      Inbox& box = inbox_.at(post.layer);
      if (keep_own_) {  // for a restarted rank (PeerBack); small: the factors, not the gradient
        const int slot = static_cast<int>(post.iteration % 2);
        float* own = box.data[slot].data() + me * box.floats;
        std::copy_n(u, ku, own);
        std::copy_n(v, kv, own + ku);
        box.tag[slot][me] = post.iteration;
      }
      box.sent = post.iteration;
      box.sends_pending = static_cast<int>(world - 1 - removed.size());
      box.send_error = absl::OkStatus();
      box.started = absl::Now();
      box.on_device = post.on_device;
      box.priority = post.priority;
      box.credit = std::move(credit);
      rebuild = MaybeRebuildLocked(post.layer, post.iteration);  // world == 1: nothing to wait for
    }
    if (env_.metrics.sfb_sent_bytes) {
      env_.metrics.sfb_sent_bytes->Increment(
          static_cast<double>((ku + kv) * sizeof(float) * (world - 1 - removed.size())));
    }
    if (env_.timeline) env_.timeline->Instant("send factors", post.layer, post.iteration, absl::Now());
    for (uint32_t p = 0; p < world; ++p) {
      if (p == me || std::find(removed.begin(), removed.end(), p) != removed.end()) continue;
      const FrameHeader h = FactorsHeader(post.layer, post.iteration, (ku + kv) * sizeof(float));
      if (env_.telemetry) env_.telemetry->AddPeerBytes(p, h.payload_length, 0);
      auto sent = [this, layer = post.layer, it = post.iteration, p](absl::Status s) {
        std::optional<Rebuild> ready;
        {
          std::lock_guard<std::mutex> lock(mu_);
          Inbox& b = inbox_.at(layer);
          if (b.sent != it) return;
          --b.sends_pending;
          if (!s.ok() && b.send_error.ok() && !tolerate_failed_sends_) {
            b.send_error = Annotate(s, absl::StrCat("sending SFB factors to rank ", p));
          }
          if (b.sends_pending == 0 && b.credit) b.credit->Park();
          ready = MaybeRebuildLocked(layer, it);
        }
        if (ready) StartRebuild(*ready);
      };
      std::shared_ptr<transport::Connection> link = env_.peers.Get(p);
      if (link == nullptr) {  // every peer is connected at registration
        sent(absl::FailedPreconditionError("no connection"));
        continue;
      }
      link->Send(h, {std::as_bytes(std::span(u, ku)), std::as_bytes(std::span(v, kv))},
                 std::move(sent));
    }
    if (rebuild) StartRebuild(*rebuild);
  }

  // With mu_ held: the rebuilds of every layer's current iteration that can go now (a rank's
  // removal, a cut agreed, a hold released).
  std::vector<Rebuild> RebuildsDueLocked() {
    std::vector<Rebuild> ready;
    for (auto& [layer, box] : inbox_) {
      if (box.sent == 0) continue;
      if (auto r = MaybeRebuildLocked(layer, box.sent)) ready.push_back(*r);
    }
    return ready;
  }

  // With mu_ held: the rebuild once our sends are out and every peer's factors are in (at most
  // once per iteration). The credit is returned here: the layer's transfers are complete.
  std::optional<Rebuild> MaybeRebuildLocked(uint32_t layer, uint64_t iteration) {
    Inbox& box = inbox_.at(layer);
    if (box.sent != iteration || box.sends_pending > 0 || box.rebuild_queued == iteration ||
        box.finished == iteration) {
      return std::nullopt;
    }
    const int slot = static_cast<int>(iteration % 2);
    for (uint32_t p = 0; p < env_.config->world_size; ++p) {
      if (WaitsForLocked(box, slot, p, iteration)) return std::nullopt;
    }
    box.rebuild_queued = iteration;
    box.credit.reset();  // under mu_: Credit's release takes only the scheduler's (leaf) lock
    return Rebuild{layer, iteration, box.priority, box.on_device, absl::Now()};
  }

  void StartRebuild(const Rebuild& r) {
    const LayerSpec& st = env_.table->layers[r.layer];
    if (!r.on_device && st.k * st.m * st.n * env_.config->world_size <= kInlineRebuildMacs) {
      RunRebuild(r);
      return;
    }
    Scheduler::Task task;
    task.priority = r.priority;
    task.bytes = 0;  // computation, not network: never held back by the credit
    task.run = [this, r](std::shared_ptr<Credit>) { RunRebuild(r); };
    env_.scheduler->Submit(std::move(task));
  }

  // Second half: sum_p U_p^T V_p (M x N, row-major) into the gradient buffer, ranks in order.
  void RunRebuild(const Rebuild& r) {
    const LayerSpec& st = env_.table->layers[r.layer];
    Inbox& box = inbox_.at(r.layer);
    absl::Status status;
    const uint32_t me = env_.config->rank;
    const int slot = static_cast<int>(r.iteration % 2);
    std::vector<uint32_t> left_out;  // ranks removed before r.iteration (none, usually)
    float scale = 1.0f;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (box.finished == r.iteration) return;  // the watchdog failed it already
      status = box.send_error;
      for (const auto& [p, cut] : box.cuts) {
        if (!ExcludedLocked(box, p, r.iteration)) continue;
        left_out.push_back(p);
        // The GPU rebuild copies the factors not staged from the inbox: a removed rank's are 0.
        if (r.on_device) std::fill_n(box.data[slot].data() + p * box.floats, box.floats, 0.0f);
      }
      if (box.average) {
        scale = 1.0f / static_cast<float>(env_.config->world_size - left_out.size());
      }
    }
    const float* u = env_.shm->FactorU(r.layer);
    const float* v = env_.shm->FactorV(r.layer);
    float* grad = env_.shm->Grad(r.layer);
    const int m = static_cast<int>(st.m), n = static_cast<int>(st.n), k = static_cast<int>(st.k);
    const uint64_t ku = st.k * st.m;
    const absl::Time start = absl::Now();
    if (env_.timeline) {
      env_.timeline->Span("rebuild queue", r.layer, st.desc.name, r.iteration, r.queued_at, start);
    }
    if (r.on_device) {
      // On the GPU: one cuBLAS GEMM over every rank's factors, straight into the arena.
      DeviceStager::SfbShape shape = Shape(r.layer);
      shape.scale = scale;
      if (absl::Status s = env_.stager->load(std::memory_order_acquire)
                               ->Rebuild(r.layer, shape, r.iteration, box.data[slot].data());
          !s.ok() && status.ok()) {
        status = s;
      }
    } else {
      bool first = true;
      for (uint32_t p = 0; p < env_.config->world_size; ++p) {
        if (std::find(left_out.begin(), left_out.end(), p) != left_out.end()) continue;
        const float* up = p == me ? u : box.data[slot].data() + p * box.floats;
        const float* vp = p == me ? v : up + ku;
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, m, n, k, scale, up, m, vp, n,
                    first ? 0.0f : 1.0f, grad, n);
        first = false;
      }
    }
    if (env_.timeline) {
      env_.timeline->Span("rebuild", r.layer, st.desc.name, r.iteration, start, absl::Now());
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (box.finished == r.iteration) return;
      box.finished = r.iteration;
    }
    Finish(r.layer, r.iteration, status);
  }

  // Our factors of `layer` at the job's iteration `clock`.
  FrameHeader FactorsHeader(uint32_t layer, uint64_t clock, uint64_t bytes) const {
    FrameHeader h;
    h.type = FrameType::kFactors;
    h.job_id = env_.config->job_id;
    h.sender_rank = env_.config->rank;
    h.key = layer;
    h.clock = clock;
    h.payload_length = bytes;
    return h;
  }

  // Part 0 of the layer's iteration at the job's iteration `clock` is complete.
  void Finish(uint32_t layer, uint64_t clock, const absl::Status& status) {
    env_.finished(layer, clock - env_.clock_base, 0, status);
  }

  SyncEnv& env_;
  const bool keep_own_;  // keep our factors of the last two iterations (a restarted rank's)
  const bool tolerate_failed_sends_;
  mutable std::mutex mu_;
  std::set<uint32_t> removed_;  // ranks removed from the job (PeerRemoved), under mu_
  std::map<uint32_t, Returning> returning_;  // removed ranks that asked to come back, under mu_
  // While this agent comes back (ComeBack): the peers' answers, by rank, under mu_.
  std::optional<std::map<uint32_t, uint64_t>> answers_;
  std::condition_variable answered_;
  std::map<uint32_t, std::string> gone_;  // ranks gone (PeersGone), under mu_
  std::map<uint32_t, Inbox> inbox_;  // by SFB-capable layer; created in the constructor, then fixed
};

}  // namespace

void SetHostBlasThreads(int threads) { openblas_set_num_threads(std::max(threads, 1)); }

std::unique_ptr<Syncer> MakeSfbSyncer(SyncEnv& env) {
  return std::make_unique<SfbSyncer>(env);
}

}  // namespace poseidon::agent
