#include "common/status.h"

#include <memory>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace poseidon {
namespace {

using ::testing::HasSubstr;

absl::Status Fail(bool fail) {
  return fail ? absl::NotFoundError("gone") : absl::OkStatus();
}

absl::StatusOr<int> Half(int x) {
  if (x % 2 != 0) return absl::InvalidArgumentError("odd");
  return x / 2;
}

absl::Status TwoSteps(bool first_fails, bool second_fails, int* steps) {
  RETURN_IF_ERROR(Fail(first_fails));
  ++*steps;
  RETURN_IF_ERROR(Fail(second_fails));
  ++*steps;
  return absl::OkStatus();
}

TEST(StatusMacros, ReturnIfErrorStopsAtTheFirstError) {
  int steps = 0;
  EXPECT_TRUE(TwoSteps(false, false, &steps).ok());
  EXPECT_EQ(steps, 2);
  steps = 0;
  const absl::Status s = TwoSteps(false, true, &steps);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(steps, 1);
}

absl::StatusOr<int> Quarter(int x) {
  ASSIGN_OR_RETURN(const int half, Half(x));
  ASSIGN_OR_RETURN(int quarter, Half(half));
  return quarter;
}

TEST(StatusMacros, AssignOrReturnDeclaresAndPropagates) {
  EXPECT_EQ(*Quarter(12), 3);
  EXPECT_EQ(Quarter(6).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Quarter(7).status().message(), "odd");
}

absl::StatusOr<std::unique_ptr<int>> MakeBox(int v) {
  return std::make_unique<int>(v);
}

absl::Status MoveOnly(int* out) {
  std::unique_ptr<int> box;
  ASSIGN_OR_RETURN(box, MakeBox(5));  // assigns to an existing variable
  // Two uses on one line need distinct temporaries.
  // clang-format off
  ASSIGN_OR_RETURN(auto a, MakeBox(1)); ASSIGN_OR_RETURN(auto b, MakeBox(2));
  // clang-format on
  *out = *box + *a + *b;
  return absl::OkStatus();
}

TEST(StatusMacros, AssignOrReturnMovesAndAllowsTwoPerLine) {
  int out = 0;
  ASSERT_TRUE(MoveOnly(&out).ok());
  EXPECT_EQ(out, 8);
}

TEST(Annotate, PrefixesContextAndKeepsCode) {
  const absl::Status s = Annotate(absl::UnavailableError("connection refused"), "pushing key 7");
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(s.message(), "pushing key 7: connection refused");
  EXPECT_TRUE(Annotate(absl::OkStatus(), "ignored").ok());
  EXPECT_THAT(std::string(Annotate(s, "step 3").message()), HasSubstr("step 3: pushing key 7"));
}

}  // namespace
}  // namespace poseidon
