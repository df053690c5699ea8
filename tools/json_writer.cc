#include "tools/json_writer.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/config.h"

namespace poseidon::tools {

std::string JsonQuote(absl::string_view value) {
  std::string out = "\"";
  for (const char c : value) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          absl::StrAppendFormat(&out, "\\u%04x", static_cast<unsigned char>(c));
        } else {
          out.push_back(c);
        }
    }
  }
  out += "\"";
  return out;
}

void JsonWriter::BeforeValue() {
  if (after_key_) {
    after_key_ = false;
    return;
  }
  if (!has_element_.empty()) {
    if (has_element_.back()) out_ += ", ";
    has_element_.back() = true;
  }
}

void JsonWriter::BeginObject() {
  BeforeValue();
  out_ += "{";
  has_element_.push_back(false);
}

void JsonWriter::EndObject() {
  out_ += "}";
  if (!has_element_.empty()) has_element_.pop_back();
}

void JsonWriter::BeginArray() {
  BeforeValue();
  out_ += "[";
  has_element_.push_back(false);
}

void JsonWriter::EndArray() {
  out_ += "]";
  if (!has_element_.empty()) has_element_.pop_back();
}

void JsonWriter::Key(absl::string_view key) {
  BeforeValue();
  absl::StrAppend(&out_, JsonQuote(key), ": ");
  after_key_ = true;
}

void JsonWriter::String(absl::string_view value) {
  BeforeValue();
  out_ += JsonQuote(value);
}

void JsonWriter::Number(double value) {
  BeforeValue();
  if (!std::isfinite(value)) {
    out_ += "null";
  } else if (value == std::floor(value) && std::fabs(value) < 9007199254740992.0) {
    absl::StrAppend(&out_, static_cast<int64_t>(value));
  } else {
    out_ += FormatDouble(value);  // shortest form that reads back exactly, e.g. 5e-05
  }
}

void JsonWriter::Unsigned(uint64_t value) {
  BeforeValue();
  absl::StrAppend(&out_, value);
}

void JsonWriter::Bool(bool value) {
  BeforeValue();
  out_ += value ? "true" : "false";
}

void JsonWriter::Null() {
  BeforeValue();
  out_ += "null";
}

void JsonWriter::Raw(absl::string_view json) {
  BeforeValue();
  out_.append(json.data(), json.size());
}

}  // namespace poseidon::tools
