// A throwaway PKI for TLS tests, made with the openssl command line into a directory:
//   ca.pem/.key, other-ca.pem/.key      two unrelated CAs
//   server.pem/.key   signed by ca; subjectAltName IP:127.0.0.1, DNS:localhost
//   client.pem/.key   signed by ca; extendedKeyUsage clientAuth
//   elsewhere.pem/.key signed by ca; subjectAltName DNS:elsewhere.invalid only
//   stranger.pem/.key signed by other-ca; subjectAltName IP:127.0.0.1, DNS:localhost
// EC P-256 keys (quick to make), valid two days. Header-only: tests of any module include it.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <string>

namespace poseidon::testing {

// Makes the files in `dir` (which must exist). Returns false when openssl failed or is missing.
inline bool MakeTestPki(const std::string& dir) {
  const std::string script =
      "(set -e; cd '" + dir +
      "'; "
      "key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out $1; }; "
      "ca() { key $1.key; openssl req -x509 -new -key $1.key -out $1.pem -days 2 -subj /CN=$1; }; "
      "leaf() { key $1.key; openssl req -new -key $1.key -out $1.csr -subj /CN=$1; "
      "printf '%s\\n' \"$3\" > $1.ext; "
      "openssl x509 -req -in $1.csr -CA $2.pem -CAkey $2.key -CAcreateserial -out $1.pem "
      "-days 2 -extfile $1.ext; }; "
      "ca ca; ca other-ca; "
      "leaf server ca 'subjectAltName=IP:127.0.0.1,DNS:localhost'; "
      "leaf client ca 'extendedKeyUsage=clientAuth'; "
      "leaf elsewhere ca 'subjectAltName=DNS:elsewhere.invalid'; "
      "leaf stranger other-ca 'subjectAltName=IP:127.0.0.1,DNS:localhost'; "
      ") >/dev/null 2>&1";
  return std::system(script.c_str()) == 0;
}

inline void RemoveTestPkiDir(const std::string& dir) {
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
}

// A fresh directory under /tmp named after `prefix`, with the files made in it; "" when either
// failed.
inline std::string MakeTestPkiDir(const std::string& prefix) {
  std::string pattern = "/tmp/" + prefix + "-XXXXXX";
  if (mkdtemp(pattern.data()) == nullptr) return "";
  if (!MakeTestPki(pattern)) {
    RemoveTestPkiDir(pattern);
    return "";
  }
  return pattern;
}

}  // namespace poseidon::testing
