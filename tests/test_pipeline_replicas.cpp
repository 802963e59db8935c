// Pipeline replicas (corpc/ddp/pipeline_replicas.hpp) with real processes: a coordinator (rank 0) and R replicas of a
// K-stage pipeline. Without faults every schedule's result must equal the whole model trained on the whole batch in
// one process; with workers SIGKILLed (restarted in place by the launcher) or SIGSTOPped mid-step, every step must be
// committed once with one list of replicas, every replica's stages bit for bit alike at the end, and equal to one
// process replaying the logged steps (each step's loss the mean over the replicas that took part).
#include <doctest/doctest.h>
#include <signal.h>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include "corpc/ddp/pipeline_replicas.hpp"
#include "corpc/ddp/replica_checkpoint.hpp"
#include "corpc/rpc/call.hpp"
#include "corpc/rpc/runtime.hpp"

#include "ft_support.hpp"
#include "stop_process.hpp"
#include "support.hpp"

namespace test_pipeline_replicas {  // this file's names, apart from the files it shares an executable with

using namespace corpc;
using namespace corpc::test;
using namespace corpc::ddp;
using namespace corpc::pipeline;
using namespace std::chrono_literals;

namespace {

constexpr int64_t kWidth = 16;
constexpr int kLayers = 8;
constexpr double kLr = 0.05;
constexpr int64_t kBatch = 8;  // per replica

int pid_of() { return static_cast<int>(::getpid()); }

// In a worker: the replicas of the last step it saw committed.
std::vector<int> g_last_replicas;

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

torch::nn::Sequential make_model() {
  torch::manual_seed(0);
  torch::nn::Sequential m;
  m->push_back(torch::nn::Linear(8, kWidth));
  for (int i = 1; i < kLayers - 1; ++i) {
    if (i % 2 == 1) m->push_back(torch::nn::Tanh());
    else m->push_back(torch::nn::Linear(kWidth, kWidth));
  }
  m->push_back(torch::nn::Linear(kWidth, 1));
  return m;
}

at::Tensor mse(const at::Tensor& out, const at::Tensor& target) { return torch::mse_loss(out, target); }

std::unique_ptr<torch::optim::Optimizer> make_sgd(std::vector<at::Tensor> params) {
  return std::make_unique<torch::optim::SGD>(std::move(params), torch::optim::SGDOptions(kLr).momentum(0.9));
}

std::unique_ptr<torch::optim::Optimizer> make_adam(std::vector<at::Tensor> params) {
  return std::make_unique<torch::optim::Adam>(std::move(params), torch::optim::AdamOptions(kLr));
}

std::pair<at::Tensor, at::Tensor> batch(int64_t step, int replica) {
  auto g = at::detail::createCPUGenerator(static_cast<uint64_t>(step * 1000 + replica));
  return {at::randn({kBatch, 8}, g), at::randn({kBatch, 1}, g)};
}

struct Step {
  std::vector<int> replicas;
  std::map<int, double> losses;  // by replica
};

struct Scenario {
  PipelineReplicaOptions options = [] {
    PipelineReplicaOptions o;
    o.replicas = 2;
    o.balance = {4, 4};
    o.micro_batches = 4;
    o.ft.collective_timeout = 3s * time_scale();
    o.ft.quorum_timeout = 60s;
    return o;
  }();
  int steps = 6;
  QuorumOptions quorum = [] {
    QuorumOptions q;
    q.join_timeout = 1500ms * time_scale();
    return q;
  }();
  RpcOptions rpc = quick_options();
  // After each action of a worker's attempt at `step`.
  std::function<void(int rank, int incarnation, int64_t step, const Action& a)> after_action;
  // After each step() that returned, with the steps committed by then: between a commit and the next forward.
  std::function<void(int rank, int incarnation, int64_t committed)> after_step;
  // (step, rank): before that step, the workers wait until `rank`, if its replica missed the last step, waits to join.
  // Steps take milliseconds and a replacement's start longer: without this the others could finish before it is back.
  std::vector<std::pair<int64_t, int>> gates;
  int max_incarnations = 3;
  // Checkpoints: every worker saves under `save_root` once `save_at` steps are committed, and loads the step
  // directory `load_from` before its first step; `history` holds the steps before that one, for the replay.
  int64_t save_at = -1;
  std::string save_root, load_from;
  std::map<int64_t, Step> history;
};

void train(const Scenario& sc, const std::string& dir, int rank, int incarnation, int world) {
  RpcOptions o = sc.rpc;
  o.rejoin = incarnation > 0;
  init_rpc(worker_name(rank), rank, world, o);
  PipelineReplicaOptions po = sc.options;
  if (sc.after_action)
    po.after_action = [&](int64_t step, const Action& a) { sc.after_action(rank, incarnation, step, a); };
  PipelineReplicas pp(make_model(), &mse, &make_sgd, po);
  if (!sc.load_from.empty()) pp.load_checkpoint(sc.load_from);
  std::ofstream log(file_in(dir, "log", rank), std::ios::app);
  std::ofstream retries(file_in(dir, "retries", rank), std::ios::app);
  ReplicaStepReport report;
  // Past the last step until every replica is back (see "Finishing" in corpc/ddp/fault_tolerant.hpp); slowly then.
  while (pp.committed_steps() < sc.steps || static_cast<int>(report.replicas.size()) < sc.options.replicas) {
    if (pp.committed_steps() >= sc.steps) std::this_thread::sleep_for(20ms);
    for (auto [step, joiner] : sc.gates)
      if (pp.committed_steps() == step && !contains(g_last_replicas, pp.layout().replica_of(joiner)))
        while (!contains(rpc_sync<&waiting_ranks>(0), joiner)) std::this_thread::sleep_for(5ms);
    report = pp.step(batch);
    g_last_replicas = report.replicas;
    log << report.ft.quorum.step << " :";
    for (int r : report.replicas) log << ' ' << r;
    if (report.loss) log << " loss=" << *report.loss;
    // This worker's other work went on while a stage's gradients were averaged.
    std::int64_t last_end = 0;
    for (const auto& r : report.worker.records) last_end = std::max(last_end, r.end_ns);
    for (const auto& a : report.averaging)
      if (a.started_ns < last_end) {
        log << " overlapped";
        break;
      }
    log << (report.ft.recovered ? " recovered" : "") << (report.ft.retries > 0 ? " retried" : "") << '\n';
    log.flush();
    if (report.ft.retries > 0) retries << report.ft.quorum.step << ": " << report.ft.last_error << std::endl;
    if (pp.committed_steps() == sc.save_at && !sc.save_root.empty()) pp.save_checkpoint(sc.save_root);
    if (sc.after_step) sc.after_step(rank, incarnation, pp.committed_steps());
  }
  pp.wait_checkpoint();
  for (auto& st : pp.stages())
    torch::save(sgd_state_of(st.layers->parameters(), *st.optimizer),
                file_in(dir, "final" + std::to_string(st.stage) + "_", rank));
  shutdown(true);
}

struct Outcome {
  std::map<int64_t, Step> steps;
  std::vector<std::string> logs;     // by rank
  std::vector<std::string> retries;  // by rank: "step: why its last failed attempt failed"
  bool logged(int rank, int64_t step, const std::string& word) const {
    return corpc::test::logged(logs[rank], step, word);
  }
};

// Runs the scenario, then checks: every step committed once with one list of replicas, the stages of every replica
// bit for bit alike, and all of it equal to one process that replays the logged steps.
Outcome run_scenario(const Scenario& sc) {
  char tmpl[] = "/tmp/corpc-pp-XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);
  const ReplicaLayout layout = layout_of(sc.options);
  const int world = 1 + layout.world();
  launch_processes(
      world,
      [&](int rank) {
        if (rank == 0) {
          init_rpc(worker_name(0), 0, world, sc.rpc);
          {
            QuorumOptions q = sc.quorum;
            q.replica_groups = layout.replica_groups();
            QuorumCoordinator coordinator(q);
            g_coordinator = &coordinator;
            shutdown(true);
            g_coordinator = nullptr;
          }
          return;
        }
        try {
          train(sc, dir, rank, rank_restart_count(), world);
        } catch (const std::exception& e) {
          std::ofstream(file_in(dir, "error", rank), std::ios::app) << e.what() << '\n';
          throw;
        }
      },
      [&] {
        LaunchOptions lo = launch_options(120s);
        lo.max_rank_restarts = sc.max_incarnations - 1;
        return lo;
      }());
  Outcome out;
  out.logs.resize(static_cast<size_t>(world));
  out.retries.resize(static_cast<size_t>(world));
  for (int r = 1; r < world; ++r) {
    out.logs[r] = read_file(file_in(dir, "log", r));
    out.retries[r] = read_file(file_in(dir, "retries", r));
    INFO("worker " << r << ":\n" << out.logs[r]);
    CHECK(read_file(file_in(dir, "error", r)) == "");
    std::istringstream in(out.logs[r]);
    std::string line;
    while (std::getline(in, line)) {
      std::istringstream words(line);
      int64_t step;
      std::string w;
      words >> step >> w;
      Step s;
      while (words >> w) {
        if (std::isdigit(static_cast<unsigned char>(w[0]))) s.replicas.push_back(std::stoi(w));
        if (w.rfind("loss=", 0) == 0) s.losses[layout.replica_of(r)] = std::stod(w.substr(5));
      }
      auto [it, fresh] = out.steps.emplace(step, s);
      CHECK(it->second.replicas == s.replicas);  // one list of replicas per step, wherever it was logged
      for (auto [replica, loss] : s.losses) it->second.losses[replica] = loss;
    }
  }
  const auto first = static_cast<int64_t>(sc.history.size());  // the step a loaded checkpoint starts from
  REQUIRE(static_cast<int64_t>(out.steps.size()) + first >= sc.steps);
  CHECK(out.steps.begin()->first == first);
  CHECK(out.steps.rbegin()->first + 1 == first + static_cast<int64_t>(out.steps.size()));  // each once
  auto replayed = sc.history;
  replayed.insert(out.steps.begin(), out.steps.end());
  // The replay and the comparisons run in a rank of their own: this process must not start threads (it forks ranks).
  launch_processes(
      1,
      [&](int) {
        auto model = make_model();
        torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(kLr).momentum(0.9));
        for (const auto& [step, s] : replayed) {
          opt.zero_grad();
          double total = 0;
          for (int r : s.replicas) {
            auto [x, y] = batch(step, r);
            auto loss = mse(model->forward(x), y) / static_cast<double>(s.replicas.size());
            total += loss.item<double>();
            loss.backward();
          }
          double logged = 0;
          for (int r : s.replicas) logged += s.losses.at(r) / static_cast<double>(s.replicas.size());
          if (std::abs(logged - total) > 1e-4 * std::abs(total) + 1e-6)
            throw std::runtime_error("step " + std::to_string(step) + ": loss " + std::to_string(logged) +
                                     ", one process " + std::to_string(total));
          opt.step();
        }
        // The whole model's parameters are its stages' in order: compare stage by stage, every replica.
        const auto params = model->parameters();
        size_t first = 0;
        for (int stage = 0; stage < static_cast<int>(sc.options.balance.size()); ++stage) {
          torch::nn::Sequential probe = make_model();
          size_t layer = 0, count = 0;
          for (int s = 0; s < stage; ++s) layer += static_cast<size_t>(sc.options.balance[s]);
          for (size_t l = layer; l < layer + static_cast<size_t>(sc.options.balance[stage]); ++l)
            count += probe[l]->parameters().size();
          const auto where = stage_workers(placement_of(sc.options.schedule), layout.workers_per_replica,
                                           static_cast<int>(sc.options.balance.size()));
          std::vector<at::Tensor> reference(params.begin() + static_cast<std::ptrdiff_t>(first),
                                            params.begin() + static_cast<std::ptrdiff_t>(first + count));
          reference = sgd_state_of(reference, opt);
          std::vector<at::Tensor> replica0;
          for (int r = 0; r < layout.replicas; ++r) {
            std::vector<at::Tensor> s;
            torch::load(s, file_in(dir, "final" + std::to_string(stage) + "_", layout.rank(r, where[stage])));
            if (r == 0) replica0 = s;
            for (size_t i = 0; i < s.size(); ++i)
              if (!torch::equal(s[i], replica0[i]))
                throw std::runtime_error("stage " + std::to_string(stage) + ": replica " + std::to_string(r) +
                                         " differs from replica 0 in tensor " + std::to_string(i));
          }
          for (size_t i = 0; i < reference.size(); ++i)
            if (!torch::allclose(replica0[i], reference[i], 1e-4, 1e-6))
              throw std::runtime_error("stage " + std::to_string(stage) + " tensor " + std::to_string(i) +
                                       " differs from one process by up to " +
                                       std::to_string((replica0[i] - reference[i]).abs().max().item<double>()));
          first += count;
        }
      },
      launch_options(60s));
  std::filesystem::remove_all(dir);
  return out;
}

Scenario with(Schedule schedule, std::vector<int> balance) {
  Scenario sc;
  sc.options.schedule = schedule;
  sc.options.balance = std::move(balance);
  return sc;
}

bool all_replicas(const Step& s) { return s.replicas == std::vector<int>{0, 1}; }

}  // namespace

