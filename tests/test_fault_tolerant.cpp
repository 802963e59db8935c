// Fault-tolerant DDP (corpc/ddp/fault_tolerant.hpp) with real processes: a coordinator (rank 0) and three trainers.
// Trainers are killed (SIGKILL) and stopped (SIGSTOP) at chosen steps; the launcher starts a killed trainer again in
// place (LaunchOptions::max_rank_restarts: the restart rejoins, and is the trainer's next incarnation).
// Every trainer logs the steps it saw committed with their members; at the end every trainer's parameters and
// optimizer state must be bit for bit those of the others, and equal (rtol 1e-5) to one process that replays the
// logged steps: each step's gradient the mean over the batches of the members that took part.
#include <doctest/doctest.h>
#include <signal.h>
#include <torch/torch.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include "corpc/ddp/fault_tolerant.hpp"
#include "corpc/rpc/call.hpp"
#include "corpc/rpc/runtime.hpp"

#include "ft_support.hpp"
#include "support.hpp"

namespace test_fault_tolerant {  // this file's names, apart from the files it shares an executable with

using namespace corpc;
using namespace corpc::test;
using namespace corpc::ddp;
using namespace std::chrono_literals;

namespace {

constexpr int kTrainers = 3;

int pid_of() { return static_cast<int>(::getpid()); }

// On the coordinator's rank: the ranks waiting to join or taken in (see Scenario::gates).
QuorumCoordinator* g_coordinator = nullptr;
// A rank admitted already counts: a quorum formed at the members' last commit may have taken it in before they ask.
std::vector<int> waiting_ranks() {
  if (!g_coordinator) return {};
  auto s = g_coordinator->stats();
  s.waiting.insert(s.waiting.end(), s.members.begin(), s.members.end());
  return s.waiting;
}
bool contains(const std::vector<int>& v, int x) { return std::find(v.begin(), v.end(), x) != v.end(); }

torch::nn::Sequential make_model(int64_t width) {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(8, width), torch::nn::Tanh(), torch::nn::Linear(width, 1));
}

std::pair<at::Tensor, at::Tensor> batch(int64_t step, int rank) {
  auto g = at::detail::createCPUGenerator(static_cast<uint64_t>(step * 1000 + rank));
  return {at::randn({4, 8}, g), at::randn({4, 1}, g)};
}

torch::optim::SGD make_optimizer(torch::nn::Sequential& m, double lr = 0.05) {
  return torch::optim::SGD(m->parameters(), torch::optim::SGDOptions(lr).momentum(0.9));
}

struct Scenario {
  int steps = 10;
  int64_t width = 16;
  double lr = 0.05;
  FaultTolerantOptions ft;
  QuorumOptions quorum;
  RpcOptions rpc = quick_options();
  // In a trainer's step, after its forward and before its backward (incarnation 0, 1, ...).
  std::function<void(int rank, int incarnation, int64_t step)> in_step;
  // After each step() that returned, with the steps committed by then: between a commit and the next forward.
  std::function<void(int rank, int incarnation, int64_t committed)> after_step;
  // (step, rank): members hold that step (before backward) until `rank`, not a member, waits to join. Steps take
  // milliseconds and a replacement's start longer: without this the others could finish before it is back.
  std::vector<std::pair<int64_t, int>> gates;
  // In a trainer that recovered, before it joins the step's group.
  std::function<void(int rank, int incarnation, int64_t step)> on_recovered;
  int max_incarnations = 3;
};

void train(const Scenario& sc, const std::string& dir, int rank, int incarnation) {
  RpcOptions o = sc.rpc;
  o.rejoin = incarnation > 0;
  init_rpc(worker_name(rank), rank, kTrainers + 1, o);
  auto model = make_model(sc.width);
  auto opt = make_optimizer(model, sc.lr);
  FaultTolerantOptions fo = sc.ft;
  fo.on_recovered = [&](const Quorum& q) {
    if (sc.on_recovered) sc.on_recovered(rank, incarnation, q.step);
  };
  FaultTolerantDdp<torch::nn::Sequential> ft(model, opt, fo);
  std::ofstream log(file_in(dir, "log", rank), std::ios::app);
  std::ofstream retries(file_in(dir, "retries", rank), std::ios::app);
  while (ft.committed_steps() < sc.steps) {
    auto report = ft.step([&](const Quorum& q) {
      auto [x, y] = batch(q.step, rank);
      auto loss = torch::mse_loss(ft.forward(x), y);
      if (sc.in_step) sc.in_step(rank, incarnation, q.step);
      for (auto [step, joiner] : sc.gates)
        if (q.step == step && !contains(q.members, joiner))
          while (!contains(rpc_sync<&waiting_ranks>(0), joiner)) std::this_thread::sleep_for(5ms);
      loss.backward();
    });
    log << report.quorum.step;
    for (int m : report.quorum.members) log << ' ' << m;
    log << (report.recovered ? " recovered" : "") << (report.retries > 0 ? " retried" : "") << '\n';
    log.flush();
    if (report.retries > 0) retries << report.quorum.step << ": " << report.last_error << std::endl;
    if (sc.after_step) sc.after_step(rank, incarnation, ft.committed_steps());
  }
  torch::save(sgd_state_of(model->parameters(), opt), file_in(dir, "final", rank));
  shutdown(true);
}

// Runs one incarnation of a trainer rank (the launcher's restart count): an error is written where the test reads it,
// since the launcher would start a failed trainer again.
void run_trainer(const Scenario& sc, const std::string& dir, int rank) {
  try {
    train(sc, dir, rank, rank_restart_count());
  } catch (const std::exception& e) {
    std::ofstream(file_in(dir, "error", rank), std::ios::app) << e.what() << '\n';
    throw;
  }
}

// step -> members, from every trainer's log (they must agree).
std::map<int64_t, std::vector<int>> committed_steps(const std::string& dir) {
  std::map<int64_t, std::vector<int>> steps;
  for (int r = 1; r <= kTrainers; ++r) {
    std::ifstream in(file_in(dir, "log", r));
    std::string line;
    while (std::getline(in, line)) {
      std::istringstream words(line);
      int64_t step;
      words >> step;
      std::vector<int> members;
      std::string w;
      while (words >> w)
        if (std::isdigit(static_cast<unsigned char>(w[0]))) members.push_back(std::stoi(w));
      auto [it, fresh] = steps.emplace(step, members);
      if (!fresh) EXPECT(it->second == members);
    }
  }
  return steps;
}

struct Outcome {
  std::map<int64_t, std::vector<int>> steps;  // step -> members
  std::vector<std::string> logs;              // by rank: the lines "step members... [recovered] [retried]"
  std::vector<std::string> retries;           // by rank: "step: why its last failed attempt failed"
  // Whether `rank` logged `step` with `word` (recovered, retried).
  bool logged(int rank, int64_t step, const std::string& word) const {
    return corpc::test::logged(logs[rank], step, word);
  }
};

// Runs the scenario, then checks: every step committed once with one member list, every trainer's final state bit
// for bit the same, and equal to the replay in one process.
Outcome run_scenario(const Scenario& sc) {
  char tmpl[] = "/tmp/corpc-ft-XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);
  launch_processes(
      kTrainers + 1,
      [&](int rank) {
        if (rank == 0) {
          init_rpc(worker_name(0), 0, kTrainers + 1, sc.rpc);
          {
            QuorumCoordinator coordinator(sc.quorum);
            g_coordinator = &coordinator;
            shutdown(true);
            g_coordinator = nullptr;
          }
          return;
        }
        run_trainer(sc, dir, rank);
      },
      [&] {
        LaunchOptions lo = launch_options(120s);
        lo.max_rank_restarts = sc.max_incarnations - 1;
        return lo;
      }());
  // A trainer's restart is for the kills the scenario makes, not for its errors.
  for (int r = 1; r <= kTrainers; ++r) CHECK(read_file(file_in(dir, "error", r)) == "");
  Outcome out;
  out.logs.resize(kTrainers + 1);
  out.retries.resize(kTrainers + 1);
  for (int r = 1; r <= kTrainers; ++r) {
    out.logs[r] = read_file(file_in(dir, "log", r));
    out.retries[r] = read_file(file_in(dir, "retries", r));
  }
  for (int r = 1; r <= kTrainers; ++r) INFO("trainer " << r << ":\n" << out.logs[r]);
  auto steps = committed_steps(dir);
  out.steps = steps;
  CHECK(static_cast<int>(steps.size()) == sc.steps);
  // The replay and the comparisons run in a rank of their own: this process must not start threads (it forks ranks).
  launch_processes(
      1,
      [&](int) {
        std::vector<std::vector<at::Tensor>> finals;
        for (int r = 1; r <= kTrainers; ++r) {
          std::vector<at::Tensor> s;
          torch::load(s, file_in(dir, "final", r));
          finals.push_back(s);
        }
        for (size_t r = 1; r < finals.size(); ++r)
          for (size_t i = 0; i < finals[0].size(); ++i) EXPECT(torch::equal(finals[r][i], finals[0][i]));
        auto model = make_model(sc.width);
        auto opt = make_optimizer(model, sc.lr);
        for (const auto& [step, members] : steps) {
          opt.zero_grad();
          for (int m : members) {
            auto [x, y] = batch(step, m);
            (torch::mse_loss(model->forward(x), y) / static_cast<double>(members.size())).backward();
          }
          opt.step();
        }
        auto reference = sgd_state_of(model->parameters(), opt);
        for (size_t i = 0; i < reference.size(); ++i)
          if (!torch::allclose(finals[0][i], reference[i], 1e-5, 1e-6))
            throw std::runtime_error("tensor " + std::to_string(i) + " differs from the replay by up to " +
                                     std::to_string((finals[0][i] - reference[i]).abs().max().item<double>()) +
                                     " (largest value " + std::to_string(reference[i].abs().max().item<double>()) +
                                     ")");
      },
      launch_options(60s));
  std::filesystem::remove_all(dir);
  return out;
}

Scenario quick_scenario() {
  Scenario sc;
  sc.quorum.join_timeout = 1500ms * time_scale();
  sc.ft.collective_timeout = 3s * time_scale();
  sc.ft.quorum_timeout = 60s;
  return sc;
}

}  // namespace

