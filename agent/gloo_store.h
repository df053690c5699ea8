// Gloo's rendezvous store (gloo::rendezvous::Store) over the coordinator's job-scoped key-value
// store (CoordinatorClient::StoreSet / StoreGet): the ring all-reduce's agents exchange their
// Gloo addresses through the authenticated control plane, not a file system or Redis.
// Thread-safety: as the CoordinatorClient's calls (any thread); Gloo calls it from the thread
// that connects the context.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "coordinator/client.h"
#include "gloo/rendezvous/store.h"

namespace poseidon::agent {

class CoordinatorStore final : public gloo::rendezvous::Store {
 public:
  // Keys are prefixed with `prefix`; get and wait without a timeout of their own wait at most
  // `timeout`. `client` is not owned and must outlive the store.
  CoordinatorStore(coordinator::CoordinatorClient* client, std::string prefix,
                   absl::Duration timeout);

  // Gloo's interface: errors are thrown as gloo::IoException (what Gloo's own stores do), with
  // the coordinator's message.
  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;

 private:
  std::vector<std::string> Prefixed(const std::vector<std::string>& keys) const;

  coordinator::CoordinatorClient* client_;
  const std::string prefix_;
  const absl::Duration timeout_;
};

}  // namespace poseidon::agent