TEST_CASE("pipeline replicas without faults equal the whole model on the whole batch in one process") {
  struct Case {
    Schedule schedule;
    std::vector<int> balance;
  };
  for (const auto& c : {Case{Schedule::OneFOneB, {4, 4}}, Case{Schedule::OneFOneB, {2, 2, 2, 2}},
                        Case{Schedule::Interleaved1F1B, {4, 4}}, Case{Schedule::Interleaved1F1B, {2, 2, 2, 2}},
                        Case{Schedule::ZBVZeroBubble, {4, 4}}, Case{Schedule::ZBVZeroBubble, {2, 2, 2, 2}}}) {
    INFO(std::string(to_string(c.schedule)) << " with " << c.balance.size() << " stages");
    auto out = run_scenario(with(c.schedule, c.balance));
    for (const auto& [step, s] : out.steps) CHECK(all_replicas(s));
    // A worker with two stages starts averaging the one whose backward ends first while it runs the other's.
    if (min_stages_per_worker(c.schedule) == 2)
      for (size_t r = 1; r < out.logs.size(); ++r) CHECK(out.logs[r].find("overlapped") != std::string::npos);
  }
}

TEST_CASE(
    "a checkpoint taken mid-run loads into one process's whole model, and into a job of one ZBV replica that trains "
    "on equal to one process") {
  char tmpl[] = "/tmp/corpc-ppckpt-XXXXXX";
  const std::string root = ::mkdtemp(tmpl);
  CHECK(latest_replica_checkpoint(root) == "");
  auto sc = with(Schedule::OneFOneB, {4, 4});
  sc.steps = 4;
  sc.save_at = 2;
  sc.save_root = root;
  const auto first = run_scenario(sc);
  const std::string dir = latest_replica_checkpoint(root);
  CHECK(dir == replica_checkpoint_dir(root, 2));
  CHECK(std::filesystem::exists(dir + "/stage-0-of-2.pt"));
  CHECK(std::filesystem::exists(dir + "/stage-1-of-2.pt"));
  // The whole model from the stage files, against one process replaying steps 0 and 1 (in a rank of its own: this
  // process forks ranks).
  launch_processes(
      1,
      [&](int) {
        auto model = make_model();
        for (auto& p : model->parameters()) p.detach().zero_();
        EXPECT_EQ(load_replica_checkpoint(model, dir), 2);
        auto reference = make_model();
        torch::optim::SGD opt(reference->parameters(), torch::optim::SGDOptions(kLr).momentum(0.9));
        for (int64_t step = 0; step < 2; ++step) {
          opt.zero_grad();
          for (int r : first.steps.at(step).replicas) {
            auto [x, y] = batch(step, r);
            (mse(reference->forward(x), y) / static_cast<double>(first.steps.at(step).replicas.size())).backward();
          }
          opt.step();
        }
        const auto mine = model->parameters(), theirs = reference->parameters();
        EXPECT_EQ(mine.size(), theirs.size());
        for (size_t i = 0; i < mine.size(); ++i) EXPECT(torch::allclose(mine[i], theirs[i], 1e-4, 1e-6));
        // A model of other shapes is refused, naming the layer, before anything is loaded.
        torch::nn::Sequential other;  // make_model's layers, the first one wider
        other->push_back(torch::nn::Linear(8, kWidth + 1));
        for (int i = 1; i < kLayers - 1; ++i) {
          if (i % 2 == 1) other->push_back(torch::nn::Tanh());
          else other->push_back(torch::nn::Linear(kWidth, kWidth));
        }
        other->push_back(torch::nn::Linear(kWidth, 1));
        const auto before = other->parameters()[2].clone();
        EXPECT_THROWS_AS(load_replica_checkpoint(other, dir), UsageError);
        EXPECT(torch::equal(other->parameters()[2], before));
        EXPECT_THROWS_AS(load_replica_checkpoint(make_model(), root), UsageError);  // not a step directory
        // A file that is no archive at all, under a stage file's name: UsageError naming it, not libtorch's error.
        const std::string garbage = root + "/step-9";
        std::filesystem::create_directories(garbage);
        std::ofstream(garbage + "/stage-0-of-1.pt") << "not a checkpoint";
        EXPECT_THROWS_AS(load_replica_checkpoint(make_model(), garbage), UsageError);
      },
      launch_options(60s));
  // One replica, ZBV (both stages on one worker), from the checkpoint: steps 2 and 3, equal to one process replaying
  // the first job's steps 0 and 1 and then these; the momentum too, so the optimizer state was loaded.
  auto resumed = with(Schedule::ZBVZeroBubble, {4, 4});
  resumed.options.replicas = 1;
  resumed.steps = 4;
  resumed.load_from = dir;
  resumed.history = {{0, first.steps.at(0)}, {1, first.steps.at(1)}};
  const auto out = run_scenario(resumed);
  CHECK(out.steps.size() == 2);
  // Into a job whose optimizer is another kind (Adam): UsageError naming the stage, and every stage as it was.
  launch_processes(
      2,
      [&](int rank) {
        init_rpc(worker_name(rank), rank, 2, quick_options());
        if (rank == 1) {
          auto o = resumed.options;
          o.fault_tolerant = false;
          PipelineReplicas pp(make_model(), &mse, &make_adam, o);
          std::vector<at::Tensor> was;
          for (const auto& st : pp.stages())
            for (const auto& t : st.layers->parameters()) was.push_back(t.detach().clone());
          EXPECT_THROWS_AS(pp.load_checkpoint(dir), UsageError);
          size_t k = 0;
          for (const auto& st : pp.stages())
            for (const auto& t : st.layers->parameters()) EXPECT(torch::equal(t, was.at(k++)));
          EXPECT_EQ(pp.committed_steps(), 0);
        }
        shutdown(true);
      },
      launch_options(60s));
  std::filesystem::remove_all(root);
}

