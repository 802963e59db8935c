// DistributedDataParallel against one process training on the whole batch, in real worker processes (Gloo over
// 127.0.0.1, FileStore rendezvous from launch_processes' environment).
//
// Tolerance: DDP's gradient is (g_0 + g_1) / 2 of the two half-batch mean losses, the reference is the gradient of
// the full-batch mean loss; both are the same sum of float32 terms in a different order, so they differ by a few
// ulps per step (~1e-7 relative). After a few SGD steps on O(1) values, 1e-5 absolute + 1e-5 relative is loose
// enough for reordering and tight enough that any missing, doubled or stale gradient (errors of order lr * grad,
// ~1e-2) fails. The fp16 hook rounds each gradient to 11 significant bits (~5e-4 relative): 5e-3 there.
#include <corpc/autograd/dist_autograd.hpp>
#include <corpc/autograd/optimizer.hpp>
#include <corpc/ddp/checkpoint.hpp>
#include <corpc/ddp/ddp.hpp>
#include <corpc/ddp/elastic.hpp>
#include <corpc/ddp/rpc_store.hpp>
#include <doctest/doctest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "support.hpp"

namespace test_ddp {  // this file's names, apart from the files it shares an executable with

namespace {

using corpc::ddp::DistributedDataParallel;

constexpr int kWorld = 2;
constexpr int64_t kBatch = 8;

// A model with an unused parameter: DDP must still complete every bucket (and not hang).
struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(5, 7));
    fc2 = register_module("fc2", torch::nn::Linear(7, 3));
    unused = register_module("unused", torch::nn::Linear(3, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2->forward(torch::tanh(fc1->forward(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, unused{nullptr};
};
TORCH_MODULE(Net);

struct Data {
  torch::Tensor x, y;
};

Data batch(int step) {
  torch::manual_seed(1000 + step);
  auto x = torch::randn({kBatch, 5});
  return {x, torch::randn({kBatch, 3})};
}

torch::Tensor rows(const torch::Tensor& t, int rank) {
  const int64_t n = t.size(0) / kWorld;
  return t.narrow(0, rank * n, n);
}

Net rank_model(int rank) {
  torch::manual_seed(rank + 1);  // every rank different; DDP must adopt rank 0's (seed 1)
  return Net();
}

// The model this process trains, for the RPC beside DDP.
Net* g_trained = nullptr;
double first_parameter_sum() { return (*g_trained)->parameters()[0].sum().item<double>(); }

void expect_close(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want, double tol) {
  EXPECT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = (got[i] - want[i]).abs().max().item<double>();
    if (!torch::allclose(got[i], want[i], tol, tol)) {
      throw std::runtime_error("parameter " + std::to_string(i) + " differs by " + std::to_string(err));
    }
  }
}

void expect_same_on_all_ranks(c10d::ProcessGroup& group, const std::vector<torch::Tensor>& params) {
  for (const auto& p : params) {
    std::vector<at::Tensor> zero{p.detach().clone()};
    group.broadcast(zero)->wait();
    EXPECT(torch::equal(zero[0], p.detach()));
  }
}

std::vector<torch::Tensor> snapshot(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (auto& p : m.parameters()) out.push_back(p.detach().clone());
  return out;
}

void launch(const std::function<void(int)>& body) {
  const corpc::LaunchOptions o = corpc::test::launch_options(std::chrono::seconds(120));
  corpc::launch_processes(kWorld, body, o);
}

// Trains `steps` SGD steps with DDP (each rank on its rows) and the reference (one process, whole batch), and
// compares the parameters. `micro` > 1: gradient accumulation over micro-batches with no_sync on all but the last.
void ddp_matches_reference(corpc::ddp::DdpOptions options, int steps, int micro, double tol, size_t min_buckets = 1,
                           bool expect_overlap = true) {
  launch([=](int rank) {
    auto group = corpc::ddp::init_process_group();
    EXPECT_EQ(group->getRank(), rank);
    DistributedDataParallel ddp(rank_model(rank), group, options);
    torch::optim::SGD opt(ddp->parameters(), 0.1);

    Net reference = rank_model(0);
    torch::optim::SGD ref_opt(reference->parameters(), 0.1);

    for (int step = 0; step < steps; ++step) {
      opt.zero_grad();
      ref_opt.zero_grad();
      for (int m = 0; m < micro; ++m) {
        auto d = batch(step * micro + m);
        auto local = [&] { torch::mse_loss(ddp.forward(rows(d.x, rank)), rows(d.y, rank)).backward(); };
        if (m + 1 < micro) {
          auto guard = ddp.no_sync();
          local();
        } else {
          local();
        }
        torch::mse_loss(reference->forward(d.x), d.y).backward();
      }
      opt.step();
      ref_opt.step();
      auto& sync = ddp.gradient_sync();
      EXPECT(sync.bucket_count() >= min_buckets);
      // With several buckets, the ones holding the last layers' gradients start before backward ends.
      if (expect_overlap && sync.bucket_count() > 1) EXPECT(sync.buckets_launched_during_last_backward() >= 1);
    }
    auto params = snapshot(*ddp.module());
    expect_close(params, snapshot(*reference), tol);
    expect_same_on_all_ranks(*group, params);
    // The unused layer got no gradient anywhere and so never moved from rank 0's initial weights.
    EXPECT(torch::equal(ddp.module()->unused->weight, reference->unused->weight));
  });
}

}  // namespace

TEST_CASE("ddp: parameters equal one process on the whole batch (several small buckets)") {
  corpc::ddp::DdpOptions o;
  o.bucket_cap_mb = 16.0 / (1024 * 1024);  // 16 bytes: one or two parameters per bucket, 4 buckets
  o.find_unused_parameters = true;         // else the unused layer's bucket (the first) holds back the others
  ddp_matches_reference(o, 4, 1, 1e-5, 4);
}

TEST_CASE("ddp: without find_unused_parameters an unused parameter still neither hangs nor skews") {
  corpc::ddp::DdpOptions o;
  o.bucket_cap_mb = 16.0 / (1024 * 1024);
  ddp_matches_reference(o, 2, 1, 1e-5, 4, /*expect_overlap=*/false);
}

TEST_CASE("ddp: parameters equal one process with one bucket") { ddp_matches_reference({}, 4, 1, 1e-5); }

TEST_CASE("ddp: no_sync accumulates exactly like the whole batch") {
  corpc::ddp::DdpOptions o;
  o.bucket_cap_mb = 16.0 / (1024 * 1024);
  o.find_unused_parameters = true;
  ddp_matches_reference(o, 2, 3, 1e-5);
}

TEST_CASE("ddp: allreduce_hook() as an explicit hook (divides after the sum) equals one process too") {
  corpc::ddp::DdpOptions o;
  o.comm_hook = corpc::ddp::allreduce_hook();
  o.bucket_cap_mb = 16.0 / (1024 * 1024);
  o.find_unused_parameters = true;
  ddp_matches_reference(o, 2, 1, 1e-5, 4);
}

TEST_CASE("ddp: fp16 compression hook stays within its tolerance") {
  corpc::ddp::DdpOptions o;
  o.comm_hook = corpc::ddp::fp16_compress_hook();
  ddp_matches_reference(o, 3, 1, 5e-3);
}

// A dead rank's closed connections fail the collective at once; the timeout is only the bound in case they do not,
// long enough that a rank slowed by a busy machine is never taken for a dead one.
TEST_CASE("ddp: a dead rank makes the others' backward fail with DDP's error instead of hanging") {
  std::vector<corpc::RankFailure> failures;
  try {
    launch([](int rank) {
      corpc::ddp::ProcessGroupOptions po;
      po.timeout = std::chrono::seconds(60) * corpc::test::time_scale();
      auto group = corpc::ddp::init_process_group(po);
      DistributedDataParallel ddp(rank_model(rank), group);
      if (rank == 1) std::_Exit(3);  // dies before the first backward
      auto d = batch(0);
      torch::mse_loss(ddp.forward(rows(d.x, rank)), rows(d.y, rank)).backward();
    });
  } catch (const corpc::LaunchError& e) {
    failures = e.failures();
  }
  REQUIRE(failures.size() == 2);
  std::string rank0;
  for (auto& f : failures) {
    if (f.rank == 0) rank0 = f.reason;
  }
  // Rank 0 failed by itself, with DDP's error, rather than being killed by the launcher's grace period.
  INFO(rank0);
  REQUIRE(rank0.find("DDP: gradient allreduce") != std::string::npos);
  // It names where it failed as the rank that saw the failure, not as a rank that failed.
  CHECK(rank0.find("failed here, on rank 0 of the process group") != std::string::npos);
}

// Uneven inputs: rank 0 has 2 batches, rank 1 has 4. Under Join rank 0 shadows rank 1's last two steps; the
// result is one process on the batches actually run: steps 0-1 on the whole batch, steps 2-3 on rank 1's rows,
// whose gradient is divided by the ranks still training (1) or, PyTorch's default, by the world size (2).
void join_matches_reference(bool divide_by_initial_world_size) {
  launch([=](int rank) {
    auto group = corpc::ddp::init_process_group();
    corpc::ddp::DdpOptions o;
    o.bucket_cap_mb = 16.0 / (1024 * 1024);  // several buckets: each is shadowed in order
    DistributedDataParallel ddp(rank_model(rank), group, o);
    torch::optim::SGD opt(ddp->parameters(), 0.1);
    const int my_batches = rank == 0 ? 2 : 4;
    corpc::ddp::JoinOptions jo;
    jo.divide_by_initial_world_size = divide_by_initial_world_size;
    auto join = ddp.join(jo);
    for (int step = 0; step < my_batches; ++step) {
      opt.zero_grad();
      auto d = batch(step);
      torch::mse_loss(ddp.forward(rows(d.x, rank)), rows(d.y, rank)).backward();
      opt.step();
    }
    join.finish();

    Net reference = rank_model(0);
    torch::optim::SGD ref_opt(reference->parameters(), 0.1);
    for (int step = 0; step < 4; ++step) {
      ref_opt.zero_grad();
      auto d = batch(step);
      if (step < 2) {
        torch::mse_loss(reference->forward(d.x), d.y).backward();
      } else {
        const double scale = divide_by_initial_world_size ? 0.5 : 1.0;
        (scale * torch::mse_loss(reference->forward(rows(d.x, 1)), rows(d.y, 1))).backward();
      }
      ref_opt.step();
    }
    auto params = snapshot(*ddp.module());
    expect_close(params, snapshot(*reference), 1e-5);
    expect_same_on_all_ranks(*group, params);
    // After the join, ordinary synchronised steps work again (collectives still line up).
    opt.zero_grad();
    auto d = batch(9);
    torch::mse_loss(ddp.forward(rows(d.x, rank)), rows(d.y, rank)).backward();
    opt.step();
    expect_same_on_all_ranks(*group, snapshot(*ddp.module()));
  });
}

TEST_CASE("ddp: join with uneven inputs finishes and equals one process on the batches run (divide by active ranks)") {
  join_matches_reference(false);
}

TEST_CASE("ddp: join with uneven inputs, PyTorch's default divisor (the initial world size)") {
  join_matches_reference(true);
}

TEST_CASE("ddp: gradient_as_bucket_view gives the same parameters, with gradients living in the buckets") {
  launch([](int rank) {
    auto group = corpc::ddp::init_process_group();
    std::vector<std::vector<torch::Tensor>> results;
    for (bool as_view : {false, true}) {
      corpc::ddp::DdpOptions o;
      o.gradient_as_bucket_view = as_view;
      o.find_unused_parameters = true;
      DistributedDataParallel ddp(rank_model(rank), group, o);
      torch::optim::SGD opt(ddp->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      for (int step = 0; step < 3; ++step) {
        opt.zero_grad();
        for (int m = 0; m < 2; ++m) {  // gradient accumulation: no_sync, then a synchronised backward
          auto d = batch(step * 2 + m);
          auto local = [&] { torch::mse_loss(ddp.forward(rows(d.x, rank)), rows(d.y, rank)).backward(); };
          if (m == 0) {
            auto guard = ddp.no_sync();
            local();
          } else {
            local();
          }
        }
        // One bucket here (a few hundred bytes): with views every gradient is a slice of the same buffer.
        auto fc1 = ddp->fc1->weight.grad(), fc2 = ddp->fc2->bias.grad();
        EXPECT_EQ(fc1.is_alias_of(fc2), as_view);
        opt.step();
      }
      results.push_back(snapshot(*ddp.module()));
    }
    for (size_t i = 0; i < results[0].size(); ++i) EXPECT(torch::equal(results[0][i], results[1][i]));
  });
}

// A model with buffers of two dtypes: BatchNorm's running_mean/var (float) and num_batches_tracked (int64).
struct BnNetImpl : torch::nn::Module {
  BnNetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(5, 6));
    bn = register_module("bn", torch::nn::BatchNorm1d(6));
    fc2 = register_module("fc2", torch::nn::Linear(6, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2->forward(torch::tanh(bn->forward(fc1->forward(x)))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(BnNet);

// Every rank's buffers differ from the start; num_batches_tracked is above 2^24, where a float32 cannot hold it
// exactly, so a broadcast that coalesced it with the float buffers (one flat float tensor) would change it.
BnNet bn_rank_model(int rank) {
  torch::manual_seed(rank + 1);
  BnNet net;
  torch::NoGradGuard no_grad;
  net->bn->running_mean.fill_(0.5 + rank);
  net->bn->running_var.fill_(2.0 + rank);
  net->bn->num_batches_tracked.fill_((int64_t{1} << 40) + 1 + 7 * rank);
  return net;
}

std::vector<torch::Tensor> buffer_snapshot(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (auto& b : m.buffers()) out.push_back(b.detach().clone());
  return out;
}

// PyTorch's broadcast_buffers semantics: before each forward every rank takes rank 0's buffers; in training mode
// each rank's forward then updates them from its own rows (BatchNorm normalises by the local batch). The reference
// is one process doing what rank 0 does to the buffers, with the gradient of the mean of the two half-batch losses.
TEST_CASE("ddp: buffers (BatchNorm, two dtypes) are rank 0's after construction and before each forward") {
  launch([](int rank) {
    auto group = corpc::ddp::init_process_group();
    DistributedDataParallel ddp(bn_rank_model(rank), group);
    auto start = buffer_snapshot(*ddp.module());
    REQUIRE(start.size() == 3);
    expect_same_on_all_ranks(*group, start);
    const auto rank0 = buffer_snapshot(*bn_rank_model(0));
    for (size_t i = 0; i < start.size(); ++i) EXPECT(torch::equal(start[i], rank0[i]));
    EXPECT_EQ(start[2].scalar_type(), torch::kLong);

    torch::optim::SGD opt(ddp->parameters(), 0.1);
    BnNet reference = bn_rank_model(0);
    torch::optim::SGD ref_opt(reference->parameters(), 0.1);
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      ref_opt.zero_grad();
      auto d = batch(step);
      torch::mse_loss(ddp.forward(rows(d.x, rank)), rows(d.y, rank)).backward();
      opt.step();
      // The reference's buffers end as rank 0's forward leaves them: rank 1's half runs first, then they are
      // restored (after its backward: BatchNorm's backward checks that its saved statistics were not modified).
      auto before = buffer_snapshot(*reference);
      (0.5 * torch::mse_loss(reference->forward(rows(d.x, 1)), rows(d.y, 1))).backward();
      {
        torch::NoGradGuard no_grad;
        auto buffers = reference->buffers();
        for (size_t i = 0; i < buffers.size(); ++i) buffers[i].copy_(before[i]);
      }
      (0.5 * torch::mse_loss(reference->forward(rows(d.x, 0)), rows(d.y, 0))).backward();
      ref_opt.step();
    }
    expect_close(snapshot(*ddp.module()), snapshot(*reference), 1e-5);
    if (rank == 0) expect_close(buffer_snapshot(*ddp.module()), buffer_snapshot(*reference), 1e-5);

    // An evaluation forward (no buffer update) takes rank 0's buffers: then every rank holds the reference's.
    ddp->eval();
    {
      torch::NoGradGuard no_grad;
      ddp.forward(rows(batch(9).x, rank));
    }
    auto after = buffer_snapshot(*ddp.module());
    expect_same_on_all_ranks(*group, after);
    expect_close(after, buffer_snapshot(*reference), 1e-5);
    EXPECT(torch::equal(after[2], reference->bn->num_batches_tracked));
    EXPECT_EQ(after[2].item<int64_t>(), (int64_t{1} << 40) + 1 + 3);
  });
}

TEST_CASE("ddp: RpcStore implements c10d's store over RPC; wait and get answer when another rank sets the key") {
  corpc::test::run_world(2, [](int rank) {
    corpc::ddp::RpcStore store(0, std::chrono::seconds(20));
    auto bytes = [](const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); };
    if (rank == 1) {
      store.wait({"from0"});  // held on rank 0 as a promise until rank 0 sets it
      EXPECT(store.get("from0") == bytes("hello"));
      EXPECT(store.check({"from0"}));
      EXPECT(!store.check({"from0", "nothing"}));
      EXPECT_EQ(store.add("counter", 2), 5);
      store.set("from1", bytes("done"));
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));  // rank 1 is (most likely) waiting by now
      EXPECT_EQ(store.add("counter", 3), 3);
      store.set("from0", bytes("hello"));
      EXPECT(store.get("from1") == bytes("done"));  // get on a missing key waits for it
      EXPECT_EQ(store.add("counter", 0), 5);
      EXPECT(store.compareSet("cas", bytes("x"), bytes("y")) == bytes("x"));  // missing, expected not empty
      EXPECT(store.compareSet("cas", {}, bytes("a")) == bytes("a"));
      EXPECT(store.compareSet("cas", bytes("b"), bytes("c")) == bytes("a"));  // mismatch: unchanged
      EXPECT(store.compareSet("cas", bytes("a"), bytes("c")) == bytes("c"));
      EXPECT_EQ(store.getNumKeys(), 4);
      EXPECT(store.deleteKey("cas"));
      EXPECT(!store.deleteKey("cas"));
      EXPECT_EQ(store.getNumKeys(), 3);
      EXPECT_THROWS_AS(store.wait({"never"}, std::chrono::milliseconds(100)), corpc::TimeoutError);
    }
  });
}

TEST_CASE("ddp: RPC and DDP in one program share one rendezvous (the process group's store is on RPC's rank 0)") {
  corpc::test::run_world(kWorld, [](int rank) {
    auto group = corpc::ddp::init_process_group();
    EXPECT_EQ(group->getRank(), rank);
    EXPECT(corpc::ddp::RpcStore().getNumKeys() > 0);  // Gloo's rendezvous keys went through RPC
    DistributedDataParallel ddp(rank_model(rank), group);
    torch::optim::SGD opt(ddp->parameters(), 0.1);
    Net reference = rank_model(0);
    torch::optim::SGD ref_opt(reference->parameters(), 0.1);
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      ref_opt.zero_grad();
      auto d = batch(step);
      torch::mse_loss(ddp.forward(rows(d.x, rank)), rows(d.y, rank)).backward();
      torch::mse_loss(reference->forward(d.x), d.y).backward();
      opt.step();
      ref_opt.step();
    }
    expect_close(snapshot(*ddp.module()), snapshot(*reference), 1e-5);
    // And RPC keeps working beside it: each rank asks the other for its first parameter.
    g_trained = &ddp.module();
    group->barrier()->wait();  // both ranks have published their module before either asks for the other's
    const auto theirs = corpc::rpc_sync<&first_parameter_sum>(1 - rank);
    EXPECT_EQ(theirs, ddp->parameters()[0].sum().item<double>());
    group->barrier()->wait();  // the other rank's RPC to us is answered before we shut down
  });
}

TEST_CASE("ddp: the process group takes Slurm's rank and size (SLURM_PROCID, SLURM_NTASKS)") {
  launch([](int rank) {
    ::unsetenv("RANK");
    ::unsetenv("WORLD_SIZE");
    ::setenv("SLURM_PROCID", std::to_string(rank).c_str(), 1);
    ::setenv("SLURM_NTASKS", std::to_string(kWorld).c_str(), 1);
    auto group = corpc::ddp::init_process_group();
    EXPECT_EQ(group->getRank(), rank);
    EXPECT_EQ(group->getSize(), kWorld);
    std::vector<at::Tensor> one{torch::ones({1})};
    group->allreduce(one)->wait();
    EXPECT_EQ(one[0].item<float>(), static_cast<float>(kWorld));
  });
}

// The remote part of the hybrid test: a fixed layer on worker 2 (no parameters of its own, so that the two trainers'
// steps cannot interleave on it and the dense result stays deterministic). Gradients flow through it back to the
// trainers by distributed autograd.
at::Tensor remote_part_weight() {
  torch::manual_seed(77);
  return torch::randn({7, 3});
}
at::Tensor remote_part(at::Tensor h) {
  static const at::Tensor w = remote_part_weight();
  return torch::tanh(h.matmul(w));
}

// DDP inside a distributed autograd context (the DDP + RPC hybrid): two trainers, each with a DDP-wrapped dense part
// whose output goes through worker 2; backward runs through dist_autograd, so gradients are captured into the
// context rather than .grad; DDP must average them there, and DistributedOptimizer steps from the context.
TEST_CASE(
    "ddp: inside a distributed autograd context, trainers' dense parameters equal one process on the whole batch") {
  corpc::test::run_world(3, [](int rank) {
    if (rank == 2) return;  // the remote part only answers RPCs
    corpc::ddp::ProcessGroupOptions po;
    po.world_size = 2;  // the trainers, RPC ranks 0 and 1
    auto group = corpc::ddp::init_process_group(po);
    torch::manual_seed(rank + 1);
    DistributedDataParallel ddp(torch::nn::Linear(5, 7), group);
    std::vector<corpc::RRef<at::Tensor>> params;
    for (auto& p : ddp->parameters()) params.emplace_back(p);
    corpc::DistributedOptimizer<torch::optim::SGD> opt(params, torch::optim::SGDOptions(0.1));

    torch::manual_seed(1);
    torch::nn::Linear reference(5, 7);
    torch::optim::SGD ref_opt(reference->parameters(), 0.1);
    for (int step = 0; step < 3; ++step) {
      auto d = batch(step);
      {
        corpc::dist_autograd::Context ctx;
        auto out = corpc::rpc_sync<&remote_part>(2, ddp.forward(rows(d.x, rank)));
        ctx.backward({torch::mse_loss(out, rows(d.y, rank))}).wait();
        for (auto& p : ddp->parameters()) EXPECT(!p.grad().defined());  // in the context only
        opt.step(ctx).wait();
      }
      ref_opt.zero_grad();
      torch::mse_loss(remote_part(reference->forward(d.x)), d.y).backward();
      ref_opt.step();
    }
    expect_close(snapshot(*ddp.module()), snapshot(*reference), 1e-5);
    expect_same_on_all_ranks(*group, snapshot(*ddp.module()));
  });
}

// The DDP notes' ToyMpModel: one module split over two devices inside each process (both CPU here; the code
// path is the device-aware one: the input moves between the halves, buckets never mix devices).
struct ToyMpModelImpl : torch::nn::Module {
  ToyMpModelImpl(torch::Device dev0, torch::Device dev1) : dev0(dev0), dev1(dev1) {
    net1 = register_module("net1", torch::nn::Linear(10, 10));
    net2 = register_module("net2", torch::nn::Linear(10, 5));
    net1->to(dev0);
    net2->to(dev1);
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(net1->forward(x.to(dev0)));
    return net2->forward(x.to(dev1));
  }
  torch::Device dev0, dev1;
  torch::nn::Linear net1{nullptr}, net2{nullptr};
};
TORCH_MODULE(ToyMpModel);

TEST_CASE("ddp: model-parallel DDP (ToyMpModel over two devices) equals the unwrapped model in one process") {
  launch([](int rank) {
    auto group = corpc::ddp::init_process_group();
    const torch::Device d0(torch::kCPU), d1(torch::kCPU);
    torch::manual_seed(rank + 7);
    DistributedDataParallel ddp(ToyMpModel(d0, d1), group);
    torch::manual_seed(7);
    ToyMpModel reference(d0, d1);
    torch::optim::SGD opt(ddp->parameters(), 0.1), ref_opt(reference->parameters(), 0.1);
    for (int step = 0; step < 3; ++step) {
      torch::manual_seed(50 + step);
      auto x = torch::randn({kBatch, 10});
      auto y = torch::randn({kBatch, 5});
      opt.zero_grad();
      ref_opt.zero_grad();
      torch::mse_loss(ddp.forward(rows(x, rank)), rows(y, rank).to(d1)).backward();
      torch::mse_loss(reference->forward(x), y.to(d1)).backward();
      opt.step();
      ref_opt.step();
    }
    expect_close(snapshot(*ddp.module()), snapshot(*reference), 1e-5);
    expect_same_on_all_ranks(*group, snapshot(*ddp.module()));
  });
}

TEST_CASE("ddp: checkpoint round-trip: rank 0 saves, all wait, all load rank 0's state") {
  const std::string path = "/tmp/corpc-test-ddp-ckpt-" + std::to_string(::getpid()) + ".pt";
  launch([&](int rank) {
    auto group = corpc::ddp::init_process_group();
    DistributedDataParallel ddp(rank_model(rank), group);
    torch::optim::SGD opt(ddp->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    for (int step = 0; step < 2; ++step) {
      opt.zero_grad();
      auto d = batch(step);
      torch::mse_loss(ddp.forward(rows(d.x, rank)), rows(d.y, rank)).backward();
      opt.step();
    }
    auto saved = snapshot(*ddp.module());
    if (rank == 1) {  // diverge: the reload must bring rank 0's weights back
      torch::NoGradGuard g;
      for (auto& p : ddp->parameters()) p.add_(1.0);
    }
    corpc::ddp::save_and_reload(*ddp.module(), &opt, path, *group, torch::Device(torch::kCPU));
    auto loaded = snapshot(*ddp.module());
    for (size_t i = 0; i < saved.size(); ++i) EXPECT(torch::equal(saved[i], loaded[i]));
    group->barrier()->wait();
    if (rank == 0) std::remove(path.c_str());
  });
}

TEST_CASE("ddp: training a wrapped module after loading a checkpoint into it keeps ranks equal to the reference") {
  const std::string path = "/tmp/corpc-test-ddp-ckpt-train-" + std::to_string(::getpid()) + ".pt";
  launch([&](int rank) {
    auto group = corpc::ddp::init_process_group();
    DistributedDataParallel ddp(rank_model(rank), group);
    torch::optim::SGD opt(ddp->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    Net reference = rank_model(0);
    torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    auto step = [&](int s) {
      opt.zero_grad();
      ref_opt.zero_grad();
      auto d = batch(s);
      torch::mse_loss(ddp.forward(rows(d.x, rank)), rows(d.y, rank)).backward();
      torch::mse_loss(reference->forward(d.x), d.y).backward();
      opt.step();
      ref_opt.step();
    };
    step(0);
    step(1);
    corpc::ddp::save_and_reload(*ddp.module(), &opt, path, *group);
    // Loading replaced every parameter's gradient accumulator (InputArchive uses set_): DDP's hooks must follow.
    for (int s = 2; s < 5; ++s) step(s);
    auto params = snapshot(*ddp.module());
    expect_same_on_all_ranks(*group, params);
    expect_close(params, snapshot(*reference), 1e-5);
    group->barrier()->wait();
    if (rank == 0) std::remove(path.c_str());
  });
}

TEST_CASE("ddp: a rank dies mid-training, the group restarts and resumes from the checkpoint") {
  const std::string path = "/tmp/corpc-test-ddp-restart-" + std::to_string(::getpid()) + ".pt";
  const std::string done = path + ".done";
  std::remove(path.c_str());
  constexpr int kSteps = 6, kCheckpointEvery = 2, kDieAt = 3;
  const corpc::LaunchOptions lo = corpc::test::launch_options(std::chrono::seconds(120));
  const int restarts = corpc::ddp::launch_with_restarts(
      kWorld,
      [&](int rank, int restart) {
        corpc::ddp::ProcessGroupOptions po;
        po.timeout = std::chrono::seconds(60) * corpc::test::time_scale();  // as in the dead-rank case above
        auto group = corpc::ddp::init_process_group(po);
        // Resume as torchelastic programs do: load the checkpoint into the bare model, then wrap it.
        Net net = rank_model(rank);
        int start = 0;
        if (FILE* f = std::fopen(path.c_str(), "r")) {
          std::fclose(f);
          corpc::ddp::load_checkpoint(*net, nullptr, path);
          start = kDieAt - kDieAt % kCheckpointEvery;  // the step after the last checkpoint
        }
        DistributedDataParallel ddp(net, group);
        torch::optim::SGD opt(ddp->parameters(), 0.1);
        EXPECT_EQ(start > 0, restart > 0);
        for (int step = start; step < kSteps; ++step) {
          if (restart == 0 && rank == 1 && step == kDieAt) std::_Exit(9);
          opt.zero_grad();
          auto d = batch(step);
          torch::mse_loss(ddp.forward(rows(d.x, rank)), rows(d.y, rank)).backward();
          opt.step();
          if ((step + 1) % kCheckpointEvery == 0) corpc::ddp::save_checkpoint(*ddp.module(), nullptr, path, *group);
        }
        // Equal to an uninterrupted single-process run of all the steps.
        Net reference = rank_model(0);
        torch::optim::SGD ref_opt(reference->parameters(), 0.1);
        for (int step = 0; step < kSteps; ++step) {
          ref_opt.zero_grad();
          auto d = batch(step);
          torch::mse_loss(reference->forward(d.x), d.y).backward();
          ref_opt.step();
        }
        expect_close(snapshot(*ddp.module()), snapshot(*reference), 1e-5);
      },
      /*max_restarts=*/2, lo);
  std::remove(path.c_str());
  REQUIRE(restarts == 1);
}

namespace {
// The torchrun command docs/launching.md gives for every Debian line (tests/torchrun.sh runs it too): the c10d
// rendezvous on a FileStore of its own, and no TCP store shared by the agent. Every TCPStore torchrun makes itself
// asks for libuv on Debian's PyTorch 2.x, which is built without it (pytorch#148283): --standalone cannot start there.
// --redirects/--tee 1: Debian's torchrun 1.13 on Python 3.11 cannot parse their default "0" (an IntFlag change).
// Each run gets its own rendezvous file (one left by an earlier run holds that run's state), removed after it.
// 2.x's agent gives its ranks MASTER_ADDR=socket.getfqdn() unless --local_addr says otherwise: in the test roots this
// host's name does not resolve (1.13's torchrun has no --local_addr and gives localhost).
std::string under_torchrun(const std::string& command) {
  static const std::string local_addr =
      std::system("torchrun --help 2>&1 | grep -q -- --local.addr") == 0 ? "--local_addr 127.0.0.1 " : "";
  static int runs = 0;
  const std::string file = "/tmp/corpc-test-ddp-rdzv-" + std::to_string(::getpid()) + "-" + std::to_string(++runs);
  return "rm -f " + file + "; TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 timeout 120 torchrun --no_python --nnodes 1 " +
         "--nproc_per_node=2 --rdzv_backend c10d --rdzv_conf store_type=file --rdzv_endpoint " + file +
         " --rdzv_id corpc-test " + local_addr + "--redirects 1 --tee 1 " + command + "; s=$?; rm -f " + file +
         "; exit $s";
}

// Runs a shell command with its output kept: "" when it exits 0, else its status and the last lines it printed
// (torchrun's and the ranks'), for the failure message.
std::string run_and_explain(const std::string& command) {
  // Made by mkstemp (ours, mode 0600): a name another user of the host guessed and linked elsewhere is never written.
  char name[] = "/tmp/corpc-test-ddp-run-XXXXXX";
  const int fd = ::mkstemp(name);
  REQUIRE(fd >= 0);
  ::close(fd);
  const std::string log = name;
  const int status = std::system(("(" + command + ") > " + log + " 2>&1").c_str());
  std::string why;
  if (status != 0) {
    why = "`" + command + "` " +
          (WIFSIGNALED(status) ? "was killed by signal " + std::to_string(WTERMSIG(status))
                               : "exited with status " + std::to_string(WEXITSTATUS(status))) +
          "; its last lines:\n";
    std::ifstream in(log);
    std::deque<std::string> tail;
    for (std::string line; std::getline(in, line);) {
      tail.push_back(line);
      if (tail.size() > 40) tail.pop_front();
    }
    for (const auto& line : tail) why += line + "\n";
  }
  std::remove(log.c_str());
  return why;
}

// Whether torchrun is installed (Debian's python3-torch): where it is, the command above starts ranks on every line.
// Decided once, before the cases are registered, so that its cases are reported as skipped rather than passed.
const bool g_no_torchrun =
    !corpc::test::run_is_for("test_ddp.cpp") || std::system("command -v torchrun >/dev/null 2>&1") != 0;
}  // namespace

#ifdef CORPC_DDP_EXAMPLE
TEST_CASE("ddp: the example runs under torchrun --no_python" * doctest::skip(g_no_torchrun)) {
  CHECK(run_and_explain(under_torchrun(std::string(CORPC_DDP_EXAMPLE) + " 5")) == "");
}
#endif

#ifdef CORPC_EXAMPLES_DIR
namespace {
const char* const kNotesPrograms[] = {"ddp_basic", "ddp_checkpoint", "ddp_model_parallel"};
}

TEST_CASE("ddp: the DDP notes' programs (basic, checkpoint, model parallel) run by themselves") {
  for (const char* demo : kNotesPrograms) {
    const std::string exe = std::string(CORPC_EXAMPLES_DIR) + "/" + demo;
    INFO(exe);
    CHECK(run_and_explain("timeout 120 " + exe) == "");
  }
}

TEST_CASE("ddp: the DDP notes' programs run under torchrun" * doctest::skip(g_no_torchrun)) {
  for (const char* demo : kNotesPrograms) {
    const std::string exe = std::string(CORPC_EXAMPLES_DIR) + "/" + demo;
    INFO(exe);
    CHECK(run_and_explain(under_torchrun(exe)) == "");
  }
}
#endif

}  // namespace test_ddp
