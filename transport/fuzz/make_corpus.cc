// Writes the seed corpus of the fuzz targets: valid headers of every type, a full valid
// handshake conversation, and a few near misses. Run once; the output is committed under
// transport/fuzz/corpus/. Usage: make_fuzz_corpus <corpus-dir>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "transport/frame.h"
#include "transport/credentials.h"
#include "transport/handshake.h"

namespace {

using namespace poseidon::transport;

void Write(const std::string& path, const std::vector<std::byte>& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
}

void AppendFrame(std::vector<std::byte>& out, const OutFrame& f) {
  const EncodedHeader h = EncodeHeader(f.header);
  out.insert(out.end(), h.begin(), h.end());
  out.insert(out.end(), f.payload.begin(), f.payload.end());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <corpus-dir>\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  int n = 0;
  for (uint8_t type : {1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 18, 19, 20, 32, 33, 48}) {
    for (uint64_t len : {uint64_t{0}, uint64_t{32}, uint64_t{4096}, uint64_t{1} << 31}) {
      FrameHeader h;
      h.type = static_cast<FrameType>(type);
      h.job_id = 1;
      h.payload_length = len;
      h.key = type * 7;
      std::vector<std::byte> bytes(8);
      const uint64_t limit = 1 << 20;
      std::memcpy(bytes.data(), &limit, 8);
      const EncodedHeader e = EncodeHeader(h);
      bytes.insert(bytes.end(), e.begin(), e.end());
      Write(dir + "/frame/seed-" + std::to_string(n++), bytes);
    }
  }
  // A full conversation as the handshake fuzzer reads it: alternating server-bound and
  // client-bound frames.
  SecretStore secrets;
  secrets.Set(1, "fuzz-secret");
  ClientHandshake client(1, 0, RankKey("fuzz-secret", 1, 0));
  ServerHandshake server(secrets);
  std::vector<std::byte> conversation;
  OutFrame hello = client.Start();
  AppendFrame(conversation, hello);
  auto challenge = server.OnFrame(hello.header, hello.payload);
  AppendFrame(conversation, *challenge);
  auto auth = client.OnFrame(challenge->header, challenge->payload);
  AppendFrame(conversation, **auth);
  Write(dir + "/handshake/conversation", conversation);
  std::vector<std::byte> hello_only;
  AppendFrame(hello_only, hello);
  Write(dir + "/handshake/hello", hello_only);
  return 0;
}