TEST_CASE("pipeline replicas without fault tolerance (fixed groups, no quorum) train the same") {
  auto sc = with(Schedule::OneFOneB, {4, 4});
  sc.options.fault_tolerant = false;
  auto out = run_scenario(sc);
  CHECK(out.steps.size() == 6);
}

TEST_CASE("a stage worker SIGKILLed after a forward: the other replica retries the step alone, the replica rejoins") {
  auto sc = with(Schedule::OneFOneB, {4, 4});
  sc.steps = 8;
  // Rank 4: replica 1's last stage, after its first forward of step 3.
  sc.after_action = [](int rank, int incarnation, int64_t step, const Action& a) {
    if (rank == 4 && incarnation == 0 && step == 3 && a.kind == ActionKind::Forward) ::raise(SIGKILL);
  };
  sc.gates = {{6, 4}};
  auto out = run_scenario(sc);
  CHECK(all_replicas(out.steps.at(2)));
  // Step 3 ran again (with replica 0 alone, or with the replacement too if it was back that soon).
  CHECK(out.logged(1, 3, "retried"));
  CHECK(out.logged(3, 3, "retried"));
  // Replica 0's reason names the step, the cause and the worker: the lost one, or a worker whose averaging the loss
  // cut before the coordinator saw the connection close.
  for (int r : {1, 3}) CHECK_EQ(survivor_reason_problem(out.retries[r], 3, "worker 'worker4' (rank 4)"), "");
  CHECK(out.logs[4].find("recovered") != std::string::npos);
  // Its live mate missed steps too when replica 0 ran step 3 alone (the replacement may be back for the retry).
  if (out.steps.at(3).replicas == std::vector<int>{0}) CHECK(out.logs[2].find("recovered") != std::string::npos);
  CHECK(all_replicas(out.steps.rbegin()->second));
}

