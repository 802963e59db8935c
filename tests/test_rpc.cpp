// RPC over real sockets: every test forks real worker processes that talk over 127.0.0.1.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <ATen/ATen.h>

#include "support.hpp"

using namespace corpc;
using namespace corpc::test;
using namespace std::chrono_literals;

namespace {
int add(int a, int b) { return a + b; }
std::string greet(const std::string& who) { return "hello " + who; }
}  // namespace

TEST_CASE("rpc_sync and rpc_async reach every worker by name and rank") {
  run_world(3, [](int rank) {
    if (rank != 0) return;
    EXPECT_EQ(rpc_sync<&add>(1, 2, 3), 5);
    EXPECT_EQ(rpc_sync<&add>("worker2", 2, 3), 5);
    EXPECT_EQ(rpc_async<&greet>("worker1", "you").wait(), "hello you");
    EXPECT_EQ(rpc_sync<&add>(0, 4, 4), 8);  // to ourselves
  });
}