TEST_CASE("fault-tolerant DDP without faults: every step has all three trainers and equals one process") {
  auto out = run_scenario(quick_scenario());
  for (const auto& [step, members] : out.steps) CHECK(members == std::vector<int>{1, 2, 3});
}

TEST_CASE("a trainer SIGKILLed mid-step: the survivors retry that step without it, the replacement recovers") {
  auto sc = quick_scenario();
  sc.steps = 12;
  sc.in_step = [](int rank, int incarnation, int64_t step) {
    if (rank == 2 && incarnation == 0 && step == 4) ::raise(SIGKILL);
  };
  sc.gates = {{8, 2}};
  auto out = run_scenario(sc);
  CHECK(out.steps.at(3) == std::vector<int>{1, 2, 3});
  CHECK(out.logged(1, 4, "retried"));  // the survivors ran step 4 again (with or without the replacement yet)
  CHECK(out.logged(3, 4, "retried"));
  // Each survivor's reason names the step, the cause and the worker: the lost one, or a survivor whose allreduce
  // the loss cut before the coordinator saw the connection close.
  for (int r : {1, 3}) CHECK_EQ(survivor_reason_problem(out.retries[r], 4, "worker 'worker2' (rank 2)"), "");
  CHECK(out.logs[2].find("recovered") != std::string::npos);
  CHECK(out.steps.rbegin()->second == std::vector<int>{1, 2, 3});  // the replacement is back
}