TEST_CASE("a stage worker SIGKILLed during the gradient averaging: nobody applies that step, then it is retried") {
  auto sc = with(Schedule::OneFOneB, {4, 4});
  sc.steps = 8;
  // Rank 2: replica 1's first stage, right after its last backward started the stage's averaging.
  sc.after_action = [](int rank, int incarnation, int64_t step, const Action& a) {
    if (rank == 2 && incarnation == 0 && step == 4 && a.kind == ActionKind::Backward && a.micro == 3) ::raise(SIGKILL);
  };
  sc.gates = {{7, 2}};
  auto out = run_scenario(sc);
  CHECK(all_replicas(out.steps.at(3)));
  CHECK(out.logged(1, 4, "retried"));
  CHECK(out.logs[2].find("recovered") != std::string::npos);
  CHECK(all_replicas(out.steps.rbegin()->second));
}

TEST_CASE("a stage worker stopped past the join timeout: its replica is left out, then recovers and rejoins") {
  auto sc = with(Schedule::OneFOneB, {4, 4});
  sc.steps = 10;
  // Rank 1 (replica 0) stops rank 4 (replica 1's last stage) during step 3, and lets it go at step 6.
  static pid_t stopped = 0;
  sc.after_action = [](int rank, int, int64_t step, const Action& a) {
    if (rank != 1 || a.kind != ActionKind::Forward || a.micro != 0) return;
    if (step == 3 && stopped == 0) {
      stopped = rpc_sync<&pid_of>(4);
      ::kill(stopped, SIGSTOP);
      wait_until_stopped(stopped);
    }
    if (step == 6 && stopped > 0) {
      ::kill(stopped, SIGCONT);
      stopped = -1;
    }
  };
  sc.gates = {{8, 4}};
  auto out = run_scenario(sc);
  CHECK(out.steps.at(4).replicas == std::vector<int>{0});
  CHECK(out.steps.at(5).replicas == std::vector<int>{0});
  CHECK(out.logs[4].find("recovered") != std::string::npos);  // told it was behind: it loaded replica 0's stage
  CHECK(all_replicas(out.steps.rbegin()->second));
}

