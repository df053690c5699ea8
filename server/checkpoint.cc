#include "server/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "transport/checksum.h"

namespace poseidon::server {
namespace {

constexpr char kMagic[8] = {'P', 'S', 'D', 'C', 'K', 'P', 'T', '1'};
constexpr char kEndMagic[8] = {'P', 'S', 'D', 'E', 'N', 'D', '0', '1'};
// 2: each key record ends with its exact_from (a lossy key's fallback); 1 is still read.
constexpr uint32_t kVersion = 2;
constexpr size_t kTrailerBytes = 4 + 8;

absl::Status Errno(absl::string_view what, const std::string& path) {
  return absl::InternalError(absl::StrCat(what, " ", path, ": ", std::strerror(errno)));
}

// Appends little-endian values to a byte vector, or streams them to a file with a running CRC.
class Writer {
 public:
  explicit Writer(int fd) : fd_(fd) {}
  void U32(uint32_t v) { Raw(&v, 4); }
  void U64(uint64_t v) { Raw(&v, 8); }
  void Floats(const std::vector<float>& v) {
    U64(v.size());
    Raw(v.data(), v.size() * sizeof(float));
  }
  void Raw(const void* p, size_t n) {
    if (n == 0) return;
    crc_ = transport::Crc32c(crc_, {static_cast<const std::byte*>(p), n});
    const char* c = static_cast<const char*>(p);
    while (n > 0 && ok_) {
      ssize_t w = ::write(fd_, c, n);
      if (w < 0) {
        if (errno == EINTR) continue;
        ok_ = false;
        break;
      }
      c += w;
      n -= static_cast<size_t>(w);
    }
  }
  uint32_t crc() const { return crc_; }
  bool ok() const { return ok_; }