TEST_CASE("a trainer SIGKILLed between its commit and the next step's forward: the survivors retry the next step") {
  // The vote that committed step 3 answered step 4's quorum too: the survivors start step 4 in the same epoch and
  // find the trainer gone in its allreduce.
  auto sc = quick_scenario();
  sc.steps = 12;
  sc.after_step = [](int rank, int incarnation, int64_t committed) {
    if (rank == 3 && incarnation == 0 && committed == 4) ::raise(SIGKILL);
  };
  sc.gates = {{8, 3}};
  auto out = run_scenario(sc);
  CHECK(out.steps.at(3) == std::vector<int>{1, 2, 3});
  CHECK(out.logged(1, 4, "retried"));
  CHECK(out.logged(2, 4, "retried"));
  for (int r : {1, 2}) CHECK_EQ(survivor_reason_problem(out.retries[r], 4, "worker 'worker3' (rank 3)"), "");
  CHECK(out.logs[3].find("recovered") != std::string::npos);
  CHECK(out.steps.rbegin()->second == std::vector<int>{1, 2, 3});
}

TEST_CASE("two trainers lost in the same step: the last one goes on alone, both replacements recover") {
  auto sc = quick_scenario();
  sc.steps = 12;
  sc.in_step = [](int rank, int incarnation, int64_t step) {
    if (rank != 1 && incarnation == 0 && step == 3) ::raise(SIGKILL);
  };
  sc.gates = {{7, 2}, {8, 3}};
  auto out = run_scenario(sc);
  CHECK(out.logged(1, 3, "retried"));
  CHECK(out.logs[2].find("recovered") != std::string::npos);
  CHECK(out.logs[3].find("recovered") != std::string::npos);
  CHECK(out.steps.rbegin()->second == std::vector<int>{1, 2, 3});
}

