// Device maps (issue 14, part 3): the checks, the exchange at init_rpc and the mapping of a tensor's device, on
// machines without a GPU. The maps are plain functions over c10::Device, tested directly; a job with maps configured
// must still carry CPU tensors unchanged (calls, RRefs, distributed autograd); bad maps fail init_rpc everywhere with
// UsageError; a CUDA tensor without an entry fails at the caller. "CUDA tensors" here are host memory labelled as a
// CUDA device (all Debian's CPU libtorch can make), which reaches every check that happens before a copy; the copies
// themselves need a GPU (the last test case, skipped without one).
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <ATen/ATen.h>

#include "../src/cuda_transfer.hpp"
#include "../src/device_map.hpp"
#include "../src/device_transfer.hpp"
#include "../src/tensor_meta.hpp"
#include "corpc/autograd/dist_autograd.hpp"
#include "corpc/rref/rref.hpp"
#include "support.hpp"

using namespace corpc;
using namespace corpc::test;
using namespace std::chrono_literals;
namespace da = corpc::dist_autograd;
namespace cd = corpc::detail;
using cd::DeviceConfig;

namespace {

c10::Device cuda(int i) { return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i)); }

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Host memory labelled as cuda:`index`: what a CUDA build of libtorch would hand corpc, as far as everything before
// the copy is concerned. Never touched as device memory here (no kernel can run on it).
at::Tensor labelled_cuda(const at::Tensor& host, int index) {
  auto* keep = new at::Tensor(host);
  return at::from_blob(host.data_ptr(), host.sizes(), host.strides(), [keep](void*) { delete keep; },
                       host.options().device(cuda(index)), cuda(index));
}

