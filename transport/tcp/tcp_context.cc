#include "transport/tcp/tcp_context.h"

#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <atomic>
#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>
#include <charconv>
#include <cstring>
#include <deque>
#include <future>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/pem.h"
#include "common/status.h"
#include "transport/checksum.h"
#include "transport/error_frame.h"

namespace poseidon::transport {
namespace {

namespace asio = boost::asio;
using asio::ip::tcp;
using ErrorCode = boost::system::error_code;

using SteadyClock = std::chrono::steady_clock;
constexpr SteadyClock::time_point kNever = SteadyClock::time_point::max();

// Saturating conversion: a huge duration means "a year", never an overflow.
std::chrono::nanoseconds ToChrono(absl::Duration d) {
  if (d >= absl::Hours(24 * 365)) return std::chrono::hours(24 * 365);
  return absl::ToChronoNanoseconds(d);
}

// Parses "host:port" or "[v6]:port".
absl::Status SplitHostPort(absl::string_view address, std::string* host, std::string* port) {
  const size_t colon = address.rfind(':');
  if (colon == absl::string_view::npos || colon + 1 == address.size()) {
    return absl::InvalidArgumentError(absl::StrCat("address '", address, "' is not host:port"));
  }
  absl::string_view h = address.substr(0, colon);
  absl::string_view p = address.substr(colon + 1);
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  unsigned value = 0;
  auto [ptr, ec] = std::from_chars(p.data(), p.data() + p.size(), value);
  if (ec != std::errc() || ptr != p.data() + p.size() || value > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("address '", address, "' has a bad port '", p, "'"));
  }
  *host = h.empty() ? "0.0.0.0" : std::string(h);
  *port = std::string(p);
  return absl::OkStatus();
}

std::string EndpointString(const tcp::endpoint& ep) {
  const auto addr = ep.address();
  if (addr.is_v6()) return absl::StrCat("[", addr.to_string(), "]:", ep.port());
  return absl::StrCat(addr.to_string(), ":", ep.port());
}

class Closeable {
 public:
  virtual ~Closeable() = default;
  // Closes the object during IoService::Shutdown (posts even though closed() is already true).
  virtual void CloseForShutdown() = 0;
};

// The io_context and its threads, shared by the context and everything it created, so that a
// connection kept by a user after the context is closed still has a valid executor.
class IoService {
 public:
  explicit IoService(const TcpOptions& options)
      : options_(options), io_(options.io_threads), work_(asio::make_work_guard(io_)) {}

  void Start() {
    for (int i = 0; i < options_.io_threads; ++i) {
      threads_.emplace_back([this] { io_.run(); });
    }
  }

  asio::io_context& io() { return io_; }
  const TcpOptions& options() const { return options_; }
  // The OpenSSL context of every connection (null without TLS); set before Start.
  void SetTls(std::shared_ptr<asio::ssl::context> tls) { tls_ = std::move(tls); }
  asio::ssl::context* tls() const { return tls_.get(); }
  bool closed() const { return closed_.load(std::memory_order_acquire); }

  void Register(const std::shared_ptr<Closeable>& object) {
    std::lock_guard<std::mutex> lock(mu_);
    if (objects_.size() >= prune_at_) {
      std::erase_if(objects_, [](const auto& w) { return w.expired(); });
      prune_at_ = std::max<size_t>(64, objects_.size() * 2);
    }
    objects_.push_back(object);
  }

  void Shutdown() {
    if (closed_.exchange(true)) return;
    std::vector<std::weak_ptr<Closeable>> objects;
    {
      std::lock_guard<std::mutex> lock(mu_);
      objects.swap(objects_);
    }
    for (auto& weak : objects) {
      if (auto object = weak.lock()) object->CloseForShutdown();
    }
    work_.reset();
    const auto self = std::this_thread::get_id();
    for (auto& t : threads_) {
      if (t.get_id() == self) {
        t.detach();  // closed from a callback: this thread finishes when run() returns
      } else if (t.joinable()) {
        t.join();
      }
    }
  }

