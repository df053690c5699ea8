// Error handling helpers over absl::Status / absl::StatusOr (Debian's Abseil 20220623 has no
// RETURN_IF_ERROR / ASSIGN_OR_RETURN of its own). Errors are values; nothing here throws.
// Note: this Abseil's absl::string_view is its own type, not std::string_view; APIs take it.
// Thread-safety: stateless macros and free functions, safe from any thread.
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

#define POSEIDON_STATUS_CONCAT_INNER_(a, b) a##b
#define POSEIDON_STATUS_CONCAT_(a, b) POSEIDON_STATUS_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` (an absl::Status) is not OK.
#define RETURN_IF_ERROR(expr) \
  POSEIDON_RETURN_IF_ERROR_IMPL_(POSEIDON_STATUS_CONCAT_(poseidon_status_, __COUNTER__), expr)

#define POSEIDON_RETURN_IF_ERROR_IMPL_(tmp, expr) \
  do {                                            \
    ::absl::Status tmp = (expr);                  \
    if (!tmp.ok()) return tmp;                    \
  } while (false)

// ASSIGN_OR_RETURN(lhs, expr): evaluates `expr` (an absl::StatusOr<T>); on error returns its
// status from the enclosing function, otherwise moves the value into `lhs` (which may declare a
// variable: ASSIGN_OR_RETURN(auto x, F());). It expands to several statements: do not use it as
// the body of an unbraced if/else. A `lhs` type with a top-level comma needs a type alias.
#define ASSIGN_OR_RETURN(lhs, expr)                                                              \
  POSEIDON_ASSIGN_OR_RETURN_IMPL_(POSEIDON_STATUS_CONCAT_(poseidon_statusor_, __COUNTER__), lhs, \
                                  expr)

#define POSEIDON_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                    \
  if (!tmp.ok()) return std::move(tmp).status();        \
  lhs = std::move(tmp).value()

namespace poseidon {

// Prefixes `status`'s message with `context` ("while X: original message"), keeping its code.
inline absl::Status Annotate(const absl::Status& status, absl::string_view context) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(context, ": ", status.message()));
}

}  // namespace poseidon
