// CUDA tensors between two processes that share one GPU (cuda:0), through device maps: calls (rpc_sync, rpc_async),
// remote() and to_here(), RemoteModule on "worker1/cuda:0", distributed autograd and DistributedOptimizer. Every
// result is compared element for element with the same computation on the CPU: exactly where each element is one
// correctly rounded operation (copies, +, *), within a tolerance where the GPU's libraries may round or sum in another
// order (matrix products, sin/cos, reductions, the gradients built from them).
//
// Needs a CUDA device and a CUDA build of libtorch (scripts/gpu_check.sh builds against PyTorch's wheel); every case
// is skipped without them, so on CI machines this binary only reports skipped cases.
//
// Whether they are there is asked in a forked child (tests/gpu_probe.hpp): this process never touches CUDA itself.
#include <ATen/ATen.h>
#include <doctest/doctest.h>
#include <torch/autograd.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <cstdio>

#include "corpc/autograd/dist_autograd.hpp"
#include "corpc/autograd/optimizer.hpp"
#include "corpc/rref/remote_module.hpp"
#include "corpc/rref/rref.hpp"

#include "../src/memory/cuda_transfer.hpp"
#include "gpu_probe.hpp"
#include "leak_checks.hpp"
#include "support.hpp"

namespace test_cuda {  // this file's names, apart from the files it shares an executable with

using namespace corpc;
using namespace corpc::test;
using namespace std::chrono_literals;
namespace da = corpc::dist_autograd;
namespace cd = corpc::detail;

namespace {

// True if cuda:0 exists and libtorch has CUDA kernels; asked in a child (tests/gpu_probe.hpp).
bool cuda_usable() {
  const bool ok = cuda_usable_in_child(/*with_torch_kernels=*/true);
  if (!ok) std::fprintf(stderr, "test_cuda: no CUDA device usable through this libtorch: every case is skipped\n");
  return ok;
}
// Before the test cases below: their registration reads it.
const bool g_no_gpu = !run_is_for("test_cuda.cpp") || !cuda_usable();

const c10::Device kCuda0(c10::kCUDA, 0);

// Two ranks sharing cuda:0. The master maps its cuda:0 to worker1's cuda:0; with `both_sides`, worker1 sets the same
// map back (it must be the inverse, which it is), otherwise worker1 uses the inverse of the master's.
void run_pair(const std::function<void(int)>& body, bool both_sides = false) {
  launch_processes(
      2,
      [&](int rank) {
        auto options = quick_options();
        if (rank == 0) options.set_device_map("worker1", {{kCuda0, kCuda0}});
        if (rank == 1 && both_sides) options.set_device_map("master", {{kCuda0, kCuda0}});
        init_rpc(worker_name(rank), rank, 2, options);
        body(rank);
        shutdown(true);
      },
      launch_options(std::chrono::seconds(240)));
}

// Float results whose elements come from library code (cuBLAS, CUDA's math functions) rather than one rounding.
bool close(const at::Tensor& gpu, const at::Tensor& cpu) {
  return gpu.device() == kCuda0 && at::allclose(gpu.cpu(), cpu, /*rtol=*/1e-5, /*atol=*/1e-6);
}
bool close_matmul(const at::Tensor& gpu, const at::Tensor& cpu) {
  return gpu.device() == kCuda0 && at::allclose(gpu.cpu(), cpu, /*rtol=*/1e-4, /*atol=*/1e-5);
}
// Exactly equal, and on cuda:0.
bool same(const at::Tensor& gpu, const at::Tensor& cpu) {
  return gpu.device() == kCuda0 && gpu.sizes() == cpu.sizes() && at::equal(gpu.cpu(), cpu);
}

at::Tensor echo(at::Tensor t) { return t; }
std::string device_of(at::Tensor t) { return t.device().str(); }
at::Tensor affine(at::Tensor t, double a, double b) { return t * a + b; }
at::Tensor matmul(at::Tensor a, at::Tensor b) { return a.matmul(b); }
// A CUDA and a CPU argument in one call; a CUDA and a CPU result in one reply.
at::Tensor add_host_to_device(at::Tensor dev, at::Tensor host) { return dev + host.to(dev.device()); }
std::vector<at::Tensor> on_both(at::Tensor dev) { return {dev.cpu() * 2, dev * 3}; }
// A tensor produced by kernels just before it is sent: the send must wait for them.
at::Tensor fresh_on_device(std::int64_t n) {
  return at::arange(n, at::TensorOptions().dtype(at::kFloat).device(kCuda0)).mul_(2).add_(1);
}

at::Tensor make_on_device(std::int64_t n, double scale) {
  return at::arange(n, at::TensorOptions().dtype(at::kFloat).device(kCuda0)) * scale;
}
std::string value_device(RRef<at::Tensor> r) { return r.local_value().device().str(); }
Task<at::Tensor> times_of_ref(RRef<at::Tensor> r, double k) { co_return (co_await r.to_here()) * k; }

// Distributed autograd.
at::Tensor wave(at::Tensor t) { return (t * 2 + 1).sin(); }
at::Tensor make_param(std::int64_t n) {
  torch::manual_seed(7);
  return at::rand({n}).to(kCuda0).set_requires_grad(true);
}
at::Tensor grad_of(std::int64_t ctx, RRef<at::Tensor> param) {
  auto grads = da::get_gradients(ctx);
  auto it = grads.find(param.local_value());
  return it == grads.end() ? at::Tensor() : it->second;
}

}  // namespace

TEST_CASE("CUDA tensors through rpc_sync and rpc_async arrive on the mapped device, equal to the CPU computation" *
          doctest::skip(g_no_gpu)) {
  run_pair([](int rank) {
    if (rank != 0) return;
    // Every dtype and layout: contiguous, transposed (dense, other strides), a slice with gaps.
    for (auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kInt, at::kLong, at::kByte, at::kBool}) {
      const at::Tensor t = at::arange(24, at::kInt).mul_(7).remainder_(11).to(dtype).reshape({2, 3, 4});
      for (const at::Tensor& h : {t, t.transpose(0, 2), t.select(1, 1)}) {
        at::Tensor back = rpc_sync<&echo>("worker1", h.to(kCuda0));
        EXPECT(same(back, h));
      }
    }
    EXPECT_EQ(rpc_sync<&device_of>("worker1", at::ones({3}, at::TensorOptions().device(kCuda0))),
              std::string("cuda:0"));
    EXPECT_EQ(rpc_sync<&device_of>("worker1", at::ones({3})), std::string("cpu"));  // CPU tensors stay on the CPU
    EXPECT_EQ(rpc_sync<&device_of>("master", at::ones({3}, at::TensorOptions().device(kCuda0))), std::string("cuda:0"));

    torch::manual_seed(1);
    const at::Tensor x = at::randn({256, 64});
    EXPECT(same(rpc_sync<&affine>("worker1", x.to(kCuda0), 3.0, 0.5), x * 3.0 + 0.5));
    const at::Tensor w = at::randn({64, 32});
    EXPECT(close_matmul(rpc_sync<&matmul>("worker1", x.to(kCuda0), w.to(kCuda0)), x.matmul(w)));
    const at::Tensor h = at::randn({256, 64});
    EXPECT(same(rpc_sync<&add_host_to_device>("worker1", x.to(kCuda0), h), x + h));
    const auto both = rpc_sync<&on_both>("worker1", x.to(kCuda0));
    EXPECT(both.size() == 2 && both[0].device().is_cpu() && at::equal(both[0], x * 2));
    EXPECT(same(both[1], x * 3));
    const std::int64_t n = std::int64_t{1} << 22;  // 16 MiB, made by kernels on worker1 right before its reply
    EXPECT(same(rpc_sync<&fresh_on_device>("worker1", n), at::arange(n, at::kFloat).mul_(2).add_(1)));
    const at::Tensor big = at::randn({n});  // 16 MiB made by kernels here right before the call
    EXPECT(same(rpc_sync<&affine>("worker1", big.to(kCuda0).mul(2), 1.0, 0.0), big * 2));

    // Many calls in flight at once, of different sizes, each reply matched with its own request.
    std::vector<at::Tensor> inputs;
    std::vector<Future<at::Tensor>> replies;
    for (int i = 0; i < 24; ++i) {
      inputs.push_back(at::randn({(i + 1) * 40000}));
      replies.push_back(rpc_async<&affine>("worker1", inputs.back().to(kCuda0), static_cast<double>(i), -1.0));
    }
    for (int i = 0; i < 24; ++i) EXPECT(same(replies[i].wait(60s), inputs[i] * static_cast<double>(i) - 1.0));
  });
}