TEST_CASE("two workers of one replica lost in the same step: both restarted workers recover their own stages") {
  auto sc = with(Schedule::OneFOneB, {4, 4});
  sc.steps = 8;
  sc.after_action = [](int rank, int incarnation, int64_t step, const Action& a) {
    if ((rank == 2 || rank == 4) && incarnation == 0 && step == 3 && a.kind == ActionKind::Forward && a.micro == 1)
      ::raise(SIGKILL);
  };
  sc.gates = {{6, 2}, {6, 4}};
  auto out = run_scenario(sc);
  CHECK(out.logged(1, 3, "retried"));
  CHECK(out.logs[2].find("recovered") != std::string::npos);
  CHECK(out.logs[4].find("recovered") != std::string::npos);
  CHECK(all_replicas(out.steps.rbegin()->second));
}

TEST_CASE("a worker of each replica lost in different steps: each replica recovers from the other") {
  auto sc = with(Schedule::OneFOneB, {4, 4});
  sc.steps = 12;
  // Replica 1's last stage at step 2; replica 0's first stage at step 8, or the first step after it that follows a
  // step of both replicas (a replica recovers only from a live one).
  sc.after_action = [](int rank, int incarnation, int64_t step, const Action& a) {
    if (incarnation != 0 || a.kind != ActionKind::Forward || a.micro != 1) return;
    if (rank == 4 && step == 2) ::raise(SIGKILL);
    if (rank == 1 && step >= 8 && g_last_replicas == std::vector<int>{0, 1}) ::raise(SIGKILL);
  };
  sc.gates = {{6, 4}, {10, 1}};
  auto out = run_scenario(sc);
  CHECK(out.logged(1, 2, "retried"));
  CHECK(out.logs[4].find("recovered") != std::string::npos);  // from rank 3, replica 0's last stage
  CHECK(out.logs[1].find("recovered") != std::string::npos);  // from rank 2, replica 1's first stage
  CHECK(all_replicas(out.steps.rbegin()->second));
}