TEST_CASE("a replacement lost during its recovery: the others go on, its next incarnation recovers") {
  auto sc = quick_scenario();
  sc.steps = 12;
  sc.in_step = [](int rank, int incarnation, int64_t step) {
    if (rank == 3 && incarnation == 0 && step == 2) ::raise(SIGKILL);
  };
  sc.on_recovered = [](int rank, int incarnation, int64_t) {
    if (rank == 3 && incarnation == 1) ::raise(SIGKILL);  // after loading the donor's state, before the group
  };
  sc.gates = {{5, 3}, {9, 3}};
  auto out = run_scenario(sc);
  CHECK(out.logs[3].find("recovered") != std::string::npos);
  CHECK(out.steps.rbegin()->second == std::vector<int>{1, 2, 3});
}

TEST_CASE("a model larger than the same-host ring is recovered (it goes by TCP)") {
  auto sc = quick_scenario();
  sc.width = 1 << 15;
  sc.lr =
      1e-4;  // a step of 0.05 diverges at this width, and a diverging run amplifies rounding past any tolerance                                    // 1.2 MiB of parameters, twice that with the momentum
  sc.rpc.same_host_ring_bytes = std::uint64_t{1} << 20;  // 1 MiB
  sc.steps = 6;
  sc.in_step = [](int rank, int incarnation, int64_t step) {
    if (rank == 1 && incarnation == 0 && step == 2) ::raise(SIGKILL);
  };
  sc.gates = {{4, 1}};
  auto out = run_scenario(sc);
  CHECK(out.logs[1].find("recovered") != std::string::npos);
  CHECK(out.steps.rbegin()->second == std::vector<int>{1, 2, 3});
}