TEST_CASE("CUDA tensors with maps set on both sides (inverses of each other)" * doctest::skip(g_no_gpu)) {
  run_pair(
      [](int rank) {
        const at::Tensor x = at::arange(1000, at::kFloat).reshape({10, 100});
        at::Tensor back = rpc_sync<&affine>(rank == 0 ? "worker1" : "master", x.to(kCuda0), 0.5, 2.0);
        EXPECT(same(back, x * 0.5 + 2.0));
      },
      /*both_sides=*/true);
}

TEST_CASE("remote() and to_here() keep CUDA values on the owner's device and fetch them through the map" *
          doctest::skip(g_no_gpu)) {
  run_pair([](int rank) {
    if (rank != 0) return;
    {
      RRef<at::Tensor> made = remote<&make_on_device>("worker1", 1000, 0.25);
      EXPECT_EQ(rpc_sync<&value_device>("worker1", made), std::string("cuda:0"));  // kept on the owner's device
      EXPECT(same(made.to_here().wait(30s), at::arange(1000, at::kFloat) * 0.25));

      torch::manual_seed(2);
      const at::Tensor x = at::randn({64, 32});
      RRef<at::Tensor> r = remote<&affine>("worker1", x.to(kCuda0), -2.0, 3.0);  // a CUDA argument to remote()
      EXPECT_EQ(rpc_sync<&value_device>("worker1", r), std::string("cuda:0"));
      EXPECT(same(r.to_here().wait(30s), x * -2.0 + 3.0));
      EXPECT(same(rpc_sync<&times_of_ref>("worker1", r, 4.0), (x * -2.0 + 3.0) * 4.0));  // used on its owner
      EXPECT(same(sync_wait(times_of_ref(r, 0.5)), (x * -2.0 + 3.0) * 0.5));             // used here

      // Owned here, on our device, read by worker1 through the map and returned.
      RRef<at::Tensor> mine(x.to(kCuda0));
      EXPECT(same(rpc_sync<&times_of_ref>("worker1", mine, 2.0), x * 2.0));
    }
    expect_no_references(2);
  });
}

