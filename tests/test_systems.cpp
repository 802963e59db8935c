// The tutorials' training systems (examples/systems/) end to end: real processes, results against one process.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <ATen/ATen.h>

#include "leak_checks.hpp"
#include "support.hpp"
#include "systems/common.hpp"
#include "systems/param_server.hpp"

using namespace corpc;
using namespace corpc::test;
using namespace std::chrono_literals;
namespace ps = systems::ps;

namespace {

RpcOptions options() { return systems::single_threaded(quick_options()); }

template <class Server>
std::vector<ps::TrainerResult> train(RRef<Server> server, int trainers, std::int64_t steps, std::uint64_t seed) {
  std::vector<Future<ps::TrainerResult>> loops;
  for (int t = 0; t < trainers; ++t) loops.push_back(rpc_async<&ps::run_trainer<Server>>(t + 1, server, t, steps, seed));
  return wait_all(std::move(loops)).wait(60s);
}

}  // namespace

TEST_CASE("batch-updating parameter server: one update per round, parameters equal one process") {
  // Tolerance: none. Each round's gradients are computed from the same parameters on the same batches with one
  // intra-op thread, and the server sums them in trainer order (not arrival order), as the reference does; the
  // result is therefore bit for bit the reference's.
  static constexpr int kTrainers = 2;
  static constexpr std::int64_t kRounds = 6;
  static constexpr std::uint64_t kSeed = 3;
  static constexpr double kLr = 0.1;
  run_world(kTrainers + 1, [](int rank) {
    if (rank != 0) return;
    {
      auto server = remote<ps::BatchUpdatingParameterServer>(0, kTrainers, kSeed, kLr);
      auto results = train(server, kTrainers, kRounds, kSeed);
      for (auto& r : results) {
        EXPECT_EQ(r.steps, kRounds);
        for (std::int64_t i = 0; i < kRounds; ++i) EXPECT_EQ(r.versions[static_cast<std::size_t>(i)], i + 1);
      }
      EXPECT_EQ(server.rpc_sync<&ps::BatchUpdatingParameterServer::updates>(), kRounds);
      auto got = server.rpc_sync<&ps::BatchUpdatingParameterServer::get_parameters>();
      auto want = ps::reference_batch_updating(kTrainers, kRounds, kSeed, kLr);
      EXPECT_EQ(got.params.size(), want.size());
      for (std::size_t i = 0; i < want.size(); ++i) EXPECT(at::equal(got.params[i], want[i]));
      EXPECT(!at::equal(got.params[0], ps::init_parameters(kSeed)[0]));  // it did train
    }
    expect_no_references(kTrainers + 1);
  }, options());
}

TEST_CASE("batch-updating parameter server: a call completes only when its round is full") {
  run_world(2, [](int rank) {
    if (rank != 0) return;
    {
      using Server = ps::BatchUpdatingParameterServer;
      auto server = remote<Server>("worker1", 2, std::uint64_t{1}, 0.1);
      auto params = server.rpc_sync<&Server::get_parameters>().params;
      auto grads = ps::gradients(params, ps::synthetic_batch(1, 0, 0));
      auto first = server.rpc_async<&Server::update_and_fetch>(0, grads);
      while (server.rpc_sync<&Server::pending>() != 1) std::this_thread::sleep_for(1ms);
      EXPECT(!first.done());  // received, and waiting for trainer 1
      auto twice = server.rpc_async<&Server::update_and_fetch>(0, grads);
      EXPECT_THROWS_AS(twice.wait(10s), RemoteError);  // trainer 0 cannot fill the round alone
      EXPECT(!first.done());
      auto second = server.rpc_async<&Server::update_and_fetch>(1, grads);
      auto a = first.wait(10s), b = second.wait(10s);
      EXPECT_EQ(a.version, 1);
      EXPECT_EQ(b.version, 1);
      for (std::size_t i = 0; i < a.params.size(); ++i) EXPECT(at::equal(a.params[i], b.params[i]));
      EXPECT_EQ(server.rpc_sync<&Server::updates>(), 1);
    }
    expect_no_references(2);
  }, options());
}

TEST_CASE("asynchronous parameter server converges on the synthetic task") {
  // Chance is 0.1; one process reaches ~0.6 held-out accuracy after these 300 updates. 0.4 leaves room for the
  // arrival order, which differs between runs.
  static constexpr int kTrainers = 2;
  static constexpr std::int64_t kSteps = 150;
  static constexpr std::uint64_t kSeed = 0;
  run_world(kTrainers + 1, [](int rank) {
    if (rank != 0) return;
    {
      auto server = remote<ps::AsyncParameterServer>(0, kSeed, 0.1);
      auto held_out = ps::held_out_batch(kSeed);
      auto before = ps::accuracy(server.rpc_sync<&ps::AsyncParameterServer::get_parameters>().params, held_out);
      train(server, kTrainers, kSteps, kSeed);
      auto after = server.rpc_sync<&ps::AsyncParameterServer::get_parameters>();
      EXPECT_EQ(after.version, kTrainers * kSteps);
      const float acc = ps::accuracy(after.params, held_out);
      if (!(before < 0.2f && acc > 0.4f))
        throw std::runtime_error("accuracy " + std::to_string(before) + " -> " + std::to_string(acc));
    }
    expect_no_references(kTrainers + 1);
  }, options());
}
