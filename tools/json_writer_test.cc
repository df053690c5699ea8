#include "tools/json_writer.h"

#include <limits>

#include "gtest/gtest.h"

namespace poseidon::tools {
namespace {

TEST(JsonWriterTest, NestsAndSeparates) {
  JsonWriter w;
  w.BeginObject();
  w.Key("a");
  w.Unsigned(1);
  w.Key("b");
  w.BeginArray();
  w.Number(0.5);
  w.Bool(true);
  w.Null();
  w.BeginObject();
  w.EndObject();
  w.EndArray();
  w.Key("c");
  w.Raw("{\"x\": \"y\"}");
  w.EndObject();
  EXPECT_EQ(w.str(), R"({"a": 1, "b": [0.5, true, null, {}], "c": {"x": "y"}})");
}

TEST(JsonWriterTest, NumbersAndStrings) {
  JsonWriter w;
  w.BeginArray();
  w.Number(822083584);
  w.Number(5e-05);
  w.Number(std::numeric_limits<double>::quiet_NaN());
  w.Number(-3);
  w.String("q\"\\\n\x01");
  w.EndArray();
  EXPECT_EQ(w.str(), R"([822083584, 5e-05, null, -3, "q\"\\\n\u0001"])");
}

}  // namespace
}  // namespace poseidon::tools
