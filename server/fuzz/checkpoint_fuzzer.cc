// libFuzzer target: the KV server's checkpoint reader (server/checkpoint.h, ReadCheckpoint) on
// fuzz bytes as a file. The first byte says how the rest becomes the file: bit 0 appends the
// trailer (the CRC-32C of the bytes, then the end marker; a random CRC would stop every input at
// the checksum), bit 1 sets the header's length field to the file's size. A crash, a sanitizer
// report, or an accepted snapshot that breaks the format's rules (the CHECKs: every key at the
// snapshot's clock or behind it, a fallback clock at most one past the key's, at most two
// optimizer states) or does not survive the writer (WriteCheckpoint
// of it must read back equal, and write again to the same bytes) is a finding.
//
// POSEIDON_WRITE_SEEDS=<dir> ./checkpoint_fuzzer writes the seed corpus (committed in
// corpus/checkpoint) and exits.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <span>
#include <string>
#include <system_error>
#include <vector>

#include "server/checkpoint.h"
#include "transport/checksum.h"

namespace {

using namespace poseidon;  // NOLINT: a fuzzer's one translation unit

#define CHECK(cond)                                                     \
  do {                                                                  \
    if (!(cond)) {                                                      \
      std::fprintf(stderr, "checkpoint_fuzzer: CHECK failed: %s\n", #cond); \
      __builtin_trap();                                                 \
    }                                                                   \
  } while (0)

constexpr char kEndMagic[8] = {'P', 'S', 'D', 'E', 'N', 'D', '0', '1'};

std::string dir;        // on tmpfs: the writer fsyncs
std::string input_path;

void WriteFile(const std::string& path, const std::string& bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) std::abort();
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t w = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (w <= 0) std::abort();
    done += static_cast<size_t>(w);
  }
  ::close(fd);
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

bool SameFloats(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

bool Same(const server::JobSnapshot& a, const server::JobSnapshot& b) {
  if (a.job_id != b.job_id || a.clock != b.clock || a.keys.size() != b.keys.size() ||
      a.spec.SerializeAsString() != b.spec.SerializeAsString()) {
    return false;
  }
  for (size_t i = 0; i < a.keys.size(); ++i) {
    const server::KeySnapshot& x = a.keys[i];
    const server::KeySnapshot& y = b.keys[i];
    if (x.key != y.key || x.completed_clock != y.completed_clock ||
        x.initialized != y.initialized || x.optimizer_steps != y.optimizer_steps ||
        x.exact_from != y.exact_from ||
        !SameFloats(x.params, y.params) || !SameFloats(x.result, y.result) ||
        x.optimizer_state.size() != y.optimizer_state.size()) {
      return false;
    }
    for (size_t s = 0; s < x.optimizer_state.size(); ++s) {
      if (!SameFloats(x.optimizer_state[s], y.optimizer_state[s])) return false;
    }
  }
  return true;
}

// The file for one input: bytes 1.., with the trailer and length field fixed as byte 0 asks.
std::string FileOf(const uint8_t* data, size_t size) {
  std::string file(reinterpret_cast<const char*>(data) + 1, size - 1);
  const uint8_t flags = data[0];
  if (flags & 2 && file.size() >= 24) {
    const uint64_t total = file.size() + ((flags & 1) ? 12 : 0);
    std::memcpy(file.data() + 16, &total, 8);
  }
  if (flags & 1) {
    const uint32_t crc = transport::Crc32c(
        0, std::span(reinterpret_cast<const std::byte*>(file.data()), file.size()));
    file.append(reinterpret_cast<const char*>(&crc), 4);
    file.append(kEndMagic, 8);
  }
  return file;
}

void WriteSeeds(const std::string& out) {
  std::vector<server::JobSnapshot> snapshots(4);
  snapshots[0].job_id = 1;  // empty
  server::JobSnapshot& sum = snapshots[1];
  sum.job_id = 7;
  sum.clock = 3;
  sum.spec.set_num_workers(2);
  for (uint64_t k = 1; k <= 2; ++k) {
    server::KeySnapshot key;
    key.key = k;
    key.completed_clock = 3;
    key.result = {1.5f, -2.f, 0.f};
    sum.keys.push_back(key);
  }
  server::JobSnapshot& adam = snapshots[2];
  adam.job_id = 9;
  adam.clock = 10;
  server::KeySnapshot key;
  key.key = 42;
  key.completed_clock = 10;
  key.initialized = true;
  key.optimizer_steps = 10;
  key.params = {0.25f, 0.5f};
  key.optimizer_state = {{0.1f, 0.2f}, {0.01f, 0.02f}};
  adam.keys.push_back(key);
  snapshots[3] = adam;
  snapshots[3].job_id = 11;
  snapshots[3].keys[0].optimizer_state.resize(1);
  for (size_t i = 0; i < snapshots.size(); ++i) {
    if (!server::WriteCheckpoint(dir, snapshots[i]).ok()) std::abort();
    const std::string file = ReadFile(server::CheckpointPath(dir, snapshots[i].job_id));
    // Without the trailer (the fuzzer appends it), and the complete file as it is.
    WriteFile(out + "/seed-" + std::to_string(i), "\x03" + file.substr(0, file.size() - 12));
    WriteFile(out + "/file-" + std::to_string(i), "\x00" + file);
  }
}

// Removes what runs that crashed (no atexit) left: /dev/shm/<prefix><pid> of processes gone.
void RemoveStaleDirs(const std::string& prefix) {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    const long pid = std::atol(name.c_str() + prefix.size());
    if (pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
      std::filesystem::remove_all(entry.path(), ec);
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  RemoveStaleDirs("psd-ckptfuzz-");
  dir = "/dev/shm/psd-ckptfuzz-" + std::to_string(::getpid());
  if (::mkdir(dir.c_str(), 0700) != 0) std::abort();
  input_path = dir + "/input";
  std::atexit([] {
    std::error_code ignored;
    std::filesystem::remove_all(dir, ignored);
  });
  if (const char* out = std::getenv("POSEIDON_WRITE_SEEDS")) {
    WriteSeeds(out);
    std::exit(0);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  WriteFile(input_path, FileOf(data, size));
  const absl::StatusOr<server::JobSnapshot> read = server::ReadCheckpoint(input_path);
  if (!read.ok()) return 0;
  const server::JobSnapshot& s = *read;
  for (const server::KeySnapshot& k : s.keys) {
    CHECK(k.completed_clock <= s.clock);  // the clock is the snapshot's label
    CHECK(k.exact_from <= k.completed_clock + 1);
    CHECK(k.optimizer_state.size() <= 2);
  }
  // The writer's output of it reads back the same, and writes the same bytes again.
  if (!server::WriteCheckpoint(dir, s).ok()) std::abort();
  const std::string written_path = server::CheckpointPath(dir, s.job_id);
  const std::string written = ReadFile(written_path);
  const absl::StatusOr<server::JobSnapshot> again = server::ReadCheckpoint(written_path);
  CHECK(again.ok());
  CHECK(Same(s, *again));
  if (!server::WriteCheckpoint(dir, *again).ok()) std::abort();
  CHECK(ReadFile(written_path) == written);
  ::unlink(written_path.c_str());
  return 0;
}
