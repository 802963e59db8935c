// Device maps: the checks, the exchange at init_rpc and the mapping of a tensor's device, on
// machines without a GPU. The maps are plain functions over c10::Device, tested directly; a job with maps configured
// must still carry CPU tensors unchanged (calls, RRefs, distributed autograd); bad maps fail init_rpc everywhere with
// UsageError; a CUDA tensor without an entry fails at the caller. "CUDA tensors" here are host memory labelled as a
// CUDA device (all Debian's CPU libtorch can make), which reaches every check that happens before a copy; the copies
// themselves need a GPU (the last test cases, skipped without one). CUDA IPC's decisions, wire format and bookkeeping
// are tested here too; its copies need a GPU and a CUDA build of libtorch.
#include <ATen/ATen.h>
#include <doctest/doctest.h>

#include <cstdlib>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "corpc/autograd/dist_autograd.hpp"
#include "corpc/rref/rref.hpp"

#include "../src/memory/cuda_ipc.hpp"
#include "../src/memory/cuda_transfer.hpp"
#include "../src/memory/device_transfer.hpp"
#include "../src/rpc/environment.hpp"
#include "../src/rpc/hello.hpp"
#include "../src/wire/device_map.hpp"
#include "../src/wire/tensor_meta.hpp"
#include "gpu_probe.hpp"
#include "raw_peer.hpp"
#include "support.hpp"