TEST_CASE("interleaved replicas: a worker SIGKILLed between its commit and the next step's forward") {
  // The vote that committed step 2 answered the quorum of step 3 too: the others start it in the same epoch and find
  // the worker gone there.
  auto sc = with(Schedule::Interleaved1F1B, {2, 2, 2, 2});
  sc.steps = 8;
  sc.after_step = [](int rank, int incarnation, int64_t committed) {
    if (rank == 3 && incarnation == 0 && committed == 3) ::raise(SIGKILL);
  };
  sc.gates = {{6, 3}};
  auto out = run_scenario(sc);
  CHECK(all_replicas(out.steps.at(2)));
  CHECK(out.logged(2, 3, "retried"));
  CHECK(out.logged(4, 3, "retried"));
  CHECK(out.logs[3].find("recovered") != std::string::npos);
  CHECK(all_replicas(out.steps.rbegin()->second));
}

TEST_CASE("ZBV replicas (one worker each): a lost worker's replica rejoins, equal to one process") {
  auto sc = with(Schedule::ZBVZeroBubble, {4, 4});
  sc.steps = 8;
  sc.after_action = [](int rank, int incarnation, int64_t step, const Action& a) {
    if (rank == 2 && incarnation == 0 && step == 3 && a.kind == ActionKind::Forward && a.stage == 1) ::raise(SIGKILL);
  };
  sc.gates = {{6, 2}};
  auto out = run_scenario(sc);
  CHECK(out.logged(1, 3, "retried"));
  CHECK(out.logs[2].find("recovered") != std::string::npos);
  CHECK(all_replicas(out.steps.rbegin()->second));
}