at::Tensor echo(at::Tensor t) { return t; }
std::string device_of(at::Tensor t) { return t.device().str(); }
at::Tensor labelled_result(int index) { return labelled_cuda(at::ones({4}), index); }
at::Tensor times_three_sum(at::Tensor t) { return (t * 3).sum(); }
// From worker1: sends a tensor labelled cuda:`index` to the master and returns the error it got.
std::string send_labelled_to_master(int index) {
  try {
    rpc_sync<&echo>("master", labelled_cuda(at::ones({2}), index));
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// Every worker of these jobs pretends to have two CUDA devices, so that maps naming cuda:0 and cuda:1 validate.
void pretend_two_devices() { cd::set_cuda_device_count_for_testing(2); }
struct PretendTwoDevices {  // in the parent, inherited by the forked ranks; the real count again afterwards
  PretendTwoDevices() { pretend_two_devices(); }
  ~PretendTwoDevices() { cd::set_cuda_device_count_for_testing(-1); }
};

DeviceConfig config(int count, std::map<std::string, DeviceMap> maps = {}, std::vector<c10::Device> devices = {}) {
  DeviceConfig c;
  c.device_count = count;
  c.maps = std::move(maps);
  c.devices = std::move(devices);
  return c;
}

std::string resolve_error(const std::vector<DeviceConfig>& configs) {
  try {
    cd::resolve_device_maps(0, {"a", "b"}, configs);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("device maps: one to one between CUDA devices with indices, or UsageError") {
  DOCTEST_CHECK_NOTHROW(cd::check_invertible({{cuda(0), cuda(1)}, {cuda(1), cuda(0)}}, "w"));
  DOCTEST_CHECK_THROWS_WITH_AS(cd::check_invertible({{cuda(0), cuda(1)}, {cuda(2), cuda(1)}}, "w"),
                       doctest::Contains("not invertible"), UsageError);
  DOCTEST_CHECK_THROWS_WITH_AS(cd::check_invertible({{c10::Device(c10::kCPU), cuda(1)}}, "w"),
                       doctest::Contains("is not a CUDA device"), UsageError);
  DOCTEST_CHECK_THROWS_WITH_AS(cd::check_invertible({{cuda(0), c10::Device(c10::kCUDA)}}, "w"),
                       doctest::Contains("index"), UsageError);
  const DeviceMap inv = cd::inverse({{cuda(0), cuda(3)}, {cuda(1), cuda(2)}});
  DOCTEST_CHECK((inv == DeviceMap{{cuda(3), cuda(0)}, {cuda(2), cuda(1)}}));
}

TEST_CASE("device maps: RpcOptions::set_device_map merges, refuses contradictions and leaves the options intact") {
  RpcOptions o;
  o.set_device_map("w1", {{cuda(0), cuda(1)}});
  o.set_device_map("w1", {{cuda(1), cuda(0)}, {cuda(0), cuda(1)}});  // the same entry again is fine
  DOCTEST_CHECK((o.device_maps.at("w1").size() == 2));
  DOCTEST_CHECK_THROWS_WITH_AS(o.set_device_map("w1", {{cuda(0), cuda(2)}}), doctest::Contains("already"), UsageError);
  DOCTEST_CHECK_THROWS_WITH_AS(o.set_device_map("w1", {{cuda(2), cuda(1)}}), doctest::Contains("not invertible"), UsageError);
  DOCTEST_CHECK_THROWS_AS(o.set_device_map("w2", {{cuda(0), cuda(0)}, {cuda(1), cuda(0)}}), UsageError);
  DOCTEST_CHECK((o.device_maps.size() == 1));  // no empty entry left behind by the failed call
  DOCTEST_CHECK((o.device_maps.at("w1") == DeviceMap{{cuda(0), cuda(1)}, {cuda(1), cuda(0)}}));
  DOCTEST_CHECK_THROWS_AS(o.set_devices({c10::Device(c10::kCPU)}), UsageError);
  DOCTEST_CHECK_THROWS_AS(o.set_devices({cuda(0), cuda(0)}), UsageError);
  o.set_devices({cuda(1), cuda(0)});
  DOCTEST_CHECK((o.devices.size() == 2));
}

TEST_CASE("device maps: a tensor's device on send: CPU unchanged, CUDA mapped or refused naming the worker") {
  const DeviceMap m{{cuda(0), cuda(1)}};
  DOCTEST_CHECK((cd::map_device(m, c10::Device(c10::kCPU), "w1") == c10::Device(c10::kCPU)));
  DOCTEST_CHECK((cd::map_device({}, c10::Device(c10::kCPU), "w1") == c10::Device(c10::kCPU)));
  DOCTEST_CHECK((cd::map_device(m, cuda(0), "w1") == cuda(1)));
  DOCTEST_CHECK_THROWS_WITH_AS(cd::map_device(m, cuda(1), "w1"), doctest::Contains("has no entry for cuda:1"), UsageError);
  DOCTEST_CHECK_THROWS_WITH_AS(cd::map_device({}, cuda(0), "w1"), doctest::Contains("no device map to it"), UsageError);
}

TEST_CASE("device maps: the configuration announced at rendezvous round-trips; malformed bytes are ProtocolError") {
  DeviceConfig c = config(4, {{"w1", {{cuda(0), cuda(3)}, {cuda(2), cuda(1)}}}, {"w2", {}}}, {cuda(0), cuda(2)});
  const std::string bytes = cd::encode_device_config(c);
  DeviceConfig d = cd::decode_device_config(bytes);
  DOCTEST_CHECK(d.device_count == 4);
  DOCTEST_CHECK((d.devices == c.devices));
  DOCTEST_CHECK((d.maps == c.maps));
  DOCTEST_CHECK(cd::decode_device_config("").maps.empty());
  for (std::size_t cut = 1; cut < bytes.size(); ++cut)
    DOCTEST_CHECK_THROWS_AS(cd::decode_device_config(std::string_view(bytes).substr(0, cut)), ProtocolError);
  DOCTEST_CHECK_THROWS_AS(cd::decode_device_config(bytes + "x"), ProtocolError);
}

TEST_CASE("device maps: the job's maps are checked together; a map back must be the inverse; replies follow it") {
  // a maps its cuda:0 to b's cuda:1; b sets nothing: b uses the inverse with a (its replies and gradients retrace).
  auto r = cd::resolve_device_maps(1, {"a", "b"}, {config(1, {{"b", {{cuda(0), cuda(1)}}}}), config(2)});
  DOCTEST_CHECK((r.by_rank[0] == DeviceMap{{cuda(1), cuda(0)}}));
  DOCTEST_CHECK((r.by_rank[1] == DeviceMap{{cuda(0), cuda(0)}, {cuda(1), cuda(1)}}));  // itself: no move
  DOCTEST_CHECK((r.devices == std::vector<c10::Device>{cuda(1)}));
  auto a = cd::resolve_device_maps(0, {"a", "b"}, {config(1, {{"b", {{cuda(0), cuda(1)}}}}), config(2)});
  DOCTEST_CHECK((a.by_rank[1] == DeviceMap{{cuda(0), cuda(1)}}));
  DOCTEST_CHECK((a.devices == std::vector<c10::Device>{cuda(0)}));
  // Both set one, mutual inverses: fine.
  DOCTEST_CHECK(resolve_error({config(2, {{"b", {{cuda(0), cuda(1)}}}}), config(2, {{"a", {{cuda(1), cuda(0)}}}})}).empty());
  // Both set one, not inverses: refused (replies would go elsewhere than the map back sends requests).
  DOCTEST_CHECK(contains(resolve_error({config(2, {{"b", {{cuda(0), cuda(1)}}}}), config(2, {{"a", {{cuda(0), cuda(1)}}}})}),
                 "not its inverse"));
  // Devices that do not exist, on either side.
  DOCTEST_CHECK(contains(resolve_error({config(0, {{"b", {{cuda(0), cuda(0)}}}}), config(1)}), "has 0 CUDA devices"));
  DOCTEST_CHECK(contains(resolve_error({config(1, {{"b", {{cuda(0), cuda(3)}}}}), config(2)}), "to cuda:3 on 'b'"));
  // Declared devices bound the maps.
  DOCTEST_CHECK(contains(resolve_error({config(2, {{"b", {{cuda(1), cuda(0)}}}}, {cuda(0)}), config(1)}), "not among its devices"));
  DOCTEST_CHECK(contains(resolve_error({config(2, {}, {cuda(0), cuda(0)}), config(1)}), "twice"));
  DOCTEST_CHECK(contains(resolve_error({config(1, {}, {cuda(1)}), config(1)}), "declares cuda:1"));
  // Maps name workers of the job.
  DOCTEST_CHECK(contains(resolve_error({config(1, {{"c", {{cuda(0), cuda(0)}}}}), config(1)}), "not a worker of this job"));
}

TEST_CASE("device transfers: the continuation runs once, after every part and the seal, with the first error") {
  cd::DeviceTransfer t;
  t.add_part();
  t.add_part();
  int runs = 0;
  std::exception_ptr seen;
  t.then([&](std::exception_ptr e) { ++runs, seen = e; });
  t.part_done();
  t.part_done(std::make_exception_ptr(RpcError("first")));
  DOCTEST_CHECK(runs == 0);  // not sealed yet
  t.seal();
  DOCTEST_CHECK(runs == 1);
  DOCTEST_REQUIRE(seen);
  DOCTEST_CHECK_THROWS_WITH(std::rethrow_exception(seen), "first");
  int late = 0;
  t.then([&](std::exception_ptr e) { late += e ? 1 : 0; });  // already done: runs at once
  DOCTEST_CHECK(late == 1);
  cd::DeviceTransfer failed;
  failed.fail(std::make_exception_ptr(UsageError("could not start")));
  failed.seal();
  DOCTEST_CHECK(failed.done());
}

TEST_CASE("device maps on the wire: a tensor bound for a device is announced, parsed, received in host memory") {
  at::Tensor cpu = at::arange(6, at::kFloat);
  std::string meta;
  std::uint64_t total = 0;
  // A CUDA tensor without a map entry never gets as far as a copy.
  DOCTEST_CHECK_THROWS_WITH_AS(encode_tensor_meta({labelled_cuda(cpu, 1)}, meta, total, {{cuda(0), cuda(1)}}, "w1"),
                       doctest::Contains("cuda:1"), UsageError);
  // A hand-made entry for cuda:1 (what a sender with a GPU writes): float, 1 dim, size 6, stride 1, on device 1.
  meta.clear();
  Writer w(meta);
  w.put(static_cast<std::uint8_t>(at::kFloat));
  w.put(std::uint8_t{1});
  w.put(std::int64_t{6});
  w.put(std::int64_t{1});
  w.put(cd::kTensorOnDevice);
  w.put(std::int8_t{1});
  w.put(std::uint64_t{24});
  std::vector<std::int8_t> devices;
  auto tensors = decode_tensor_meta(meta.data(), meta.size(), 1, 24, WireLimits{}, &devices);
  DOCTEST_REQUIRE(tensors.size() == 1);
  DOCTEST_CHECK(tensors[0].device().is_cpu());  // received in host memory; the runtime copies it to cuda:1
  DOCTEST_CHECK((devices == std::vector<std::int8_t>{1}));
  DOCTEST_CHECK_THROWS_AS(decode_tensor_meta(meta.data(), meta.size(), 1, 24, WireLimits{}, nullptr), ProtocolError);
  meta[meta.size() - 9] = static_cast<char>(-3);  // a negative device index
  DOCTEST_CHECK_THROWS_AS(decode_tensor_meta(meta.data(), meta.size(), 1, 24, WireLimits{}, &devices), ProtocolError);
  // CPU tensors: no device entry, no device list.
  meta.clear();
  devices.clear();
  encode_tensor_meta({cpu}, meta, total, {{cuda(0), cuda(1)}}, "w1");
  decode_tensor_meta(meta.data(), meta.size(), 1, total, WireLimits{}, &devices);
  DOCTEST_CHECK(devices.empty());
}

TEST_CASE("device maps end to end: CPU tensors unchanged with maps configured; unmapped CUDA tensors fail at the caller") {
  PretendTwoDevices pretend;
  launch_processes(2, [](int rank) {
    auto options = quick_options();
    if (rank == 0) options.set_device_map("worker1", {{cuda(0), cuda(1)}});  // worker1 uses the inverse
    init_rpc(worker_name(rank), rank, 2, options);
    if (rank != 0) return shutdown(true);
    // Calls, RRefs and distributed autograd carry CPU tensors as before, every dtype and layout.
    for (auto dtype : {at::kFloat, at::kDouble, at::kInt, at::kLong, at::kByte, at::kBool, at::kHalf}) {
      at::Tensor t = at::arange(24, at::kInt).mul_(7).remainder_(11).to(dtype).reshape({2, 3, 4});
      for (const at::Tensor& x : {t, t.transpose(0, 2), t.select(1, 1)}) {
        at::Tensor back = rpc_sync<&echo>("worker1", x);
        EXPECT(back.device().is_cpu());
        EXPECT(back.sizes() == x.sizes());
        EXPECT(at::equal(back, x));
      }
    }
    EXPECT_EQ(rpc_sync<&device_of>("worker1", at::ones({2})), std::string("cpu"));
    RRef<at::Tensor> ref = remote<&echo>("worker1", at::full({3}, 5.0));
    EXPECT(at::equal(ref.to_here().wait(30s), at::full({3}, 5.0)));
    {
      da::Context ctx;
      at::Tensor x = at::arange(4, at::kFloat).requires_grad_();
      at::Tensor y = rpc_sync<&times_three_sum>("worker1", x);
      ctx.backward({y}).wait(30s);
      auto grads = da::get_gradients(ctx.id());
      EXPECT(grads.count(x) == 1);
      EXPECT(at::equal(grads.at(x), at::full({4}, 3.0)));
    }
    // cuda:1 has no entry in the map to worker1, cuda:7 none in the master's to itself: both fail here, typed.
    const std::string why = EXPECT_THROWS_AS(rpc_sync<&echo>("worker1", labelled_cuda(at::ones({2}), 1)), UsageError);
    EXPECT(contains(why, "cuda:1") && contains(why, "worker1"));
    EXPECT_THROWS_AS(rpc_sync<&echo>("master", labelled_cuda(at::ones({2}), 7)), UsageError);
    // A callee's result on a device its map back does not name: the error reaches the caller's future.
    const std::string back = EXPECT_THROWS_AS(rpc_sync<&labelled_result>("worker1", 5), RpcError);
    EXPECT(contains(back, "cuda:5"));
    // cuda:0 is mapped: the copy itself needs a GPU (or a CUDA build): a typed error past the map, and the job goes on.
    const std::string copy = EXPECT_THROWS_AS(rpc_sync<&echo>("worker1", labelled_cuda(at::ones({2}), 0)), RpcError);
    EXPECT(!contains(copy, "device map"));
    // worker1 set no map: it uses the inverse of ours, {cuda:1 -> cuda:0}, for its own calls to us too.
    EXPECT(contains(rpc_sync<&send_labelled_to_master>("worker1", 0), "has no entry for cuda:0"));
    const std::string inverse = rpc_sync<&send_labelled_to_master>("worker1", 1);
    EXPECT(!inverse.empty() && !contains(inverse, "device map"));
    EXPECT(at::equal(rpc_sync<&echo>("worker1", at::ones({2})), at::ones({2})));
    shutdown(true);
  }, LaunchOptions{120s, 10s});
}

TEST_CASE("device maps: bad maps fail init_rpc on every worker with UsageError") {
  // A map set field by field that is not invertible: refused before anything starts.
  RpcOptions bad;
  bad.device_maps["w1"] = {{cuda(0), cuda(0)}, {cuda(1), cuda(0)}};
  DOCTEST_CHECK_THROWS_WITH_AS(init_rpc("solo", 0, 1, bad), doctest::Contains("not invertible"), UsageError);
  auto expect_init_fails = [](auto configure, std::string expected) {
    launch_processes(2, [&](int rank) {
      auto options = quick_options();
      options.init_timeout = 20s;
      configure(rank, options);
      const std::string why = EXPECT_THROWS_AS(init_rpc(worker_name(rank), rank, 2, options), UsageError);
      if (!contains(why, expected)) throw std::runtime_error("unexpected message: " + why);
    }, LaunchOptions{60s, 10s});
  };
  // Devices that this machine does not have (no override of the device count: no GPU here).
  expect_init_fails([](int rank, RpcOptions& o) {
    if (rank == 0) o.set_device_map("worker1", {{cuda(0), cuda(0)}});
  }, "CUDA devices");
  // Two maps between one pair that are not inverses.
  expect_init_fails([](int rank, RpcOptions& o) {
    pretend_two_devices();
    o.set_device_map(rank == 0 ? "worker1" : "master", {{cuda(0), cuda(1)}});
  }, "not its inverse");
  // A map to oneself (the same options on every rank, say): refused, naming the worker.
  expect_init_fails([](int, RpcOptions& o) {
    pretend_two_devices();
    o.set_device_map("worker1", {{cuda(0), cuda(1)}});
  }, "to itself");
  // A map to a worker that is not in the job.
  expect_init_fails([](int rank, RpcOptions& o) {
    pretend_two_devices();
    if (rank == 1) o.set_device_map("worker7", {{cuda(0), cuda(1)}});
  }, "not a worker of this job");
}

// On a GPU: the master's cuda:0 goes to worker1's cuda:0 (one device is enough), the echo comes back on cuda:0 with
// the same bytes, for a contiguous and a transposed layout. Skipped without a CUDA device (these machines): the CUDA
// copies are compiled here, not run.
bool on_cuda0(at::Tensor t) { return t.device() == cuda(0); }

TEST_CASE("device maps with a GPU (skipped without one): tensors arrive on the mapped device, the reply on the original" *
          doctest::skip(cd::cuda::device_count() == 0)) {
  launch_processes(2, [](int rank) {
    auto options = quick_options();
    if (rank == 0) options.set_device_map("worker1", {{cuda(0), cuda(0)}});
    init_rpc(worker_name(rank), rank, 2, options);
    if (rank == 0) {
      at::Tensor host = at::arange(1 << 20, at::kFloat).reshape({1024, 1024});
      for (const at::Tensor& h : {host, host.t()}) {
        at::Tensor dev = cd::cuda::copy_to_device(h, 0);
        EXPECT(rpc_sync<&on_cuda0>("worker1", dev));
        at::Tensor back = rpc_sync<&echo>("worker1", dev);
        EXPECT(back.device() == cuda(0));
        EXPECT(at::equal(cd::cuda::copy_to_host(back), h.contiguous()));
      }
    }
    shutdown(true);
  }, LaunchOptions{120s, 10s});
}