namespace test_device_map {  // this file's names, apart from the files it shares an executable with

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
  return at::from_blob(
      host.data_ptr(), host.sizes(), host.strides(), [keep](void*) { delete keep; }, host.options().device(cuda(index)),
      cuda(index));
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

// Whether a CUDA device is there, asked in a child (tests/gpu_probe.hpp): this process never touches CUDA itself.
// For the same reason the cases that would (host staging buffers, tensors labelled as CUDA in a CUDA libtorch) run
// only where no GPU is.
bool gpu_present() { return cuda_usable_in_child(/*with_torch_kernels=*/false); }
// Before the test cases below: their registration reads it.
const bool g_gpu = run_is_for("test_device_map.cpp") && gpu_present();

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
  DOCTEST_CHECK_THROWS_WITH_AS(o.set_device_map("w1", {{cuda(2), cuda(1)}}), doctest::Contains("not invertible"),
                               UsageError);
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
  DOCTEST_CHECK_THROWS_WITH_AS(cd::map_device(m, cuda(1), "w1"), doctest::Contains("has no entry for cuda:1"),
                               UsageError);
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
  DOCTEST_CHECK(
      resolve_error({config(2, {{"b", {{cuda(0), cuda(1)}}}}), config(2, {{"a", {{cuda(1), cuda(0)}}}})}).empty());
  // Both set one, not inverses: refused (replies would go elsewhere than the map back sends requests).
  DOCTEST_CHECK(
      contains(resolve_error({config(2, {{"b", {{cuda(0), cuda(1)}}}}), config(2, {{"a", {{cuda(0), cuda(1)}}}})}),
               "not its inverse"));
  // Devices that do not exist, on either side.
  DOCTEST_CHECK(contains(resolve_error({config(0, {{"b", {{cuda(0), cuda(0)}}}}), config(1)}), "has 0 CUDA devices"));
  DOCTEST_CHECK(contains(resolve_error({config(1, {{"b", {{cuda(0), cuda(3)}}}}), config(2)}), "to cuda:3 on 'b'"));
  // Declared devices bound the maps.
  DOCTEST_CHECK(contains(resolve_error({config(2, {{"b", {{cuda(1), cuda(0)}}}}, {cuda(0)}), config(1)}),
                         "not among its devices"));
  DOCTEST_CHECK(contains(resolve_error({config(2, {}, {cuda(0), cuda(0)}), config(1)}), "twice"));
  DOCTEST_CHECK(contains(resolve_error({config(1, {}, {cuda(1)}), config(1)}), "declares cuda:1"));
  // Maps name workers of the job.
  DOCTEST_CHECK(
      contains(resolve_error({config(1, {{"c", {{cuda(0), cuda(0)}}}}), config(1)}), "not a worker of this job"));
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

TEST_CASE("device maps on the wire: a tensor bound for a device is announced, parsed, received in host memory" *
          doctest::skip(g_gpu)) {
  at::Tensor cpu = at::arange(6, at::kFloat);
  std::string meta;
  std::uint64_t total = 0;
  // A CUDA tensor without a map entry never gets as far as a copy.
  DOCTEST_CHECK_THROWS_WITH_AS(
      corpc::detail::encode_tensor_meta({labelled_cuda(cpu, 1)}, meta, total, {{cuda(0), cuda(1)}}, "w1"),
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
  auto tensors = corpc::detail::decode_tensor_meta(meta.data(), meta.size(), 1, 24, WireLimits{}, &devices);
  DOCTEST_REQUIRE(tensors.size() == 1);
  DOCTEST_CHECK(tensors[0].device().is_cpu());  // received in host memory; the runtime copies it to cuda:1
  DOCTEST_CHECK((devices == std::vector<std::int8_t>{1}));
  DOCTEST_CHECK_THROWS_AS(corpc::detail::decode_tensor_meta(meta.data(), meta.size(), 1, 24, WireLimits{}, nullptr),
                          ProtocolError);
  meta[meta.size() - 9] = static_cast<char>(-3);  // a negative device index
  DOCTEST_CHECK_THROWS_AS(corpc::detail::decode_tensor_meta(meta.data(), meta.size(), 1, 24, WireLimits{}, &devices),
                          ProtocolError);
  // CPU tensors: no device entry, no device list.
  meta.clear();
  devices.clear();
  corpc::detail::encode_tensor_meta({cpu}, meta, total, {{cuda(0), cuda(1)}}, "w1");
  corpc::detail::decode_tensor_meta(meta.data(), meta.size(), 1, total, WireLimits{}, &devices);
  DOCTEST_CHECK(devices.empty());
}

TEST_CASE(
    "device maps end to end: CPU tensors unchanged with maps configured; unmapped CUDA tensors fail at the caller") {
  PretendTwoDevices pretend;
  launch_processes(
      2,
      [](int rank) {
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
        const std::string why =
            EXPECT_THROWS_AS(rpc_sync<&echo>("worker1", labelled_cuda(at::ones({2}), 1)), UsageError);
        EXPECT(contains(why, "cuda:1") && contains(why, "worker1"));
        EXPECT_THROWS_AS(rpc_sync<&echo>("master", labelled_cuda(at::ones({2}), 7)), UsageError);
        // A callee's result on a device its map back does not name: the error reaches the caller's future.
        const std::string back = EXPECT_THROWS_AS(rpc_sync<&labelled_result>("worker1", 5), RpcError);
        EXPECT(contains(back, "cuda:5"));
        // cuda:0 is mapped: the copy itself needs a GPU (or a CUDA build): a typed error past the map, and the job goes on.
        const std::string copy =
            EXPECT_THROWS_AS(rpc_sync<&echo>("worker1", labelled_cuda(at::ones({2}), 0)), RpcError);
        EXPECT(!contains(copy, "device map"));
        // worker1 set no map: it uses the inverse of ours, {cuda:1 -> cuda:0}, for its own calls to us too.
        EXPECT(contains(rpc_sync<&send_labelled_to_master>("worker1", 0), "has no entry for cuda:0"));
        const std::string inverse = rpc_sync<&send_labelled_to_master>("worker1", 1);
        EXPECT(!inverse.empty() && !contains(inverse, "device map"));
        EXPECT(at::equal(rpc_sync<&echo>("worker1", at::ones({2})), at::ones({2})));
        shutdown(true);
      },
      launch_options(120s, 10s));
}

TEST_CASE("device maps: bad maps fail init_rpc on every worker with UsageError") {
  // A map set field by field that is not invertible: refused before anything starts.
  RpcOptions bad;
  bad.device_maps["w1"] = {{cuda(0), cuda(0)}, {cuda(1), cuda(0)}};
  DOCTEST_CHECK_THROWS_WITH_AS(init_rpc("solo", 0, 1, bad), doctest::Contains("not invertible"), UsageError);
  auto expect_init_fails = [](auto configure, std::string expected) {
    launch_processes(
        2,
        [&](int rank) {
          auto options = quick_options();
          options.init_timeout = 20s;
          configure(rank, options);
          const std::string why = EXPECT_THROWS_AS(init_rpc(worker_name(rank), rank, 2, options), UsageError);
          if (!contains(why, expected)) throw std::runtime_error("unexpected message: " + why);
        },
        launch_options(60s, 10s));
  };
  // Devices that this machine does not have (no override of the device count: no GPU here).
  expect_init_fails(
      [](int rank, RpcOptions& o) {
        if (rank == 0) o.set_device_map("worker1", {{cuda(0), cuda(0)}});
      },
      "CUDA devices");
  // Two maps between one pair that are not inverses.
  expect_init_fails(
      [](int rank, RpcOptions& o) {
        pretend_two_devices();
        o.set_device_map(rank == 0 ? "worker1" : "master", {{cuda(0), cuda(1)}});
      },
      "not its inverse");
  // A map to oneself (the same options on every rank, say): refused, naming the worker.
  expect_init_fails(
      [](int, RpcOptions& o) {
        pretend_two_devices();
        o.set_device_map("worker1", {{cuda(0), cuda(1)}});
      },
      "to itself");
  // A map to a worker that is not in the job.
  expect_init_fails(
      [](int rank, RpcOptions& o) {
        pretend_two_devices();
        if (rank == 1) o.set_device_map("worker7", {{cuda(0), cuda(1)}});
      },
      "not a worker of this job");
}

// ---- CUDA IPC (src/memory/cuda_ipc.hpp): everything but the copies ------------------------------------------------------

namespace {
// A CUDA IPC entry as a sender writes it: float, 1 dim of `numel`, on device 1, lent as `ref`.
std::string ipc_entry(const cd::CudaIpcRef& ref, std::int64_t numel = 6,
                      std::uint8_t flags = cd::kTensorOnDevice | cd::kTensorCudaIpc) {
  std::string meta;
  Writer w(meta);
  w.put(static_cast<std::uint8_t>(at::kFloat));
  w.put(std::uint8_t{1});
  w.put(numel);
  w.put(std::int64_t{1});
  w.put(flags);
  if (flags & cd::kTensorOnDevice) w.put(std::int8_t{1});
  w.put(static_cast<std::uint64_t>(numel * 4));
  cd::write_cuda_ipc_ref(meta, ref);
  return meta;
}
cd::CudaIpcRef some_ref() {
  cd::CudaIpcRef ref;
  ref.id = 42;
  for (std::size_t i = 0; i < ref.memory.size(); ++i) ref.memory[i] = static_cast<char>(i * 3 + 1);
  for (std::size_t i = 0; i < ref.event.size(); ++i) ref.event[i] = static_cast<char>(255 - i);
  ref.offset = 512;
  ref.allocation_bytes = 2 << 20;
  return ref;
}
std::size_t float_size(std::uint8_t dtype) { return dtype == static_cast<std::uint8_t>(at::kFloat) ? 4 : 0; }
bool any_differentiable(std::uint8_t) { return true; }
constexpr cd::DtypeRules kFloatOnly{&float_size, &any_differentiable};

// Counts how many of the loans it made were released.
struct Released {
  std::shared_ptr<std::atomic<int>> n = std::make_shared<std::atomic<int>>(0);
  std::shared_ptr<void> loan() const {
    auto counter = n;
    return std::shared_ptr<void>(new int(0), [counter](void* p) {
      delete static_cast<int*>(p);
      ++*counter;
    });
  }
};
}  // namespace

TEST_CASE("CUDA IPC: a pair uses it only when both can and share a host") {
  DOCTEST_CHECK(cd::cuda_ipc_agreed(true, "boot/net", true, "boot/net"));
  DOCTEST_CHECK_FALSE(cd::cuda_ipc_agreed(false, "boot/net", true, "boot/net"));  // we cannot
  DOCTEST_CHECK_FALSE(cd::cuda_ipc_agreed(true, "boot/net", false, "boot/net"));  // they cannot
  DOCTEST_CHECK_FALSE(cd::cuda_ipc_agreed(true, "boot/net", true, "other/net"));  // across hosts
  DOCTEST_CHECK_FALSE(cd::cuda_ipc_agreed(true, "boot/net", true, "boot/net2"));  // another network namespace
  DOCTEST_CHECK_FALSE(cd::cuda_ipc_agreed(true, "", true, ""));                   // unknown hosts are not one host
  // What a worker announces: RpcOptions::cuda_ipc, which CORPC_CUDA_IPC=0 turns off unless the program set it.
  ::unsetenv("CORPC_CUDA_IPC");
  DOCTEST_CHECK(cd::with_environment(RpcOptions{}).cuda_ipc);
  ::setenv("CORPC_CUDA_IPC", "0", 1);
  DOCTEST_CHECK_FALSE(cd::with_environment(RpcOptions{}).cuda_ipc);
  ::unsetenv("CORPC_CUDA_IPC");
  // The Hello carries it, and a Hello of the previous protocol is refused.
  cd::Hello h;
  h.self = WorkerInfo{"w1", 1, "127.0.0.1", 1234};
  h.host = "boot/net";
  h.cuda_ipc = true;
  const std::string bytes = cd::encode_hello(h);
  DOCTEST_CHECK(cd::decode_hello(bytes.data(), bytes.size()).cuda_ipc);
  h.cuda_ipc = false;
  const std::string off = cd::encode_hello(h);
  DOCTEST_CHECK_FALSE(cd::decode_hello(off.data(), off.size()).cuda_ipc);
  DOCTEST_CHECK_THROWS_AS(cd::decode_hello(bytes.data(), bytes.size() - 1), ProtocolError);
  h.version = 4;
  const std::string old = cd::encode_hello(h);
  DOCTEST_CHECK_THROWS_AS(cd::decode_hello(old.data(), old.size()), ProtocolError);
}

TEST_CASE("CUDA IPC metadata: round-trips; refused from a peer that did not agree; malformed is ProtocolError") {
  const cd::CudaIpcRef ref = some_ref();
  const std::string meta = ipc_entry(ref);
  // Accepted: the entry's bytes are not in the frame (total 0), its reference comes back whole.
  auto table = cd::parse_tensor_meta(meta.data(), meta.size(), 1, 0, WireLimits{}, kFloatOnly, true);
  DOCTEST_REQUIRE(table.size() == 1);
  DOCTEST_REQUIRE(table[0].ipc);
  DOCTEST_CHECK(table[0].device == 1);
  DOCTEST_CHECK(table[0].nbytes == 24);
  DOCTEST_CHECK(table[0].wire_bytes() == 0);
  DOCTEST_CHECK(table[0].ipc->id == ref.id);
  DOCTEST_CHECK(table[0].ipc->memory == ref.memory);
  DOCTEST_CHECK(table[0].ipc->event == ref.event);
  DOCTEST_CHECK(table[0].ipc->offset == ref.offset);
  DOCTEST_CHECK(table[0].ipc->allocation_bytes == ref.allocation_bytes);
  // Announcing its 24 bytes as frame data is a mismatch: they never travel.
  DOCTEST_CHECK_THROWS_AS(cd::parse_tensor_meta(meta.data(), meta.size(), 1, 24, WireLimits{}, kFloatOnly, true),
                          ProtocolError);
  // A receiver that did not agree to CUDA IPC refuses the entry, however well formed.
  DOCTEST_CHECK_THROWS_WITH_AS(cd::parse_tensor_meta(meta.data(), meta.size(), 1, 0, WireLimits{}, kFloatOnly, false),
                               doctest::Contains("did not agree"), ProtocolError);
  DOCTEST_CHECK_THROWS_AS(corpc::detail::decode_tensor_meta(meta.data(), meta.size(), 1, 0, WireLimits{}),
                          ProtocolError);
  std::vector<std::int8_t> devices;
  DOCTEST_CHECK_THROWS_AS(corpc::detail::decode_tensor_meta(meta.data(), meta.size(), 1, 0, WireLimits{}, &devices),
                          ProtocolError);
  // Truncated anywhere, or with bytes left over: ProtocolError.
  for (std::size_t cut = 0; cut < meta.size(); ++cut)
    DOCTEST_CHECK_THROWS_AS(cd::parse_tensor_meta(meta.data(), cut, 1, 0, WireLimits{}, kFloatOnly, true),
                            ProtocolError);
  const std::string longer = meta + "x";
  DOCTEST_CHECK_THROWS_AS(cd::parse_tensor_meta(longer.data(), longer.size(), 1, 0, WireLimits{}, kFloatOnly, true),
                          ProtocolError);
  // Lent without a device to deliver on; unknown flags.
  const std::string no_device = ipc_entry(ref, 6, cd::kTensorCudaIpc);
  DOCTEST_CHECK_THROWS_AS(
      cd::parse_tensor_meta(no_device.data(), no_device.size(), 1, 0, WireLimits{}, kFloatOnly, true), ProtocolError);
  const std::string unknown = ipc_entry(ref, 6, cd::kTensorOnDevice | cd::kTensorCudaIpc | 64);
  DOCTEST_CHECK_THROWS_AS(cd::parse_tensor_meta(unknown.data(), unknown.size(), 1, 0, WireLimits{}, kFloatOnly, true),
                          ProtocolError);
  // The tensor must lie inside the allocation it names (the receiver copies exactly that range of the mapping).
  auto outside = [&](std::uint64_t offset, std::uint64_t allocation, std::int64_t numel) {
    cd::CudaIpcRef r = ref;
    r.offset = offset;
    r.allocation_bytes = allocation;
    const std::string m = ipc_entry(r, numel);
    return cd::parse_tensor_meta(m.data(), m.size(), 1, 0, WireLimits{}, kFloatOnly, true);
  };
  DOCTEST_CHECK_NOTHROW(outside(1000, 1024, 6));  // exactly at the end
  DOCTEST_CHECK_THROWS_AS(outside(1001, 1024, 6), ProtocolError);
  DOCTEST_CHECK_THROWS_AS(outside(0, 0, 6), ProtocolError);
  DOCTEST_CHECK_THROWS_AS(outside(~std::uint64_t{0} - 8, ~std::uint64_t{0}, 6), ProtocolError);  // wraps around
  DOCTEST_CHECK_THROWS_AS(outside(2048, 1024, 6), ProtocolError);
  // Beside a tensor whose bytes do travel, only those count towards the frame's total.
  std::string mixed = meta;
  {
    Writer w(mixed);
    w.put(static_cast<std::uint8_t>(at::kFloat));
    w.put(std::uint8_t{1});
    w.put(std::int64_t{3});
    w.put(std::int64_t{1});
    w.put(std::uint8_t{0});
    w.put(std::uint64_t{12});
  }
  DOCTEST_CHECK(cd::parse_tensor_meta(mixed.data(), mixed.size(), 2, 12, WireLimits{}, kFloatOnly, true).size() == 2);
  DOCTEST_CHECK_THROWS_AS(cd::parse_tensor_meta(mixed.data(), mixed.size(), 2, 36, WireLimits{}, kFloatOnly, true),
                          ProtocolError);
  // As the transport decodes it: a placeholder without bytes, its device recorded, its entry handed to the runtime.
  std::shared_ptr<cd::CudaIpcArrivals> arrivals;
  devices.clear();
  auto tensors =
      corpc::detail::decode_tensor_meta(mixed.data(), mixed.size(), 2, 12, WireLimits{}, &devices, &arrivals);
  DOCTEST_REQUIRE(tensors.size() == 2);
  DOCTEST_CHECK(tensors[0].nbytes() == 0);
  DOCTEST_CHECK(tensors[0].dim() == 1);
  DOCTEST_CHECK(tensors[1].nbytes() == 12);
  DOCTEST_CHECK((devices == std::vector<std::int8_t>{1, -1}));
  DOCTEST_REQUIRE(arrivals);
  DOCTEST_REQUIRE(arrivals->tensors.size() == 1);
  DOCTEST_CHECK(arrivals->tensors[0].first == 0);
  DOCTEST_CHECK((arrivals->ids() == std::vector<std::uint64_t>{42}));
  // A frame without IPC entries leaves the arrivals null even where they would be accepted.
  arrivals.reset();
  const std::string plain = mixed.substr(meta.size());
  corpc::detail::decode_tensor_meta(plain.data(), plain.size(), 1, 12, WireLimits{}, &devices, &arrivals);
  DOCTEST_CHECK(!arrivals);
}

TEST_CASE("CUDA IPC loans: kept until the peer returns them, the connection is lost, or their frame is dropped") {
  Released released;
  std::vector<std::string> reports;
  auto link = std::make_shared<cd::CudaIpcLink>([&](const std::string& why) { reports.push_back(why); });
  DOCTEST_CHECK(link->lending());
  const auto a = link->lend(released.loan());
  const auto b = link->lend(released.loan());
  const auto c = link->lend(released.loan());
  DOCTEST_CHECK((a != b && b != c && a != c));
  DOCTEST_CHECK(link->on_loan() == 3);
  link->returned({b, 12345});  // an unknown id is ignored
  DOCTEST_CHECK(*released.n == 1);
  link->returned({b});  // returned twice: nothing more
  DOCTEST_CHECK(*released.n == 1);
  // A frame's loans go back when the frame is dropped before the connection takes it; committed ones stay out.
  {
    auto dropped = std::make_shared<cd::CudaIpcLoans>(link);
    dropped->add(link->lend(released.loan()), 8);
    auto sent = std::make_shared<cd::CudaIpcLoans>(link);
    sent->add(link->lend(released.loan()), 8);
    sent->commit();
  }
  DOCTEST_CHECK(*released.n == 2);
  DOCTEST_CHECK(link->on_loan() == 3);  // a, c and the committed one
  // Lending failures: once reported; a per-tensor one leaves lending on, a lasting one turns it off.
  link->lending_failed("not from the caching allocator", false);
  DOCTEST_CHECK(link->lending());
  link->lending_failed("cudaIpcGetMemHandle: not supported", true);
  DOCTEST_CHECK_FALSE(link->lending());
  DOCTEST_CHECK(reports.size() == 1);
  // Borrowing: a handle is opened once and kept; a failure asks the peer to stop.
  int opened = 0;
  auto open = [&] {
    ++opened;
    return released.loan();
  };
  cd::CudaIpcHandle h1{}, h2{};
  h2[0] = 1;
  auto m1 = link->mapping(h1, open);
  DOCTEST_CHECK(link->mapping(h1, open) == m1);
  link->mapping(h2, open);
  DOCTEST_CHECK(opened == 2);
  DOCTEST_CHECK_THROWS_AS(
      link->mapping(cd::CudaIpcHandle{'x'}, []() -> std::shared_ptr<void> { throw RpcError("refused"); }), RpcError);
  DOCTEST_CHECK_FALSE(link->ask_peer_to_stop());
  link->borrowing_failed("cudaIpcOpenMemHandle: invalid handle");
  DOCTEST_CHECK(link->ask_peer_to_stop());
  // The connection is lost: every loan and mapping is released (a mapping still used by a copy stays until it ends).
  const int before = *released.n;
  link->close();
  DOCTEST_CHECK(*released.n == before + 3 + 1);  // a, c, the committed loan; h2's mapping (m1 is still held here)
  m1.reset();
  DOCTEST_CHECK(*released.n == before + 5);
  DOCTEST_CHECK(link->closed());
  DOCTEST_CHECK_FALSE(link->lending());
  link->lend(released.loan());  // after the loss: released at once
  DOCTEST_CHECK(*released.n == before + 6);
  DOCTEST_CHECK(link->on_loan() == 0);
}

// Without a GPU the staging copy itself fails (typed); what matters here is that nothing was lent.
TEST_CASE("CUDA IPC: a tensor that cannot be lent is staged instead (no CUDA libtorch here, or not its allocator's)" *
          doctest::skip(g_gpu)) {
  auto link = std::make_shared<cd::CudaIpcLink>();
  std::string meta;
  std::uint64_t total = 0;
  std::shared_ptr<cd::DeviceTransfer> staged;
  std::shared_ptr<cd::CudaIpcLoans> lent;
  DOCTEST_CHECK_THROWS_AS(corpc::detail::encode_tensor_meta({labelled_cuda(at::ones({4}), 0)}, meta, total,
                                                            {{cuda(0), cuda(0)}}, "w1", &staged, link, &lent),
                          RpcError);
  DOCTEST_CHECK(!lent);
  DOCTEST_CHECK(link->on_loan() == 0);
}

TEST_CASE("CUDA IPC: lent bytes count against the receiver's tensor limit, as if they travelled") {
  auto link = std::make_shared<cd::CudaIpcLink>();
  corpc::detail::OutFrame f;
  f.head.tensor_bytes = 600;
  f.lent = std::make_shared<cd::CudaIpcLoans>(link);
  f.lent->add(link->lend(std::make_shared<int>(0)), 500);
  WireLimits limits;
  limits.max_tensor_bytes = 1000;
  DOCTEST_CHECK_THROWS_AS(corpc::detail::check_limits(f, limits, "w1"), MessageTooLargeError);
  limits.max_tensor_bytes = 1100;
  DOCTEST_CHECK_NOTHROW(corpc::detail::check_limits(f, limits, "w1"));
  f = corpc::detail::OutFrame{};  // dropped before it was sent: its loan goes back
  DOCTEST_CHECK(link->on_loan() == 0);
}

TEST_CASE("CUDA IPC: IpcDone bodies round-trip; malformed ones are ProtocolError") {
  const cd::IpcDone done{true, {1, 2, 0xffffffffffffull}};
  const std::string body = cd::encode_ipc_done(done);
  const cd::IpcDone back = cd::decode_ipc_done(body.data(), body.size());
  DOCTEST_CHECK(back.stop_lending);
  DOCTEST_CHECK((back.ids == done.ids));
  DOCTEST_CHECK(cd::decode_ipc_done(cd::encode_ipc_done({}).data(), 5).ids.empty());
  for (std::size_t cut = 0; cut < body.size(); ++cut)
    DOCTEST_CHECK_THROWS_AS(cd::decode_ipc_done(body.data(), cut), ProtocolError);
  DOCTEST_CHECK_THROWS_AS(cd::decode_ipc_done((body + "x").data(), body.size() + 1), ProtocolError);
  std::string bad_flag = body;
  bad_flag[0] = 2;
  DOCTEST_CHECK_THROWS_AS(cd::decode_ipc_done(bad_flag.data(), bad_flag.size()), ProtocolError);
  std::string huge_count = body;
  huge_count[1] = huge_count[2] = huge_count[3] = huge_count[4] = '\xff';
  DOCTEST_CHECK_THROWS_AS(cd::decode_ipc_done(huge_count.data(), huge_count.size()), ProtocolError);
}

namespace {
int plus_one(int x) { return x + 1; }
// Writes `frame` (a header, then `meta`) to worker 1 on a raw authenticated connection; true if it hung up.
bool worker1_hangs_up_on(corpc::detail::FrameHeader h, const std::string& meta, const std::string& body = {}) {
  asio::io_context io;
  auto s = authenticated_socket(io, get_worker_info(1));
  h.meta_len = static_cast<std::uint32_t>(meta.size());
  h.body_len = static_cast<std::uint32_t>(body.size());
  std::string bytes(reinterpret_cast<const char*>(&h), sizeof h);
  bytes += meta;
  bytes += body;
  asio::error_code ec;
  asio::write(s, asio::buffer(sealed(s, bytes)), ec);
  return hung_up(s);
}
}  // namespace

TEST_CASE("CUDA IPC on the wire: a worker that did not agree hangs up on IPC entries and IpcDone, and carries on") {
  run_world(2, [](int rank) {
    if (rank != 0) return;
    // A request with a tensor lent by CUDA IPC, on a connection that never agreed to it (no Hello, no channel).
    corpc::detail::FrameHeader request;
    request.kind = corpc::detail::FrameKind::Request;
    request.id = 1;
    request.num_tensors = 1;
    request.tensor_bytes = 0;
    EXPECT(worker1_hangs_up_on(request, ipc_entry(some_ref())));
    // An IpcDone frame where nothing was lent.
    corpc::detail::FrameHeader done;
    done.kind = corpc::detail::FrameKind::IpcDone;
    EXPECT(worker1_hangs_up_on(done, {}, cd::encode_ipc_done({false, {1}})));
    EXPECT(Runtime::get().is_alive(1));
    EXPECT_EQ(rpc_sync<&plus_one>(1, 41), 42);
  });
}

// On a GPU: the master's cuda:0 goes to worker1's cuda:0 (one device is enough), the echo comes back on cuda:0 with
// the same bytes, for a contiguous and a transposed layout. Skipped without a CUDA device (these machines): the CUDA
// copies are compiled here, not run.
bool on_cuda0(at::Tensor t) { return t.device() == cuda(0); }

TEST_CASE(
    "device maps with a GPU (skipped without one): tensors arrive on the mapped device, the reply on the original" *
    doctest::skip(!g_gpu)) {
  launch_processes(
      2,
      [](int rank) {
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
      },
      launch_options(120s, 10s));
}

// On a GPU, between two workers on this host: CUDA tensors are lent by CUDA IPC where this corpc can (a CUDA build of
// libtorch), and staged through host memory where it cannot or CORPC_CUDA_IPC=0 says not to; the bytes arrive the
// same either way, requests and replies, a view at an offset inside its allocation included, and every loan comes
// back. Skipped without a CUDA device (these machines).
std::vector<std::uint64_t> ipc_counts() {
  auto& c = cd::cuda_ipc_counters();
  return {c.lent.load(), c.returned.load(), c.borrowed.load(), c.refused.load()};
}

TEST_CASE("CUDA IPC with a GPU (skipped without one): lent where it can be, staged otherwise, the same bytes arrive" *
          doctest::skip(!g_gpu)) {
  for (const char* setting : {"1", "0"}) {
    ::setenv("CORPC_CUDA_IPC", setting, 1);  // inherited by the ranks
    launch_processes(
        2,
        [&](int rank) {
          auto options = quick_options();
          if (rank == 0) options.set_device_map("worker1", {{cuda(0), cuda(0)}});
          init_rpc(worker_name(rank), rank, 2, options);
          if (rank == 0) {
            const bool lends = cd::cuda::ipc_capable() && std::string(setting) == "1";
            const auto before = ipc_counts();
            // IPC rides on the same-host channel, set up just after the Hellos alongside the first calls: call until a
            // tensor was lent (once, where none can be).
            const auto deadline = std::chrono::steady_clock::now() + 20s;
            const at::Tensor probe = cd::cuda::copy_to_device(at::ones({4}), 0);
            do {
              EXPECT(std::chrono::steady_clock::now() < deadline);
              rpc_sync<&echo>("worker1", probe);
            } while (lends && ipc_counts()[0] == before[0]);
            const auto start = ipc_counts();
            at::Tensor host = at::arange(1 << 20, at::kFloat).reshape({1024, 1024});
            at::Tensor dev = cd::cuda::copy_to_device(host, 0);
            for (const at::Tensor& d : {dev, dev.t(), dev.narrow(0, 3, 100)}) {
              EXPECT(rpc_sync<&on_cuda0>("worker1", d));
              at::Tensor back = rpc_sync<&echo>("worker1", d);
              EXPECT(back.device() == cuda(0));
              EXPECT(at::equal(cd::cuda::copy_to_host(back), cd::cuda::copy_to_host(d)));
            }
            const auto after = ipc_counts();
            if (lends) {
              EXPECT(after[0] - start[0] == 6);  // every request's tensor
              EXPECT(after[2] - start[2] == 3);  // every echo's, lent back
              EXPECT(after[3] == before[3]);     // nothing refused
            } else {
              EXPECT(after[0] == before[0] && after[2] == before[2]);
            }
            EXPECT(after[1] - before[1] == after[0] - before[0]);  // every loan returned (IpcDone precedes each reply)
          }
          shutdown(true);
        },
        launch_options(120s, 10s));
  }
  ::unsetenv("CORPC_CUDA_IPC");
}

TEST_CASE("the environment fills the options a program left at their defaults, and nothing it set") {
  struct Restore {
    ~Restore() {
      for (const char* v : {"CORPC_SECRET", "CORPC_TRACE", "CORPC_SAME_HOST_CHANNEL", "CORPC_TLS_CERT", "CORPC_TLS_KEY",
                            "CORPC_TLS_CA", "CORPC_TLS_VERIFY"})
        ::unsetenv(v);
    }
  } restore;
  ::setenv("CORPC_SECRET", "from-env", 1);
  ::setenv("CORPC_TRACE", "/tmp/env-trace.json", 1);
  ::setenv("CORPC_SAME_HOST_CHANNEL", "0", 1);
  ::setenv("CORPC_TLS_CERT", "cert.pem", 1);
  ::setenv("CORPC_TLS_KEY", "key.pem", 1);
  ::setenv("CORPC_TLS_VERIFY", "0", 1);
  const RpcOptions filled = cd::with_environment(RpcOptions{});
  DOCTEST_CHECK(filled.secret == "from-env");
  DOCTEST_CHECK(filled.trace_path == "/tmp/env-trace.json");
  DOCTEST_CHECK_FALSE(filled.same_host_channel);
  DOCTEST_REQUIRE(filled.tls.has_value());
  DOCTEST_CHECK(filled.tls->certificate_chain_file == "cert.pem");
  DOCTEST_CHECK(filled.tls->private_key_file == "key.pem");
  DOCTEST_CHECK_FALSE(filled.tls->verify_peer);

  RpcOptions set;
  set.secret = "from-program";
  set.trace_path = "/tmp/program-trace.json";
  set.tls = TlsOptions{};
  set.tls->certificate_chain_file = "program.pem";
  const RpcOptions kept = cd::with_environment(set);
  DOCTEST_CHECK(kept.secret == "from-program");
  DOCTEST_CHECK(kept.trace_path == "/tmp/program-trace.json");
  DOCTEST_CHECK(kept.tls->certificate_chain_file == "program.pem");
  DOCTEST_CHECK(kept.tls->verify_peer);
  // A switch the program turned off stays off whatever the environment says.
  ::setenv("CORPC_SAME_HOST_CHANNEL", "1", 1);
  RpcOptions off;
  off.same_host_channel = false;
  DOCTEST_CHECK_FALSE(cd::with_environment(off).same_host_channel);
}

TEST_CASE("a launcher variable that is not a number is a UsageError naming it, not rank 0") {
  const char* saved = std::getenv("RANK");
  const std::string before = saved ? saved : "";
  ::setenv("RANK", "abc", 1);
  DOCTEST_CHECK_THROWS_WITH_AS(cd::rank_from_environment(), "RANK='abc' is not a number", UsageError);
  ::setenv("RANK", "3", 1);
  DOCTEST_CHECK(cd::rank_from_environment() == 3);
  if (saved) ::setenv("RANK", before.c_str(), 1);
  else ::unsetenv("RANK");
}

// The launchers' variables (rpc/environment.hpp), in process: Slurm's node list as `scontrol show hostnames` reads it,
// which launcher's rank wins when several are set, and rank 0's address and port under Slurm without MASTER_*.
TEST_CASE("launcher variables: Slurm's node list and job id give rank 0's address and port; Open MPI's rank wins") {
  DOCTEST_CHECK(cd::first_slurm_host("node1") == "node1");
  DOCTEST_CHECK(cd::first_slurm_host("node[1-2]") == "node1");
  DOCTEST_CHECK(cd::first_slurm_host("n[01-04,7],login1") == "n01");
  DOCTEST_CHECK(cd::first_slurm_host("n[7,1-4]") == "n7");
  DOCTEST_CHECK(cd::first_slurm_host("r[1-2]n[3-4]-ib,x") == "r1n3-ib");
  DOCTEST_CHECK(cd::first_slurm_host("a-b,c[1-2]") == "a-b");
  DOCTEST_CHECK_THROWS_AS(cd::first_slurm_host("node[1-2"), UsageError);

  const char* const vars[] = {"RANK",
                              "WORLD_SIZE",
                              "MASTER_ADDR",
                              "MASTER_PORT",
                              "SLURM_PROCID",
                              "SLURM_NTASKS",
                              "SLURM_STEP_NODELIST",
                              "SLURM_JOB_NODELIST",
                              "SLURM_NODELIST",
                              "SLURM_JOB_ID",
                              "SLURM_JOBID",
                              "SLURM_STEP_ID",
                              "SLURM_STEPID",
                              "SLURM_STEP_RESV_PORTS",
                              "OMPI_COMM_WORLD_RANK",
                              "OMPI_COMM_WORLD_SIZE",
                              "PMI_RANK",
                              "PMI_SIZE"};
  struct Saved {
    std::vector<std::pair<std::string, std::optional<std::string>>> values;
    ~Saved() {
      for (auto& [name, value] : values) {
        if (value) ::setenv(name.c_str(), value->c_str(), 1);
        else ::unsetenv(name.c_str());
      }
    }
  } saved;
  for (const char* v : vars) {
    const char* value = std::getenv(v);
    saved.values.emplace_back(v, value ? std::optional<std::string>(value) : std::nullopt);
    ::unsetenv(v);
  }
  DOCTEST_CHECK(cd::rank_from_environment() == -1);
  DOCTEST_CHECK(cd::master_address_from_environment().empty());
  DOCTEST_CHECK(cd::master_port_from_environment() == -1);

  ::setenv("SLURM_PROCID", "2", 1);
  ::setenv("SLURM_NTASKS", "4", 1);
  ::setenv("SLURM_JOB_NODELIST", "c[3-4]", 1);
  ::setenv("SLURM_STEP_NODELIST", "c[4-5]", 1);
  ::setenv("SLURM_JOB_ID", "1234", 1);
  ::setenv("SLURM_STEP_ID", "3", 1);
  DOCTEST_CHECK(cd::rank_from_environment() == 2);
  DOCTEST_CHECK(cd::world_size_variable() == "SLURM_NTASKS");
  DOCTEST_CHECK(cd::master_address_from_environment() == "c4");  // the step's list before the job's
  DOCTEST_CHECK(cd::master_port_from_environment() == 20000 + 2343);
  ::setenv("SLURM_STEP_RESV_PORTS", "12000-12003", 1);
  DOCTEST_CHECK(cd::master_port_from_environment() == 12000);
  ::unsetenv("SLURM_STEP_NODELIST");
  DOCTEST_CHECK(cd::master_address_from_environment() == "c3");  // a batch script: the job's
  ::setenv("MASTER_ADDR", "head", 1);
  ::setenv("MASTER_PORT", "29500", 1);
  DOCTEST_CHECK(cd::master_address_from_environment() == "head");
  DOCTEST_CHECK(cd::master_port_from_environment() == 29500);
  ::unsetenv("MASTER_ADDR");
  ::unsetenv("MASTER_PORT");

  // mpirun in a Slurm batch script: Open MPI's rank, and no address from Slurm's list (task 0 is not mpirun's rank 0).
  ::setenv("OMPI_COMM_WORLD_RANK", "1", 1);
  ::setenv("OMPI_COMM_WORLD_SIZE", "3", 1);
  DOCTEST_CHECK(cd::rank_from_environment() == 1);
  DOCTEST_CHECK(cd::world_size_from_environment() == 3);
  DOCTEST_CHECK(cd::world_size_variable() == "OMPI_COMM_WORLD_SIZE");
  DOCTEST_CHECK(cd::master_address_from_environment().empty());
  DOCTEST_CHECK(cd::master_port_from_environment() == -1);
  ::setenv("RANK", "0", 1);  // torchrun's, corpcrun's or a user's own first
  ::setenv("WORLD_SIZE", "2", 1);
  DOCTEST_CHECK(cd::rank_variable() == "RANK");
  DOCTEST_CHECK(cd::world_size_from_environment() == 2);
}

}  // namespace test_device_map
