// Error handling helpers over absl::Status / absl::StatusOr (Debian's Abseil 20220623 has no
// RETURN_IF_ERROR / ASSIGN_OR_RETURN of its own). Errors are values; nothing here throws.
// Thread-safety: stateless macros and free functions, safe from any thread.
#pragma once

#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

#define POSEIDON_STATUS_CONCAT_INNER_(a, b) a##b
#define POSEIDON_STATUS_CONCAT_(a, b) POSEIDON_STATUS_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` (an absl::Status) is not OK.
#define RETURN_IF_ERROR(expr)                                      \
  do {                                                             \
    ::absl::Status poseidon_status_ = (expr);                      \
    if (!poseidon_status_.ok()) return poseidon_status_;           \
  } while (false)

// ASSIGN_OR_RETURN(lhs, expr): evaluates `expr` (an absl::StatusOr<T>); on error returns its
// status from the enclosing function, otherwise moves the value into `lhs` (which may declare a
// variable: ASSIGN_OR_RETURN(auto x, F());).
#define ASSIGN_OR_RETURN(lhs, expr) \
  POSEIDON_ASSIGN_OR_RETURN_IMPL_(POSEIDON_STATUS_CONCAT_(poseidon_statusor_, __LINE__), lhs, expr)

#define POSEIDON_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                    \
  if (!tmp.ok()) return std::move(tmp).status();        \
  lhs = std::move(tmp).value()

namespace poseidon {

// Prefixes `status`'s message with `context` ("while X: original message"), keeping its code.
inline absl::Status Annotate(const absl::Status& status, std::string_view context) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(context, ": ", status.message()));
}

}  // namespace poseidon