 private:
  int fd_;
  uint32_t crc_ = 0;
  bool ok_ = true;
};

class Reader {
 public:
  Reader(const std::vector<std::byte>& data, size_t end) : data_(data), end_(end) {}
  bool U32(uint32_t* v) { return Raw(v, 4); }
  bool U64(uint64_t* v) { return Raw(v, 8); }
  bool Floats(std::vector<float>* v) {
    uint64_t n = 0;
    if (!U64(&n) || n > (end_ - pos_) / sizeof(float)) return false;
    v->resize(n);
    return Raw(v->data(), n * sizeof(float));
  }
  bool Raw(void* p, size_t n) {
    if (n > end_ - pos_) return false;
    if (n > 0) std::memcpy(p, data_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  size_t pos() const { return pos_; }
  size_t remaining() const { return end_ - pos_; }

 private:
  const std::vector<std::byte>& data_;
  size_t pos_ = 0;
  size_t end_;
};

uint64_t FloatsBytes(const std::vector<float>& v) {
  return 8 + v.size() * sizeof(float);
}

}  // namespace

std::string CheckpointPath(const std::string& dir, uint64_t job_id) {
  return absl::StrCat(dir, "/job-", job_id, ".ckpt");
}

absl::Status WriteCheckpoint(const std::string& dir, const JobSnapshot& snapshot) {
  const std::string spec = snapshot.spec.SerializeAsString();
  uint64_t total = sizeof(kMagic) + 4 + 4 + 8 + 8 + 8 + 4 + spec.size() + 8;
  for (const auto& k : snapshot.keys) {
    total += 8 + 8 + 8 + 8 + FloatsBytes(k.params) + FloatsBytes(k.result) + 4 + 8;
    for (const auto& st : k.optimizer_state) total += FloatsBytes(st);
  }
  total += kTrailerBytes;

  const std::string path = CheckpointPath(dir, snapshot.job_id);
  const std::string tmp = absl::StrCat(path, ".tmp.", ::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return Errno("cannot create", tmp);
  Writer w(fd);
  // The header up to the clock is read by `poseidon run` too (run.py _checkpoint_label, which
  // picks a resume's lost servers before starting them): change both together.
  w.Raw(kMagic, sizeof(kMagic));
  w.U32(kVersion);
  w.U32(0);
  w.U64(total);
  w.U64(snapshot.job_id);
  w.U64(snapshot.clock);
  w.U32(static_cast<uint32_t>(spec.size()));
  w.Raw(spec.data(), spec.size());
  w.U64(snapshot.keys.size());
  for (const auto& k : snapshot.keys) {
    w.U64(k.key);
    w.U64(k.completed_clock);
    w.U64(k.initialized ? 1 : 0);
    w.U64(k.optimizer_steps);
    w.Floats(k.params);
    w.Floats(k.result);
    w.U32(static_cast<uint32_t>(k.optimizer_state.size()));
    for (const auto& st : k.optimizer_state) w.Floats(st);
    w.U64(k.exact_from);
  }
  const uint32_t crc = w.crc();
  w.U32(crc);
  w.Raw(kEndMagic, sizeof(kEndMagic));
  bool ok = w.ok();
  if (ok && ::fsync(fd) != 0) ok = false;
  if (::close(fd) != 0) ok = false;
  if (!ok) {
    const absl::Status s = Errno("cannot write", tmp);
    ::unlink(tmp.c_str());
    return s;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const absl::Status s = Errno("cannot rename into", path);
    ::unlink(tmp.c_str());
    return s;
  }
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
  return absl::OkStatus();
}

absl::StatusOr<JobSnapshot> ReadCheckpoint(const std::string& path) {
  auto corrupt = [&](absl::string_view why) {
    return absl::DataLossError(absl::StrCat("checkpoint ", path, " is corrupt: ", why));
  };
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Errno("cannot open", path);
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    return Errno("cannot stat", path);
  }
  const auto size = static_cast<size_t>(st.st_size);
  constexpr size_t kMinimum = sizeof(kMagic) + 4 + 4 + 8 + 8 + 8 + 4 + 8 + kTrailerBytes;
  if (size < kMinimum) {
    ::close(fd);
    return corrupt(absl::StrCat("only ", size, " bytes (torn write?)"));
  }
  std::vector<std::byte> data(size);
  size_t got = 0;
  while (got < size) {
    ssize_t r = ::read(fd, data.data() + got, size - got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    got += static_cast<size_t>(r);
  }
  ::close(fd);
  if (got != size) return corrupt("short read");
  if (std::memcmp(data.data(), kMagic, sizeof(kMagic)) != 0) return corrupt("bad magic");
  if (std::memcmp(data.data() + size - sizeof(kEndMagic), kEndMagic, sizeof(kEndMagic)) != 0) {
    return corrupt("no end marker (torn write?)");
  }
  uint32_t stored_crc = 0;
  std::memcpy(&stored_crc, data.data() + size - kTrailerBytes, 4);
  const uint32_t crc = transport::Crc32c(0, std::span(data).first(size - kTrailerBytes));
  if (crc != stored_crc) return corrupt("checksum mismatch");

  Reader r(data, size - kTrailerBytes);
  char magic[8];
  uint32_t version = 0, reserved = 0, spec_len = 0;
  uint64_t total = 0;
  JobSnapshot s;
  if (!r.Raw(magic, 8) || !r.U32(&version) || !r.U32(&reserved) || !r.U64(&total) ||
      !r.U64(&s.job_id) || !r.U64(&s.clock) || !r.U32(&spec_len)) {
    return corrupt("truncated header");
  }
  if (version != kVersion && version != 1) {
    return corrupt(absl::StrCat("unsupported version ", version));
  }
  if (total != size) return corrupt(absl::StrCat("length field ", total, " != file size ", size));
  // Checked before the allocation: a length field of up to 4 GiB in a small file.
  if (spec_len > r.remaining()) return corrupt("bad spec");
  std::string spec(spec_len, '\0');
  if (!r.Raw(spec.data(), spec_len) || !s.spec.ParseFromString(spec)) return corrupt("bad spec");
  uint64_t keys = 0;
  if (!r.U64(&keys) || keys > size / 8) return corrupt("bad key count");
  s.keys.resize(keys);
  for (auto& k : s.keys) {
    uint64_t init = 0;
    uint32_t states = 0;
    if (!r.U64(&k.key) || !r.U64(&k.completed_clock) || !r.U64(&init) ||
        !r.U64(&k.optimizer_steps) || !r.Floats(&k.params) || !r.Floats(&k.result) ||
        !r.U32(&states) || states > 2) {
      return corrupt(absl::StrCat("bad key record ", k.key));
    }
    k.initialized = init != 0;
    k.optimizer_state.resize(states);
    for (auto& v : k.optimizer_state) {
      if (!r.Floats(&v)) return corrupt("bad optimizer state");
    }
    if (version >= 2 && (!r.U64(&k.exact_from) || k.exact_from > k.completed_clock + 1)) {
      return corrupt(absl::StrCat("bad fallback clock of key ", k.key));
    }
    // The snapshot's clock is its label (a clock boundary, or the iteration rank 0's agent
    // asked at): no key can be past it; keys of layers that ran fewer times are behind.
    if (k.completed_clock > s.clock) return corrupt(absl::StrCat("key ", k.key, " is past the snapshot's clock"));
  }
  if (r.pos() != size - kTrailerBytes) return corrupt("trailing bytes");
  return s;
}

absl::StatusOr<std::vector<JobSnapshot>> LoadCheckpoints(const std::string& dir) {
  std::vector<JobSnapshot> out;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) {
    if (errno == ENOENT) return out;
    return Errno("cannot open checkpoint directory", dir);
  }
  std::vector<std::string> names;
  while (dirent* e = ::readdir(d)) names.emplace_back(e->d_name);
  ::closedir(d);
  std::sort(names.begin(), names.end());
  for (const auto& name : names) {
    if (!absl::StartsWith(name, "job-")) continue;
    if (const size_t at = name.find(".tmp."); at != std::string::npos) {
      // <checkpoint>.tmp.<pid of the writer>: a save that was killed midway leaves it. Removed
      // once its writer is gone (a live writer, e.g. a second server on the directory, keeps it).
      int pid = 0;
      const bool parsed = absl::SimpleAtoi(name.substr(at + 5), &pid) && pid > 0;
      const bool writer_gone = parsed && ::kill(pid, 0) != 0 && errno == ESRCH;
      const std::string path = absl::StrCat(dir, "/", name);
      if (writer_gone && ::unlink(path.c_str()) == 0) {
        PSD_LOG_WARN("removed {}: an interrupted checkpoint write of process {}", path, pid);
      } else {
        PSD_LOG_WARN("ignoring {}: an interrupted checkpoint write", path);
      }
      continue;
    }
    if (!absl::EndsWith(name, ".ckpt")) continue;
    auto s = ReadCheckpoint(absl::StrCat(dir, "/", name));
    if (!s.ok()) return s.status();
    out.push_back(std::move(*s));
  }
  return out;
}

}  // namespace poseidon::server
