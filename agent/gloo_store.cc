#include "agent/gloo_store.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "gloo/common/error.h"

namespace poseidon::agent {

CoordinatorStore::CoordinatorStore(coordinator::CoordinatorClient* client, std::string prefix,
                                   absl::Duration timeout)
    : client_(client), prefix_(std::move(prefix)), timeout_(timeout) {}

std::vector<std::string> CoordinatorStore::Prefixed(const std::vector<std::string>& keys) const {
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (const std::string& key : keys) out.push_back(prefix_ + key);
  return out;
}

void CoordinatorStore::set(const std::string& key, const std::vector<char>& data) {
  const absl::Status s =
      client_->StoreSet(prefix_ + key, absl::string_view(data.data(), data.size()));
  if (!s.ok()) {
    throw gloo::IoException(absl::StrCat("rendezvous store: setting ", prefix_, key,
                                         " on the coordinator: ", s.message()));
  }
}

std::vector<char> CoordinatorStore::get(const std::string& key) {
  absl::StatusOr<std::vector<std::string>> values =
      client_->StoreGet(Prefixed({key}), timeout_);
  if (!values.ok() || values->size() != 1) {
    throw gloo::IoException(
        absl::StrCat("rendezvous store: getting ", prefix_, key, " from the coordinator: ",
                     values.ok() ? "wrong number of values" : values.status().message()));
  }
  const std::string& value = values->front();
  return std::vector<char>(value.begin(), value.end());
}

void CoordinatorStore::wait(const std::vector<std::string>& keys) {
  wait(keys, std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout_)));
}

void CoordinatorStore::wait(const std::vector<std::string>& keys,
                            const std::chrono::milliseconds& timeout) {
  if (keys.empty()) return;
  const absl::StatusOr<std::vector<std::string>> values =
      client_->StoreGet(Prefixed(keys), absl::FromChrono(timeout));
  if (!values.ok()) {
    throw gloo::IoException(absl::StrCat("rendezvous store: waiting for ", keys.size(),
                                         " keys under ", prefix_, " on the coordinator: ",
                                         values.status().message()));
  }
}

}  // namespace poseidon::agent