TEST_CASE("RemoteModule on worker1/cuda:0 computes what the same Linear computes on the CPU" *
          doctest::skip(g_no_gpu)) {
  run_pair([](int rank) {
    if (rank != 0) return;
    {
      RemoteModule<torch::nn::Linear> lin("worker1/cuda:0", 16, 8);
      EXPECT_EQ(lin.device(), std::string("cuda:0"));
      auto params = lin.remote_parameters();
      EXPECT_EQ(params.size(), 2u);
      const at::Tensor w = params[0].to_here().wait(30s), b = params[1].to_here().wait(30s);
      EXPECT(w.device() == kCuda0 && b.device() == kCuda0);  // owned on worker1's cuda:0, fetched to ours
      torch::manual_seed(3);
      const at::Tensor x = at::randn({5, 16});
      const at::Tensor expected = at::linear(x, w.cpu(), b.cpu());
      EXPECT(close_matmul(lin.forward(x), expected));                             // a CPU input, moved there
      EXPECT(close_matmul(lin.forward_async(x.to(kCuda0)).wait(30s), expected));  // a CUDA input, mapped
    }
    expect_no_references(2);
  });
}

TEST_CASE("distributed autograd across two processes on cuda:0 gives the CPU's gradients" * doctest::skip(g_no_gpu)) {
  run_pair([](int rank) {
    if (rank != 0) return;
    torch::manual_seed(4);
    const at::Tensor x_cpu = at::randn({6, 5});
    {  // A tensor of ours through a function on worker1 and back; its gradient flows back through both maps.
      da::Context ctx;
      at::Tensor x = x_cpu.to(kCuda0).requires_grad_();
      at::Tensor y = rpc_sync<&wave>("worker1", x);
      EXPECT(y.device() == kCuda0);
      at::Tensor loss = (y * y).sum();
      ctx.backward({loss}).wait(60s);
      at::Tensor ref_x = x_cpu.clone().requires_grad_();
      at::Tensor ref_y = wave(ref_x);
      (ref_y * ref_y).sum().backward();
      EXPECT(close(loss.detach(), (ref_y * ref_y).sum().detach()));
      EXPECT(close(ctx.gradients().at(x), ref_x.grad()));
      EXPECT(!x.grad().defined());  // never into .grad
    }
    {  // A parameter owned by worker1 on its cuda:0: its gradient is kept there, in the context.
      RRef<at::Tensor> p = remote<&make_param>("worker1", 5);
      at::Tensor q = at::randn({5}).to(kCuda0).requires_grad_();
      da::Context ctx;
      at::Tensor v = p.to_here().wait(30s);
      ctx.backward({(v * q).sum()}).wait(60s);
      at::Tensor g = rpc_sync<&grad_of>("worker1", ctx.id(), p);
      EXPECT(same(g, q.detach().cpu()));  // d/dv sum(v * q) = q, exactly
      EXPECT(same(ctx.gradients().at(q), v.detach().cpu()));
    }
    expect_no_contexts(2);
    expect_no_references(2);
  });
}