TEST_CASE("a trainer stopped past the join timeout is left out, then told it is behind and recovers") {
  auto sc = quick_scenario();
  sc.steps = 12;
  // Trainer 1 stops trainer 3 during step 3 and lets it go once three more steps were committed without it.
  static pid_t stopped = 0;
  sc.in_step = [](int rank, int, int64_t step) {
    if (rank != 1) return;
    if (step == 3 && stopped == 0) {
      stopped = rpc_sync<&pid_of>(3);
      ::kill(stopped, SIGSTOP);
    }
    if (step == 6 && stopped > 0) {
      ::kill(stopped, SIGCONT);
      stopped = -1;
    }
  };
  sc.gates = {{9, 3}};
  auto out = run_scenario(sc);
  CHECK(!contains(out.steps.at(4), 3));
  CHECK(!contains(out.steps.at(5), 3));
  CHECK(out.logs[3].find("recovered") != std::string::npos);  // told it was behind: it loaded a member's state
  CHECK(out.steps.rbegin()->second == std::vector<int>{1, 2, 3});
}

TEST_CASE("the coordinator killed: every trainer ends with ConnectionError naming it, none hangs") {
  char tmpl[] = "/tmp/corpc-ft-XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);
  auto sc = quick_scenario();
  try {
    launch_processes(
        kTrainers + 1,
        [&](int rank) {
          init_rpc(worker_name(rank), rank, kTrainers + 1, sc.rpc);
          if (rank == 0) {
            QuorumCoordinator coordinator(sc.quorum);
            while (coordinator.stats().commits < 3) std::this_thread::sleep_for(1ms);
            ::raise(SIGKILL);
          }
          auto model = make_model(16);
          auto opt = make_optimizer(model);
          FaultTolerantDdp<torch::nn::Sequential> ft(model, opt, sc.ft);
          try {
            for (;;)
              ft.step([&](const Quorum& q) {
                auto [x, y] = batch(q.step, rank);
                torch::mse_loss(ft.forward(x), y).backward();
              });
          } catch (const ConnectionError& e) {
            std::ofstream(file_in(dir, "error", rank)) << e.what();
          }
          shutdown(false);
        },
        launch_options(60s));
    FAIL("the coordinator's rank was expected to fail");
  } catch (const LaunchError& e) {
    INFO(e.what());
    REQUIRE(e.failures().size() == 1);
    CHECK(e.failures()[0].rank == 0);
  }
  for (int r = 1; r <= kTrainers; ++r) {
    const auto what = read_file(file_in(dir, "error", r));
    INFO(what);
    CHECK(what.find("rank 0") != std::string::npos);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("trainers under a coordinator made with replica groups are refused as they are made, with the fix") {
  // FaultTolerantDdp trains each rank as a replica of its own; a coordinator that takes whole groups would wait for
  // mates that never ask, and could not recover a lost trainer. Refused before any step.
  char tmpl[] = "/tmp/corpc-ft-XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);
  auto sc = quick_scenario();
  sc.quorum.replica_groups = {{1}, {2}, {3}};
  launch_processes(
      kTrainers + 1,
      [&](int rank) {
        init_rpc(worker_name(rank), rank, kTrainers + 1, sc.rpc);
        if (rank == 0) {
          QuorumCoordinator coordinator(sc.quorum);
          shutdown(true);
          return;
        }
        auto model = make_model(16);
        auto opt = make_optimizer(model);
        try {
          FaultTolerantDdp<torch::nn::Sequential> ft(model, opt, sc.ft);
          std::ofstream(file_in(dir, "error", rank)) << "was made";
        } catch (const UsageError& e) {
          std::ofstream(file_in(dir, "error", rank)) << e.what();
        }
        shutdown(true);
      },
      launch_options(60s));
  for (int r = 1; r <= kTrainers; ++r) {
    const auto what = read_file(file_in(dir, "error", r));
    INFO("trainer " << r << ": " << what);
    CHECK(what.find("the QuorumCoordinator on worker 'master' (rank 0) was made with replica_groups {{1}, {2}, {3}}") !=
          std::string::npos);
    CHECK(what.find("make the coordinator without replica_groups") != std::string::npos);
  }
  std::filesystem::remove_all(dir);
}

}  // namespace test_fault_tolerant