TEST_CASE("pipeline replicas under a coordinator made without replica_groups are refused as they are made") {
  // As the fault-tolerant DDP example makes its coordinator. Such a job trains until a worker is lost, then cannot
  // recover: each worker's constructor asks the coordinator, so that it never takes a step.
  char tmpl[] = "/tmp/corpc-pp-XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);
  const Scenario sc = with(Schedule::OneFOneB, {4, 4});
  const ReplicaLayout layout = layout_of(sc.options);
  const int world = 1 + layout.world();
  launch_processes(
      world,
      [&](int rank) {
        init_rpc(worker_name(rank), rank, world, sc.rpc);
        if (rank == 0) {
          QuorumCoordinator coordinator(sc.quorum);
          shutdown(true);
          return;
        }
        try {
          PipelineReplicas pp(make_model(), &mse, &make_sgd, sc.options);
          std::ofstream(file_in(dir, "error", rank)) << "was made";
        } catch (const UsageError& e) {
          std::ofstream(file_in(dir, "error", rank)) << e.what();
        }
        shutdown(true);
      },
      launch_options(120s));
  for (int r = 1; r < world; ++r) {
    const auto what = read_file(file_in(dir, "error", r));
    INFO("worker " << r << ": " << what);
    CHECK(what.find("the QuorumCoordinator on worker 'master' (rank 0) was made without replica_groups, but worker '" +
                    worker_name(r) + "' (rank " + std::to_string(r) + ") trains in 2 replica(s) of 2 worker(s)") !=
          std::string::npos);
    CHECK(what.find("QuorumCoordinator({.replica_groups = layout.replica_groups()})") != std::string::npos);
  }
  std::filesystem::remove_all(dir);
}

}  // namespace test_pipeline_replicas