TEST_CASE("a RemoteModule on cuda:0 trained by DistributedOptimizer follows the same Linear trained on the CPU" *
          doctest::skip(g_no_gpu)) {
  run_pair([](int rank) {
    if (rank != 0) return;
    {
      RemoteModule<torch::nn::Linear> lin("worker1/cuda:0", 6, 3);
      auto params = lin.remote_parameters();
      DistributedOptimizer<torch::optim::SGD> dopt(params, torch::optim::SGDOptions(0.1).momentum(0.9));
      torch::nn::Linear local(torch::nn::LinearOptions(6, 3));
      {
        torch::NoGradGuard no_grad;
        local->weight.copy_(params[0].to_here().wait(30s).cpu());
        local->bias.copy_(params[1].to_here().wait(30s).cpu());
      }
      torch::optim::SGD lopt(local->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      torch::manual_seed(5);
      for (int step = 0; step < 3; ++step) {
        const at::Tensor x = at::randn({4, 6}), target = at::randn({4, 3});
        da::Context ctx;
        at::Tensor out = lin.forward(x);  // on our cuda:0, through the map back
        at::Tensor loss = torch::nn::functional::mse_loss(out, target.to(kCuda0));
        ctx.backward({loss}).wait(60s);
        dopt.step(ctx).wait(60s);
        lopt.zero_grad();
        at::Tensor lloss = torch::nn::functional::mse_loss(local->forward(x), target);
        lloss.backward();
        lopt.step();
        EXPECT(close_matmul(loss.detach(), lloss.detach()));
      }
      EXPECT(close_matmul(params[0].to_here().wait(30s), local->weight.detach()));
      EXPECT(close_matmul(params[1].to_here().wait(30s), local->bias.detach()));
    }
    expect_no_contexts(2);
    expect_no_references(2);
  });
}

}  // namespace test_cuda