 private:
  TcpOptions options_;
  std::shared_ptr<asio::ssl::context> tls_;
  asio::io_context io_;
  asio::executor_work_guard<asio::io_context::executor_type> work_;
  std::vector<std::thread> threads_;
  std::atomic<bool> closed_{false};
  std::mutex mu_;
  std::vector<std::weak_ptr<Closeable>> objects_;
  size_t prune_at_ = 64;
};

void ConfigureSocket(tcp::socket& socket, const TcpOptions& options) {
  ErrorCode ignored;
  socket.set_option(tcp::no_delay(options.no_delay), ignored);
  socket.set_option(asio::socket_base::keep_alive(true), ignored);
  if (options.socket_buffer_bytes > 0) {
    socket.set_option(asio::socket_base::send_buffer_size(options.socket_buffer_bytes), ignored);
    socket.set_option(asio::socket_base::receive_buffer_size(options.socket_buffer_bytes), ignored);
  }
}

class TcpConnection final : public Connection,
                            public Closeable,
                            public std::enable_shared_from_this<TcpConnection> {
 public:
  // With TLS (the service has an OpenSSL context) the connection is a TLS client (it connected,
  // verifying `server_name` in the listener's certificate) or a TLS server (it was accepted).
  enum class Role { kClient, kServer };

  TcpConnection(std::shared_ptr<IoService> service, tcp::socket socket, Role role,
                std::string server_name = {})
      : service_(std::move(service)),
        strand_(asio::make_strand(service_->io())),
        socket_(std::move(socket)),
        timer_(strand_),
        role_(role),
        server_name_(std::move(server_name)) {
    ErrorCode ec;
    const auto remote = socket_.remote_endpoint(ec);
    peer_ = ec ? std::string("unknown-peer") : EndpointString(remote);
    if (service_->tls() != nullptr) {
      tls_ = std::make_unique<asio::ssl::stream<tcp::socket&>>(socket_, *service_->tls());
      tls_ready_ = false;
    }
  }

  // Starts the TLS handshake (nothing without TLS). Reads and writes asked for meanwhile wait for
  // it; a handshake that fails closes the connection with the reason, one that stalls is bounded
  // by the header timeout.
  void Start() {
    if (!tls_) return;
    asio::post(strand_, [self = shared_from_this()] { self->StartTlsHandshake(); });
  }

  // A small frame on an idle connection is written at once from the calling thread (one
  // non-blocking sendmsg): no hand-off to an I/O thread, whose wake-up is most of a small
  // request's latency on a loaded machine. Everything else, and whatever a partial write left,
  // goes through the strand. Order is kept: the direct path is taken only while no frame is
  // with the strand (strand_frames_), under fast_mu_, which a close takes before the socket goes.
  void Send(const FrameHeader& header_in, std::vector<ConstBuffer> payload,
            DoneCallback done) override {
    if (RejectIfShutDown(done)) return;
    FrameHeader header = header_in;
    absl::Status invalid = PrepareSend(header, payload, service_->options());
    const size_t total = TotalSize(payload);
    PendingSend op;
    op.header = EncodeHeader(header);
    op.payload = std::move(payload);
    op.done = std::move(done);
    op.bytes = kFrameHeaderSize + total;
    {
      std::unique_lock<std::mutex> lock(fast_mu_);
      if (!tls_ && invalid.ok() && strand_frames_ == 0 && !fast_closed_ &&
          op.bytes <= kDirectSendBytes && op.payload.size() < kDirectSendIov) {
        const size_t n = WriteNow(op);
        if (n == op.bytes) {
          lock.unlock();
          counters_.bytes_sent.fetch_add(n, std::memory_order_relaxed);
          counters_.frames_sent.fetch_add(1, std::memory_order_relaxed);
          op.done(absl::OkStatus());
          return;
        }
        if (n > 0) KeepUnwritten(op, n);  // the strand writes the rest, before anything else
      }
      ++strand_frames_;
      // Posted under the lock: the strand then takes frames in the order the lock was taken (a
      // partial write's rest before any frame sent after it; posting after unlocking let another
      // thread's frame overtake it and interleave its bytes).
      asio::post(strand_, [self = shared_from_this(), op = std::move(op),
                           invalid = std::move(invalid)]() mutable {
        if (!invalid.ok()) {
          self->FramesLeftStrand(1);
          op.done(std::move(invalid));
          return;
        }
        self->Enqueue(std::move(op));
      });
    }
  }

  void ReadHeader(HeaderCallback done, absl::Duration timeout) override {
    if (service_->closed()) {
      done(absl::UnavailableError("transport context is closed"));
      return;
    }
    asio::post(strand_, [self = shared_from_this(), done = std::move(done), timeout]() mutable {
      self->StartReadHeader(std::move(done), timeout);
    });
  }

  void ReadPayload(MutableBuffer into, DoneCallback done) override {
    if (RejectIfShutDown(done)) return;
    asio::post(strand_, [self = shared_from_this(), into, done = std::move(done)]() mutable {
      self->StartReadPayload(into, /*discard=*/false, std::move(done));
    });
  }

  void DiscardPayload(DoneCallback done) override {
    if (RejectIfShutDown(done)) return;
    asio::post(strand_, [self = shared_from_this(), done = std::move(done)]() mutable {
      self->StartReadPayload({}, /*discard=*/true, std::move(done));
    });
  }

  void Close() override {
    if (service_->closed()) return;  // the shutdown closed it already
    CloseForShutdown();
  }

  void CloseForShutdown() override {
    asio::post(strand_, [self = shared_from_this()] {
      self->DoClose(absl::CancelledError("connection closed locally"));
    });
  }

  void Abort(const absl::Status& reason) override {
    if (service_->closed()) return;
    asio::post(strand_, [self = shared_from_this(), reason] {
      self->FailConnection(reason, /*notify_peer=*/true);
    });
  }

  std::string PeerAddress() const override { return peer_; }

  ConnectionStats Stats() const override { return counters_.Snapshot(); }

 private:
  struct PendingSend {
    EncodedHeader header;
    std::vector<ConstBuffer> payload;
    std::string owned;  // payload owned by the connection (error frames, a partial write's rest)
    bool header_sent = false;  // a direct write sent the header: only `owned` is left
    DoneCallback done;
    size_t bytes = 0;
  };

  static constexpr size_t kDirectSendBytes = 64 * 1024;
  static constexpr size_t kDirectSendIov = 15;

  // With fast_mu_ held and nothing with the strand: one non-blocking gather write of the whole
  // frame. Returns the bytes written (0 when none could be).
  size_t WriteNow(const PendingSend& op) {
    iovec iov[kDirectSendIov + 1];
    int count = 0;
    iov[count++] = {const_cast<uint8_t*>(reinterpret_cast<const uint8_t*>(op.header.data())),
                    op.header.size()};
    for (const auto& b : op.payload) {
      if (!b.empty()) iov[count++] = {const_cast<std::byte*>(b.data()), b.size()};
    }
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(count);
    ssize_t n;
    do {
      n = ::sendmsg(socket_.native_handle(), &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
    } while (n < 0 && errno == EINTR);
    return n > 0 ? static_cast<size_t>(n) : 0;  // an error: the strand's write reports it
  }

  // A direct write sent the first `sent` bytes: keep a copy of the rest for the strand.
  static void KeepUnwritten(PendingSend& op, size_t sent) {
    std::string rest;
    rest.reserve(op.bytes - sent);
    const auto* h = reinterpret_cast<const char*>(op.header.data());
    if (sent < op.header.size()) rest.append(h + sent, op.header.size() - sent);
    size_t skip = sent > op.header.size() ? sent - op.header.size() : 0;
    for (const auto& b : op.payload) {
      const size_t from = std::min(skip, b.size());
      skip -= from;
      rest.append(reinterpret_cast<const char*>(b.data()) + from, b.size() - from);
    }
    rest.append(op.owned);
    op.payload.clear();
    op.owned = std::move(rest);
    op.header_sent = true;
    op.bytes = op.owned.size();
  }

  void FramesLeftStrand(size_t n) {
    std::lock_guard<std::mutex> lock(fast_mu_);
    strand_frames_ -= n;
  }

  enum class ReadState { kIdle, kHeader, kAwaitPayload, kPayload };

  // ---- writing (strand only) ----
  void Enqueue(PendingSend op) {
    if (closed_) {
      FramesLeftStrand(1);
      op.done(absl::UnavailableError(
          absl::StrCat("connection to ", peer_, " is closed: ", close_reason_.message())));
      return;
    }
    send_queue_.push_back(std::move(op));
    if (!writing_ && tls_ready_) StartWrite();
  }

  void StartWrite() {
    constexpr size_t kMaxIov = 64;
    constexpr size_t kMaxBatchBytes = size_t{1} << 20;
    write_buffers_.clear();
    batch_frames_ = 0;
    size_t batch_bytes = 0;
    for (auto& op : send_queue_) {
      const size_t iov = 1 + op.payload.size() + (op.owned.empty() ? 0 : 1);
      if (batch_frames_ > 0 &&
          (write_buffers_.size() + iov > kMaxIov || batch_bytes + op.bytes > kMaxBatchBytes)) {
        break;
      }
      if (!op.header_sent) write_buffers_.emplace_back(op.header.data(), op.header.size());
      for (const auto& b : op.payload) {
        if (!b.empty()) write_buffers_.emplace_back(b.data(), b.size());
      }
      if (!op.owned.empty()) write_buffers_.emplace_back(op.owned.data(), op.owned.size());
      batch_bytes += op.bytes;
      ++batch_frames_;
    }
    writing_ = true;
    auto on_write = asio::bind_executor(
        strand_,
        [self = shared_from_this()](const ErrorCode& ec, size_t n) { self->OnWrite(ec, n); });
    if (!tls_) {
      asio::async_write(socket_, write_buffers_, std::move(on_write));
      return;
    }
    // TLS encrypts one buffer per record: a batch of small frames is copied into one buffer
    // first, so that it goes as one record instead of one per header and payload.
    if (batch_bytes <= kTlsCoalesceBytes && write_buffers_.size() > 1) {
      tls_staging_.resize(batch_bytes);
      asio::buffer_copy(asio::buffer(tls_staging_), write_buffers_);
      write_buffers_.assign(1, asio::const_buffer(tls_staging_.data(), tls_staging_.size()));
    }
    asio::async_write(*tls_, write_buffers_, std::move(on_write));
  }

  // ---- TLS (strand only) ----
  void StartTlsHandshake() {
    if (closed_) return;
    handshake_deadline_ = SteadyClock::now() + ToChrono(service_->options().header_timeout);
    UpdateWatchdog();
    SSL* ssl = tls_->native_handle();
    if (role_ == Role::kClient) {
      ErrorCode ec;
      asio::ip::make_address(server_name_, ec);
      // SNI for a name (never for an address, RFC 6066); the name or address is verified.
      if (ec) SSL_set_tlsext_host_name(ssl, server_name_.c_str());
      tls_->set_verify_mode(asio::ssl::verify_peer);
      tls_->set_verify_callback(asio::ssl::host_name_verification(server_name_));
    } else if (service_->options().tls.verify_clients) {
      tls_->set_verify_mode(asio::ssl::verify_peer | asio::ssl::verify_fail_if_no_peer_cert);
    } else {
      tls_->set_verify_mode(asio::ssl::verify_none);
    }
    if (role_ == Role::kServer) {
      // A plaintext Poseidon peer (no data_tls settings) is told why in a frame it can read,
      // instead of a TLS alert it cannot: look at its first bytes before OpenSSL does.
      socket_.async_wait(
          tcp::socket::wait_read,
          asio::bind_executor(strand_, [self = shared_from_this()](const ErrorCode& ec) {
            self->OnFirstBytes(ec);
          }));
      return;
    }
    Handshake();
  }

  void OnFirstBytes(const ErrorCode& ec) {
    if (ec) {
      OnTlsHandshake(ec);
      return;
    }
    uint8_t first[4] = {};
    ssize_t n;
    do {
      n = ::recv(socket_.native_handle(), first, sizeof(first), MSG_PEEK | MSG_DONTWAIT);
    } while (n < 0 && errno == EINTR);
    uint8_t magic[4];  // the header's first field, little-endian
    for (int i = 0; i < 4; ++i) magic[i] = static_cast<uint8_t>(kFrameMagic >> (8 * i));
    if (n == static_cast<ssize_t>(sizeof(first)) && std::memcmp(first, magic, sizeof(magic)) == 0) {
      tls_.reset();  // speak the peer's plaintext for this one error frame
      tls_ready_ = true;
      handshake_deadline_ = kNever;
      FailConnection(absl::FailedPreconditionError(absl::StrCat(
                         "plaintext frame from ", peer_,
                         " on a TLS listener: this end serves TLS on the data plane (data_tls); "
                         "every daemon of a job needs the same data_tls settings")),
                     /*notify_peer=*/true);
      CompletePendingHeader(close_reason_);
      return;
    }
    Handshake();
  }

  // A header read asked for before the handshake completed, which no socket read serves yet.
  void CompletePendingHeader(const absl::Status& status) {
    if (read_state_ != ReadState::kHeader || !header_done_) return;
    read_state_ = ReadState::kIdle;
    auto done = std::move(header_done_);
    done(status);
  }

  void Handshake() {
    tls_->async_handshake(
        role_ == Role::kClient ? asio::ssl::stream_base::client : asio::ssl::stream_base::server,
        asio::bind_executor(strand_, [self = shared_from_this()](const ErrorCode& ec) {
          self->OnTlsHandshake(ec);
        }));
  }

  void OnTlsHandshake(const ErrorCode& ec) {
    handshake_deadline_ = kNever;
    if (closed_) {
      CompletePendingHeader(ClosedError());
      return;
    }
    if (ec) {
      absl::Status status;
      if (timer_fired_) {
        status = absl::DeadlineExceededError(timeout_reason_);
      } else {
        std::string reason = ec.message();
        if (ec.category() == asio::error::get_ssl_category()) {
          const long verify = SSL_get_verify_result(tls_->native_handle());
          if (verify != X509_V_OK) {
            absl::StrAppend(&reason, " (", X509_verify_cert_error_string(verify), ")");
          }
          if (ERR_GET_REASON(ec.value()) == SSL_R_WRONG_VERSION_NUMBER ||
              ERR_GET_REASON(ec.value()) == SSL_R_PACKET_LENGTH_TOO_LONG) {
            absl::StrAppend(&reason,
                            "; is the peer serving TLS? every daemon of a job needs the "
                            "same data_tls settings");
          }
        }
        status = absl::UnavailableError(absl::StrCat("TLS handshake ",
                                                     role_ == Role::kClient ? "with " : "from ",
                                                     peer_, " failed: ", reason));
      }
      PSD_LOG_WARN("closing connection {} {}: {}", role_ == Role::kClient ? "to" : "from", peer_,
                   status.message());
      DoClose(status);
      CompletePendingHeader(status);
      return;
    }
    tls_ready_ = true;
    UpdateWatchdog();
    if (read_state_ == ReadState::kHeader) ReadSomeHeader();
    if (!writing_ && !send_queue_.empty()) StartWrite();
  }

  void OnWrite(const ErrorCode& ec, size_t n) {
    writing_ = false;
    if (ec) {
      if (!closed_) {
        const absl::Status status =
            absl::UnavailableError(absl::StrCat("write to ", peer_, " failed: ", ec.message()));
        PSD_LOG_WARN("closing connection to {}: {}", peer_, status.message());
        DoClose(status);
      }
      FailQueuedSends();
      return;
    }
    counters_.bytes_sent.fetch_add(n, std::memory_order_relaxed);
    counters_.frames_sent.fetch_add(batch_frames_, std::memory_order_relaxed);
    FramesLeftStrand(batch_frames_);
    for (size_t i = 0; i < batch_frames_; ++i) {
      auto op = std::move(send_queue_.front());
      send_queue_.pop_front();
      op.done(absl::OkStatus());
    }
    if (closed_) {
      FailQueuedSends();
    } else if (!send_queue_.empty()) {
      StartWrite();
    } else if (close_after_flush_) {
      DoClose(close_reason_);
    }
  }

  // ---- reading (strand only) ----
  void StartReadHeader(HeaderCallback done, absl::Duration timeout) {
    if (closed_) {
      done(ClosedError());
      return;
    }
    if (close_after_flush_) {  // failed (an error frame on its way out): nothing more is read
      done(close_reason_);
      return;
    }
    if (read_state_ != ReadState::kIdle) {
      done(absl::FailedPreconditionError(
          read_state_ == ReadState::kAwaitPayload
              ? "ReadHeader called before the previous frame's payload was read or discarded"
              : "ReadHeader called while another read is outstanding"));
      return;
    }
    read_state_ = ReadState::kHeader;
    header_done_ = std::move(done);
    header_got_ = 0;
    if (timeout != absl::InfiniteDuration()) {
      user_timeout_ = timeout;
      user_deadline_ = SteadyClock::now() + ToChrono(timeout);
      UpdateWatchdog();
    }
    if (tls_ready_) ReadSomeHeader();
  }

  template <typename Buffer, typename Handler>
  void AsyncReadSome(const Buffer& buffer, Handler&& handler) {
    if (tls_) {
      tls_->async_read_some(buffer, std::forward<Handler>(handler));
    } else {
      socket_.async_read_some(buffer, std::forward<Handler>(handler));
    }
  }

  void ReadSomeHeader() {
    AsyncReadSome(
        asio::buffer(header_buf_.data() + header_got_, kFrameHeaderSize - header_got_),
        asio::bind_executor(strand_, [self = shared_from_this()](const ErrorCode& ec, size_t n) {
          self->OnHeaderBytes(ec, n);
        }));
  }

  void OnHeaderBytes(const ErrorCode& ec, size_t n) {
    if (ec) {
      ReadFailed(ec);
      return;
    }
    counters_.bytes_received.fetch_add(n, std::memory_order_relaxed);
    const bool first_bytes = header_got_ == 0;
    header_got_ += n;
    if (header_got_ < kFrameHeaderSize) {
      if (first_bytes) {
        header_deadline_ = SteadyClock::now() + ToChrono(service_->options().header_timeout);
        UpdateWatchdog();
      }
      ReadSomeHeader();
      return;
    }
    header_deadline_ = kNever;
    user_deadline_ = kNever;
    auto header = DecodeHeader(header_buf_, service_->options().limits);
    auto done = std::move(header_done_);
    if (!header.ok()) {
      read_state_ = ReadState::kIdle;
      // A TLS record (handshake, version 3.x) where a frame should be: a peer with data_tls.
      const bool tls_record =
          !tls_ && header_buf_[0] == std::byte{0x16} && header_buf_[1] == std::byte{0x03};
      const absl::Status status(
          header.status().code(),
          absl::StrCat("bad frame from ", peer_, ": ", header.status().message(),
                       tls_record ? " (the peer speaks TLS: this end has no data_tls settings; "
                                    "every daemon of a job needs the same)"
                                  : ""));
      FailConnection(status, /*notify_peer=*/true);
      done(status);
      return;
    }
    counters_.frames_received.fetch_add(1, std::memory_order_relaxed);
    if (header->payload_length > 0) {
      read_state_ = ReadState::kAwaitPayload;
      pending_header_ = *header;
    } else {
      read_state_ = ReadState::kIdle;
    }
    done(std::move(header));
  }

  void StartReadPayload(MutableBuffer into, bool discard, DoneCallback done) {
    if (closed_) {
      done(ClosedError());
      return;
    }
    if (read_state_ != ReadState::kAwaitPayload) {
      done(absl::FailedPreconditionError("no frame payload is waiting to be read"));
      return;
    }
    if (!discard && into.size() != pending_header_.payload_length) {
      done(absl::InvalidArgumentError(absl::StrCat("payload buffer holds ", into.size(),
                                                   " bytes but the frame carries ",
                                                   pending_header_.payload_length)));
      return;
    }
    read_state_ = ReadState::kPayload;
    payload_done_ = std::move(done);
    payload_into_ = into;
    payload_discard_ = discard;
    payload_got_ = 0;
    payload_crc_ = 0;
    if (discard && scratch_.empty()) scratch_.resize(64 * 1024);
    last_progress_ = SteadyClock::now();
    UpdateWatchdog();
    // For a large payload, wake up only once a good slice has arrived (SO_RCVLOWAT): far fewer
    // wake-ups and larger copies per read, as a blocking reader gets from the kernel.
    if (!tls_ && pending_header_.payload_length >= 2 * kReceiveLowWatermark) {
      SetReceiveLowWatermark(kReceiveLowWatermark);
    }
    ReadSomePayload();
  }

  void SetReceiveLowWatermark(int bytes) {
    ErrorCode ignored;
    socket_.set_option(asio::socket_base::receive_low_watermark(bytes), ignored);
    rcv_lowat_ = static_cast<uint64_t>(bytes);
  }

  void ReadSomePayload() {
    const uint64_t remaining = pending_header_.payload_length - payload_got_;
    asio::mutable_buffer target =
        payload_discard_
            ? asio::buffer(scratch_.data(), std::min<uint64_t>(remaining, scratch_.size()))
            : asio::buffer(payload_into_.data() + payload_got_, remaining);
    AsyncReadSome(target, asio::bind_executor(
                              strand_, [self = shared_from_this()](const ErrorCode& ec, size_t n) {
                                self->OnPayloadBytes(ec, n);
                              }));
  }

  void OnPayloadBytes(const ErrorCode& ec, size_t n) {
    if (ec) {
      ReadFailed(ec);
      return;
    }
    counters_.bytes_received.fetch_add(n, std::memory_order_relaxed);
    const bool verify = (pending_header_.flags & kFlagPayloadChecksum) != 0;
    if (verify) {
      const std::byte* base =
          payload_discard_ ? scratch_.data() : payload_into_.data() + payload_got_;
      payload_crc_ = Crc32c(payload_crc_, std::span<const std::byte>(base, n));
    }
    payload_got_ += n;
    if (payload_got_ < pending_header_.payload_length) {
      last_progress_ = SteadyClock::now();
      const uint64_t remaining = pending_header_.payload_length - payload_got_;
      if (remaining < rcv_lowat_) SetReceiveLowWatermark(static_cast<int>(remaining));
      ReadSomePayload();
      return;
    }
    if (rcv_lowat_ != 1) SetReceiveLowWatermark(1);
    read_state_ = ReadState::kIdle;
    auto done = std::move(payload_done_);
    if (verify && payload_crc_ != pending_header_.payload_checksum) {
      const absl::Status status = absl::DataLossError(absl::StrCat(
          "payload checksum mismatch in ", DescribeHeader(pending_header_), " from ", peer_));
      FailConnection(status, /*notify_peer=*/true);
      done(status);
      return;
    }
    done(absl::OkStatus());
  }

  void ReadFailed(const ErrorCode& ec) {
    absl::Status status;
    if (timer_fired_) {
      status = absl::DeadlineExceededError(timeout_reason_);
    } else if (closed_) {
      status = ClosedError();
    } else if (ec == asio::error::eof || ec == asio::ssl::error::stream_truncated) {
      if (read_state_ == ReadState::kHeader && header_got_ > 0) {
        status = absl::UnavailableError(
            absl::StrCat("connection closed by peer ", peer_, " in the middle of a frame header (",
                         header_got_, " of ", kFrameHeaderSize, " bytes)"));
      } else if (read_state_ == ReadState::kPayload) {
        status = absl::UnavailableError(
            absl::StrCat("connection closed by peer ", peer_, " in the middle of a frame payload (",
                         payload_got_, " of ", pending_header_.payload_length, " bytes)"));
      } else {
        status = absl::UnavailableError(absl::StrCat("connection closed by peer ", peer_));
      }
    } else {
      status = absl::UnavailableError(absl::StrCat("read from ", peer_, " failed: ", ec.message()));
    }
    const ReadState state = read_state_;
    read_state_ = ReadState::kIdle;
    const bool mid_frame =
        (state == ReadState::kHeader && header_got_ > 0) || state == ReadState::kPayload;
    if (timer_fired_ || (mid_frame && !closed_)) {
      PSD_LOG_WARN("closing connection from {}: {}", peer_, status.message());
    }
    DoClose(status);
    if (state == ReadState::kHeader && header_done_) {
      auto done = std::move(header_done_);
      done(status);
    } else if (state == ReadState::kPayload && payload_done_) {
      auto done = std::move(payload_done_);
      done(status);
    }
  }

  // ---- watchdog (strand only) ----
  // One timer serves every deadline of the connection: a header wait with a caller's timeout,
  // a partial header that must complete, a payload that must keep progressing, an error frame
  // that must flush. It is armed for the earliest active deadline and re-armed only when that
  // moves earlier, so steady-state traffic costs no timer operations at all.
  SteadyClock::time_point NextDeadline() const {
    SteadyClock::time_point next = handshake_deadline_;
    if (read_state_ == ReadState::kHeader)
      next = std::min({next, user_deadline_, header_deadline_});
    if (read_state_ == ReadState::kPayload) {
      next = std::min(next, last_progress_ + ToChrono(service_->options().payload_idle_timeout));
    }
    if (close_after_flush_) next = std::min(next, flush_deadline_);
    return next;
  }

  void UpdateWatchdog() {
    const SteadyClock::time_point next = NextDeadline();
    if (next == kNever || (watchdog_armed_ && watchdog_at_ <= next)) return;
    watchdog_armed_ = true;
    watchdog_at_ = next;
    const uint64_t generation = ++watchdog_generation_;
    timer_.expires_at(next);
    // A weak reference: a pending deadline must not keep an abandoned connection alive.
    timer_.async_wait([weak = weak_from_this(), generation](const ErrorCode& ec) {
      auto self = weak.lock();
      if (ec || !self || generation != self->watchdog_generation_) return;
      self->watchdog_armed_ = false;
      self->OnWatchdog();
    });
  }

  void OnWatchdog() {
    if (closed_) return;
    const auto now = SteadyClock::now();
    std::string reason;
    if (close_after_flush_ && now >= flush_deadline_) {
      DoClose(close_reason_);
      return;
    }
    if (now >= handshake_deadline_) {
      reason = absl::StrCat("TLS handshake ", role_ == Role::kClient ? "with " : "from ", peer_,
                            " did not complete within ",
                            absl::FormatDuration(service_->options().header_timeout));
    } else if (read_state_ == ReadState::kHeader && now >= user_deadline_) {
      reason =
          absl::StrCat("no frame from ", peer_, " within ", absl::FormatDuration(user_timeout_));
    } else if (read_state_ == ReadState::kHeader && now >= header_deadline_) {
      reason = absl::StrCat("partial frame header from ", peer_, " stalled for ",
                            absl::FormatDuration(service_->options().header_timeout), " (",
                            header_got_, " of ", kFrameHeaderSize, " bytes)");
    } else if (read_state_ == ReadState::kPayload &&
               now >= last_progress_ + ToChrono(service_->options().payload_idle_timeout)) {
      reason = absl::StrCat("frame payload from ", peer_, " made no progress for ",
                            absl::FormatDuration(service_->options().payload_idle_timeout), " (",
                            payload_got_, " of ", pending_header_.payload_length, " bytes)");
    }
    if (reason.empty()) {
      UpdateWatchdog();  // a deadline moved later (progress was made): wait for it
      return;
    }
    timer_fired_ = true;
    timeout_reason_ = std::move(reason);
    ErrorCode ignored;
    socket_.cancel(ignored);  // the outstanding read fails and reports timeout_reason_
  }

  // ---- closing (strand only) ----
  absl::Status ClosedError() const {
    return absl::UnavailableError(
        absl::StrCat("connection to ", peer_, " is closed: ", close_reason_.message()));
  }

  // A protocol violation or I/O failure: log it, tell the peer why (best effort), close.
  void FailConnection(const absl::Status& status, bool notify_peer) {
    if (closed_ || close_after_flush_) return;
    PSD_LOG_WARN("closing connection from {}: {}", peer_, status.message());
    if (!notify_peer) {
      DoClose(status);
      return;
    }
    ErrorFrame frame = MakeErrorFrame(0, status);
    PendingSend op;
    op.header = EncodeHeader(frame.header);
    op.owned = std::move(frame.message);
    op.bytes = kFrameHeaderSize + op.owned.size();
    op.done = [](absl::Status) {};
    close_reason_ = status;
    close_after_flush_ = true;
    {
      std::lock_guard<std::mutex> lock(fast_mu_);
      fast_closed_ = true;  // nothing may follow the error frame but the strand's queue
      ++strand_frames_;
    }
    send_queue_.push_back(std::move(op));
    if (!writing_ && tls_ready_) StartWrite();
    // A peer that does not read must not keep the connection open.
    flush_deadline_ = SteadyClock::now() + std::chrono::seconds(1);
    UpdateWatchdog();
  }

  void DoClose(const absl::Status& reason) {
    if (closed_) return;
    closed_ = true;
    close_reason_ = reason;
    {
      // A direct write in progress finishes before the descriptor goes; none starts after.
      std::lock_guard<std::mutex> lock(fast_mu_);
      fast_closed_ = true;
    }
    ErrorCode ignored;
    socket_.shutdown(tcp::socket::shutdown_both, ignored);
    socket_.close(ignored);
    ++watchdog_generation_;
    timer_.cancel();
    // With a write in flight, OnWrite sees the error and fails the queue.
    if (!writing_) FailQueuedSends();
  }

  void FailQueuedSends() {
    while (!send_queue_.empty()) {
      auto op = std::move(send_queue_.front());
      send_queue_.pop_front();
      FramesLeftStrand(1);
      op.done(ClosedError());
    }
  }

  // After the context shut down no I/O thread runs: complete at once instead of posting.
  bool RejectIfShutDown(absl::AnyInvocable<void(absl::Status)>& done) {
    if (!service_->closed()) return false;
    done(absl::UnavailableError("transport context is closed"));
    return true;
  }

  std::shared_ptr<IoService> service_;
  asio::strand<asio::io_context::executor_type> strand_;
  tcp::socket socket_;
  asio::steady_timer timer_;
  std::string peer_;
  const Role role_;
  const std::string server_name_;
  // With TLS (strand only): the stream over socket_ (declared after it: destroyed first), whether
  // its handshake completed, and the buffer small frames are coalesced into.
  std::unique_ptr<asio::ssl::stream<tcp::socket&>> tls_;
  bool tls_ready_ = true;
  SteadyClock::time_point handshake_deadline_ = kNever;
  std::vector<uint8_t> tls_staging_;
  static constexpr size_t kTlsCoalesceBytes = 64 * 1024;

  // Strand-owned state.
  std::deque<PendingSend> send_queue_;
  std::vector<asio::const_buffer> write_buffers_;
  size_t batch_frames_ = 0;
  bool writing_ = false;
  bool closed_ = false;
  bool close_after_flush_ = false;
  absl::Status close_reason_;

  ReadState read_state_ = ReadState::kIdle;
  EncodedHeader header_buf_{};
  size_t header_got_ = 0;
  HeaderCallback header_done_;
  FrameHeader pending_header_;
  DoneCallback payload_done_;
  MutableBuffer payload_into_;
  bool payload_discard_ = false;
  uint64_t payload_got_ = 0;
  uint64_t rcv_lowat_ = 1;
  static constexpr int kReceiveLowWatermark = 256 * 1024;
  uint32_t payload_crc_ = 0;
  std::vector<std::byte> scratch_;

  bool watchdog_armed_ = false;
  SteadyClock::time_point watchdog_at_ = kNever;
  uint64_t watchdog_generation_ = 0;
  SteadyClock::time_point user_deadline_ = kNever;
  absl::Duration user_timeout_;
  SteadyClock::time_point header_deadline_ = kNever;
  SteadyClock::time_point last_progress_{};
  SteadyClock::time_point flush_deadline_ = kNever;
  bool timer_fired_ = false;
  std::string timeout_reason_;

  ConnectionCounters counters_;

  // The direct-write path (any thread).
  std::mutex fast_mu_;
  size_t strand_frames_ = 0;  // frames handed to the strand, not yet written or failed
  bool fast_closed_ = false;  // closing or closed: everything goes through the strand
};

class TcpListener final : public Listener,
                          public Closeable,
                          public std::enable_shared_from_this<TcpListener> {
 public:
  TcpListener(std::shared_ptr<IoService> service, tcp::acceptor acceptor)
      : service_(std::move(service)),
        strand_(asio::make_strand(service_->io())),
        acceptor_(std::move(acceptor)) {
    ErrorCode ec;
    address_ = EndpointString(acceptor_.local_endpoint(ec));
  }

  std::string Address() const override { return address_; }

  void Accept(AcceptCallback done) override {
    if (service_->closed()) {
      done(absl::CancelledError("transport context is closed"));
      return;
    }
    asio::post(strand_, [self = shared_from_this(), done = std::move(done)]() mutable {
      if (self->closed_) {
        done(absl::CancelledError("listener closed"));
        return;
      }
      self->AcceptOnStrand(std::move(done));
    });
  }

  // On the strand. Running out of descriptors (or kernel memory) is transient: the listener backs
  // off (10 ms doubling to 1 s) and tries again, logging once per 10 s with the count, instead of
  // reporting each failure (the accept loop above it would retry at once: a spinning core and
  // hundreds of thousands of log lines a second).
  void AcceptOnStrand(AcceptCallback done) {
    if (closed_) {
      done(absl::CancelledError("listener closed"));
      return;
    }
    // The peer's socket (on a strand of its own) exists before the accept and outlives a failed
    // one: Boost.Asio's accept-with-executor overload, which makes it inside the operation,
    // crashes destroying it after a failed accept (UBSan: invalid vptr of its strand, then
    // SIGSEGV; found by ops_emfile_backoff: out of descriptors, the server died).
    auto peer = std::make_shared<tcp::socket>(asio::make_strand(service_->io()));
    acceptor_.async_accept(
        *peer, asio::bind_executor(strand_, [self = shared_from_this(), peer,
                                             done = std::move(done)](const ErrorCode& ec) mutable {
          tcp::socket& socket = *peer;
          if (ec && !self->closed_ && ec != asio::error::operation_aborted &&
              IsTransientAcceptError(ec)) {
            self->BackOff(ec, std::move(done));
            return;
          }
          if (ec) {
            done(self->closed_ || ec == asio::error::operation_aborted
                     ? absl::CancelledError("listener closed")
                     : absl::UnavailableError(
                           absl::StrCat("accept on ", self->address_, " failed: ", ec.message())));
            return;
          }
          if (self->failures_ > 0) {
            PSD_LOG_INFO("accept on {} works again after {} failures", self->address_,
                         self->failures_);
            self->failures_ = 0;
            self->delay_ = absl::ZeroDuration();
          }
          ConfigureSocket(socket, self->service_->options());
          auto conn = std::make_shared<TcpConnection>(self->service_, std::move(socket),
                                                      TcpConnection::Role::kServer);
          self->service_->Register(conn);
          conn->Start();
          done(std::shared_ptr<Connection>(conn));
        }));
  }

  static bool IsTransientAcceptError(const ErrorCode& ec) {
    const int e = ec.value();
    return ec.category() == asio::error::get_system_category() &&
           (e == EMFILE || e == ENFILE || e == ENOBUFS || e == ENOMEM);
  }

  void BackOff(const ErrorCode& ec, AcceptCallback done) {
    ++failures_;
    delay_ = delay_ == absl::ZeroDuration() ? absl::Milliseconds(10)
                                            : std::min(delay_ * 2, absl::Seconds(1));
    const absl::Time now = absl::Now();
    if (now - last_log_ >= absl::Seconds(10)) {
      last_log_ = now;
      PSD_LOG_WARN("accept on {} failed: {} ({} failures so far); retrying every {}", address_,
                   ec.message(), failures_, absl::FormatDuration(delay_));
    }
    backoff_timer_.expires_after(absl::ToChronoNanoseconds(delay_));
    backoff_timer_.async_wait(asio::bind_executor(
        strand_, [self = shared_from_this(), done = std::move(done)](const ErrorCode&) mutable {
          self->AcceptOnStrand(std::move(done));
        }));
  }

  void Close() override {
    if (service_->closed()) return;
    CloseForShutdown();
  }

  void CloseForShutdown() override {
    asio::post(strand_, [self = shared_from_this()] {
      self->closed_ = true;
      ErrorCode ignored;
      self->acceptor_.close(ignored);
      self->backoff_timer_.cancel();
    });
  }

 private:
  std::shared_ptr<IoService> service_;
  asio::strand<asio::io_context::executor_type> strand_;
  tcp::acceptor acceptor_;
  asio::steady_timer backoff_timer_{strand_};
  uint64_t failures_ = 0;                        // transient accept failures in a row (strand)
  absl::Duration delay_ = absl::ZeroDuration();  // the back-off now (strand)
  absl::Time last_log_ = absl::InfinitePast();   // (strand)
  std::string address_;
  bool closed_ = false;
};

class TcpContext final : public Context {
 public:
  explicit TcpContext(std::shared_ptr<IoService> service) : service_(std::move(service)) {}
  ~TcpContext() override { TcpContext::Close(); }

  absl::string_view Name() const override { return "tcp"; }
  bool IsViable() const override { return true; }
  const ContextOptions& Options() const override { return service_->options(); }

  absl::StatusOr<std::shared_ptr<Listener>> Listen(absl::string_view address) override {
    if (service_->closed()) return absl::FailedPreconditionError("transport context is closed");
    if (service_->tls() != nullptr && service_->options().tls.cert_file.empty()) {
      return absl::FailedPreconditionError(
          "a TLS listener needs a certificate: set data_tls_cert and data_tls_key");
    }
    std::string host, port;
    if (auto s = SplitHostPort(address, &host, &port); !s.ok()) return s;
    ErrorCode ec;
    tcp::resolver resolver(service_->io());
    auto results = resolver.resolve(host, port, tcp::resolver::passive, ec);
    if (ec || results.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot resolve listen address '", address, "': ", ec.message()));
    }
    const tcp::endpoint endpoint = results.begin()->endpoint();
    tcp::acceptor acceptor(service_->io());
    acceptor.open(endpoint.protocol(), ec);
    if (!ec) acceptor.set_option(asio::socket_base::reuse_address(true), ec);
    if (!ec) acceptor.bind(endpoint, ec);
    if (!ec) acceptor.listen(1024, ec);
    if (ec) {
      return absl::UnavailableError(
          absl::StrCat("cannot listen on '", address, "': ", ec.message()));
    }
    auto listener = std::make_shared<TcpListener>(service_, std::move(acceptor));
    service_->Register(listener);
    return std::shared_ptr<Listener>(listener);
  }

  absl::StatusOr<std::shared_ptr<Connection>> Connect(absl::string_view address,
                                                      absl::Duration timeout) override {
    if (service_->closed()) return absl::FailedPreconditionError("transport context is closed");
    std::string host, port;
    if (auto s = SplitHostPort(address, &host, &port); !s.ok()) return s;
    ErrorCode ec;
    tcp::resolver resolver(service_->io());
    auto endpoints = resolver.resolve(host, port, ec);
    if (ec || endpoints.empty()) {
      return absl::UnavailableError(absl::StrCat("cannot resolve '", address, "': ", ec.message()));
    }
    struct State {
      explicit State(asio::io_context& io)
          : strand(asio::make_strand(io)), socket(strand), timer(strand) {}
      asio::strand<asio::io_context::executor_type> strand;
      tcp::socket socket;
      asio::steady_timer timer;
      bool finished = false;
      std::promise<absl::Status> result;
    };
    auto state = std::make_shared<State>(service_->io());
    auto future = state->result.get_future();
    const std::string addr(address);
    asio::post(state->strand, [state, endpoints, timeout, addr] {
      asio::async_connect(
          state->socket, endpoints, [state, addr](const ErrorCode& e, const tcp::endpoint&) {
            if (state->finished) return;
            state->finished = true;
            state->timer.cancel();
            state->result.set_value(e ? absl::UnavailableError(absl::StrCat(
                                            "connect to ", addr, " failed: ", e.message()))
                                      : absl::OkStatus());
          });
      state->timer.expires_after(ToChrono(timeout));
      state->timer.async_wait([state, addr, timeout](const ErrorCode& e) {
        if (e || state->finished) return;
        state->finished = true;
        ErrorCode ignored;
        state->socket.close(ignored);
        state->result.set_value(absl::DeadlineExceededError(absl::StrCat(
            "connect to ", addr, " did not complete within ", absl::FormatDuration(timeout))));
      });
    });
    // The timer above bounds the connect; the margin covers I/O threads that stopped.
    if (future.wait_for(ToChrono(timeout + absl::Seconds(5))) != std::future_status::ready) {
      return absl::DeadlineExceededError(absl::StrCat("connect to ", addr, " timed out"));
    }
    absl::Status status = future.get();
    if (!status.ok()) return status;
    ConfigureSocket(state->socket, service_->options());
    // Move the socket onto a fresh strand owned by the connection.
    const TlsOptions& tls = service_->options().tls;
    auto conn = std::make_shared<TcpConnection>(service_, std::move(state->socket),
                                                TcpConnection::Role::kClient,
                                                tls.server_name.empty() ? host : tls.server_name);
    service_->Register(conn);
    conn->Start();
    return std::shared_ptr<Connection>(conn);
  }

  void Close() override { service_->Shutdown(); }

 private:
  std::shared_ptr<IoService> service_;
};

// OpenSSL computes a certificate's X.509v3 extension data (key identifiers, flags) on its first
// use and caches it in the X509 object: under the certificate's write lock, but read afterwards
// through a lock-free atomic fast path. The objects of an SSL_CTX (this end's certificate and
// chain, the CA store) are shared by every connection, so two first handshakes on two I/O threads
// race to fill that cache (OpenSSL issues 25202 and 32609; ThreadSanitizer cannot see libcrypto's
// atomics, so it reports the reader against the writer: CI's mutual-TLS conformance run). Filling
// it here, before any connection exists, leaves the handshakes only reading it.
void CacheCertificateExtensions(SSL_CTX* ctx) {
  auto cache = [](X509* cert) {
    if (cert != nullptr) X509_check_purpose(cert, -1, 0);  // purpose -1: cache, check nothing
  };
  cache(SSL_CTX_get0_certificate(ctx));
  STACK_OF(X509)* chain = nullptr;
  if (SSL_CTX_get0_chain_certs(ctx, &chain) == 1 && chain != nullptr) {
    for (int i = 0; i < sk_X509_num(chain); ++i) cache(sk_X509_value(chain, i));
  }
  STACK_OF(X509_OBJECT)* objects = X509_STORE_get0_objects(SSL_CTX_get_cert_store(ctx));
  for (int i = 0; objects != nullptr && i < sk_X509_OBJECT_num(objects); ++i) {
    cache(X509_OBJECT_get0_X509(sk_X509_OBJECT_value(objects, i)));
  }
}

// The OpenSSL context of a TLS transport: TLS 1.2 or later, this end's certificate and key
// (checked to match), the CA peers are verified against.
absl::StatusOr<std::shared_ptr<asio::ssl::context>> MakeTlsContext(const TlsOptions& tls) {
  if (tls.cert_file.empty() != tls.key_file.empty()) {
    return absl::InvalidArgumentError(
        "data_tls_cert and data_tls_key go together: set both or neither");
  }
  if (tls.verify_clients && tls.ca_file.empty()) {
    return absl::InvalidArgumentError(
        "data_tls_verify_clients needs data_tls_ca: the CA client certificates are checked "
        "against");
  }
  auto ctx = std::make_shared<asio::ssl::context>(asio::ssl::context::tls);
  ctx->set_options(asio::ssl::context::default_workarounds | asio::ssl::context::no_sslv2 |
                   asio::ssl::context::no_sslv3 | asio::ssl::context::no_tlsv1 |
                   asio::ssl::context::no_tlsv1_1 | asio::ssl::context::single_dh_use);
  SSL_CTX_set_min_proto_version(ctx->native_handle(), TLS1_2_VERSION);
  // AEAD suites only, AES-128-GCM first: tensors are bulk data, and AES-128-GCM encrypts ~1.6x
  // faster than AES-256-GCM (`openssl speed`, 16 KiB blocks: 3.2 against 2.0 GB/s here) at a
  // strength well beyond what a job's lifetime needs. Both ends are Poseidon's: the listener's
  // order decides.
  SSL_CTX_set_ciphersuites(ctx->native_handle(),
                           "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384:"
                           "TLS_CHACHA20_POLY1305_SHA256");
  SSL_CTX_set_cipher_list(ctx->native_handle(),
                          "ECDHE-ECDSA-AES128-GCM-SHA256:ECDHE-RSA-AES128-GCM-SHA256:"
                          "ECDHE-ECDSA-AES256-GCM-SHA384:ECDHE-RSA-AES256-GCM-SHA384:"
                          "ECDHE-ECDSA-CHACHA20-POLY1305:ECDHE-RSA-CHACHA20-POLY1305");
  SSL_CTX_set_options(ctx->native_handle(), SSL_OP_CIPHER_SERVER_PREFERENCE);
  // The files are read (and checked to be PEM) by the same helper as the coordinator's TLS
  // files, then handed to OpenSSL from memory: its own file errors say only "asio.ssl error".
  ErrorCode ec;
  auto failed = [&ec](absl::string_view what, const std::string& file) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " ", file, " cannot be used: ", ec.message()));
  };
  auto read = [](const std::string& file, absl::string_view what) -> absl::StatusOr<std::string> {
    auto pem = ReadPemFile(file, what);
    if (!pem.ok()) return absl::InvalidArgumentError(pem.status().message());  // a bad setting
    return pem;
  };
  if (!tls.cert_file.empty()) {
    ASSIGN_OR_RETURN(const std::string cert, read(tls.cert_file, "data_tls_cert"));
    ASSIGN_OR_RETURN(const std::string key, read(tls.key_file, "data_tls_key"));
    ctx->use_certificate_chain(asio::buffer(cert), ec);
    if (ec) return failed("data_tls_cert", tls.cert_file);
    // Checked against the certificate just loaded: a key of another one is refused here.
    ctx->use_private_key(asio::buffer(key), asio::ssl::context::pem, ec);
    if (ec) return failed("data_tls_key", tls.key_file);
  }
  if (!tls.ca_file.empty()) {
    ASSIGN_OR_RETURN(const std::string ca, read(tls.ca_file, "data_tls_ca"));
    ctx->add_certificate_authority(asio::buffer(ca), ec);
    if (ec) return failed("data_tls_ca", tls.ca_file);
  } else {
    ctx->set_default_verify_paths(ec);
    if (ec) {
      return absl::InvalidArgumentError(
          absl::StrCat("the system's CA certificates cannot be loaded: ", ec.message()));
    }
  }
  CacheCertificateExtensions(ctx->native_handle());
  return ctx;
}

}  // namespace

absl::StatusOr<std::shared_ptr<Context>> CreateTcpContext(const TcpOptions& options) {
  if (options.io_threads < 1 || options.io_threads > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("io_threads must be in [1, 64], got ", options.io_threads));
  }
  if (options.socket_buffer_bytes < 0) {
    return absl::InvalidArgumentError("socket_buffer_bytes must not be negative");
  }
  if (options.header_timeout <= absl::ZeroDuration() ||
      options.payload_idle_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("header_timeout and payload_idle_timeout must be positive");
  }
  auto service = std::make_shared<IoService>(options);
  if (options.tls.enabled) {
    auto tls = MakeTlsContext(options.tls);
    if (!tls.ok()) return tls.status();
    service->SetTls(*std::move(tls));
  }
  service->Start();
  return std::shared_ptr<Context>(std::make_shared<TcpContext>(std::move(service)));
}

}  // namespace poseidon::transport
