// A small streaming JSON writer for the CLI's --json output: objects, arrays, strings, numbers,
// booleans and null, with commas and escaping handled; keys keep the order they are written in.
// Thread-safety: none; one writer per output, used by one thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace poseidon::tools {

// Usage: w.BeginObject(); w.Key("n"); w.Number(3); w.EndObject(); w.str() == "{\"n\": 3}".
// Misuse (a value where a key is due, unbalanced End*) is a bug in the caller; the output is then
// not valid JSON, nothing crashes.
class JsonWriter {
 public:
  void BeginObject();
  void EndObject();
  void BeginArray();
  void EndArray();
  void Key(absl::string_view key);
  void String(absl::string_view value);
  // Integral values below 2^53 print as integers, others in the shortest form that reads back
  // exactly; NaN and infinities (not JSON) print as null.
  void Number(double value);
  void Unsigned(uint64_t value);
  void Bool(bool value);
  void Null();
  // Inserts `json`, which must be one complete JSON value (e.g. protobuf's JSON of a message).
  void Raw(absl::string_view json);

  const std::string& str() const { return out_; }

 private:
  void BeforeValue();

  std::string out_;
  // One entry per open container: whether it already holds an element.
  std::vector<bool> has_element_;
  bool after_key_ = false;
};

// `value` as a JSON string literal, quotes included.
std::string JsonQuote(absl::string_view value);

}  // namespace poseidon::tools
