#include "coordinator/auth.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "coordinator/test_util.h"

namespace poseidon::coordinator::testing {
namespace {

using ::testing::HasSubstr;

TEST(TokenStoreTest, ChecksJobsAndTokens) {
  TokenStore tokens = DefaultTokens();
  EXPECT_TRUE(tokens.Check(kJobA, kTokenA).ok());
  EXPECT_TRUE(tokens.Check(kJobB, kTokenB).ok());
  EXPECT_EQ(tokens.Check(kJobA, kTokenB).code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(tokens.Check(kJobA, "secret-a-longer").code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(tokens.Check(kJobA, "secret-").code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(tokens.Check(kJobA, "").code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(tokens.Check("job-c", kTokenA).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(tokens.Check("", kClusterToken).ok());
  EXPECT_EQ(tokens.Check("", kTokenA).code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(tokens.JobIds(), (std::vector<std::string>{kJobA, kJobB}));

  TokenStore no_cluster;
  ASSERT_TRUE(no_cluster.AddJob("j", "t").ok());
  EXPECT_EQ(no_cluster.Check("", "anything").code(), absl::StatusCode::kPermissionDenied);
}

TEST(TokenStoreTest, RefusesMalformedEntries) {
  TokenStore tokens;
  EXPECT_THAT(std::string(tokens.AddJob("a b", "t").message()), HasSubstr("job id: may contain"));
  EXPECT_THAT(std::string(tokens.AddJob("j", "").message()), HasSubstr("token must not be empty"));
  EXPECT_THAT(std::string(tokens.AddJob("j", "to ken").message()), HasSubstr("printable ASCII"));
  ASSERT_TRUE(tokens.AddJob("j", "t").ok());
  EXPECT_TRUE(tokens.AddJob("j", "t").ok());  // the same entry twice is harmless
  EXPECT_THAT(std::string(tokens.AddJob("j", "u").message()),
              HasSubstr("configured twice with different tokens"));
}

TEST(TokenStoreTest, LoadsAFile) {
  char pattern[] = "/tmp/poseidon-tokens-XXXXXX";
  const int fd = mkstemp(pattern);
  ASSERT_GE(fd, 0);
  close(fd);
  std::ofstream(pattern) << "# jobs\n\n  job-x   tok-x  \njob-y\ttok-y\n";
  TokenStore tokens;
  ASSERT_TRUE(tokens.LoadFile(pattern).ok());
  EXPECT_TRUE(tokens.Check("job-x", "tok-x").ok());
  EXPECT_TRUE(tokens.Check("job-y", "tok-y").ok());
  std::ofstream(pattern) << "job-z tok z\n";
  TokenStore bad;
  EXPECT_THAT(std::string(bad.LoadFile(pattern).message()),
              HasSubstr(absl::StrCat(pattern, ":1: expected '<job id> <token>'")));
  std::filesystem::remove(pattern);
  EXPECT_EQ(bad.LoadFile(pattern).code(), absl::StatusCode::kNotFound);
}

TEST(CallMetadataTest, TheJobAndTokenMetadataAreCheckedLikeTheHeader) {
  TokenStore tokens;
  ASSERT_TRUE(tokens.AddJob("job-a", "tok-a").ok());
  ASSERT_TRUE(tokens.SetClusterToken("cluster").ok());
  using M = std::multimap<std::string, std::string>;
  EXPECT_TRUE(CheckCallMetadata(tokens, M{{kJobMetadata, "job-a"}, {kTokenMetadata, "tok-a"}}).ok());
  EXPECT_TRUE(CheckCallMetadata(tokens, M{{kTokenMetadata, "cluster"}}).ok()) << "cluster call";
  const std::pair<M, std::string> refused[] = {
      {M{{kJobMetadata, "job-a"}}, "carries no poseidon-token-bin metadata"},
      {M{{kJobMetadata, "job-a"}, {kTokenMetadata, "tok-b"}}, "wrong token for job 'job-a'"},
      {M{{kTokenMetadata, "tok-a"}}, "wrong cluster token"},
      {M{{kJobMetadata, "job-a"}, {kTokenMetadata, "tok-a"}, {kTokenMetadata, "tok-a"}},
       "given twice"},
  };
  for (const auto& [metadata, why] : refused) {
    const absl::Status s = CheckCallMetadata(tokens, metadata);
    EXPECT_FALSE(s.ok()) << why;
    EXPECT_THAT(std::string(s.message()), HasSubstr(why));
  }
}

}  // namespace
}  // namespace poseidon::coordinator::testing
