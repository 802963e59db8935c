/// @file
/// RemoteModule<M>: a torch::nn module built and run on another worker.
///
/// ```cpp
///   corpc::RemoteModule<torch::nn::Linear> lin("worker1/cpu", 4, 2);    // constructed on worker1, on its CPU
///   at::Tensor y = lin.forward(x);                                       // or co_await lin.forward_async(x)
///   auto z = co_await lin.forward_async(corpc::with_timeout(100ms), x);  // TimeoutError if no answer in 100 ms
///   std::vector<corpc::RRef<at::Tensor>> ps = lin.remote_parameters();  // for DistributedOptimizer
///   auto same = co_await lin.remote_parameters_async();                 // the awaitable form
///   corpc::rpc_async<&train>("trainer1", lin);                           // share it: the trainer uses the same module
/// ```
///
/// Passing a RemoteModule to another worker (as an argument or a result) shares the module, not a copy: the receiver
/// gets a reference to the same object on the same owner, counted like any RRef (corpc/rref/context.hpp).
///
/// M is a module holder (torch::nn::Linear, or your TORCH_MODULE). Inputs are moved to the module's device on the
/// owner; results come back on the CPU. Forward calls run concurrently (modules are stateless in forward, apart from
/// BatchNorm's running statistics, which PyTorch also updates without a lock).
#pragma once

#include <torch/nn/module.h>

#include <string>
#include <utility>
#include <vector>

#include "corpc/rpc/worker_info.hpp"
#include "corpc/rref/rref.hpp"

namespace corpc {

namespace detail {

template <class M, class... A>
M build_module(std::string device, A... args) {
  M module(std::move(args)...);
  module->to(c10::Device(device));
  return module;
}

inline c10::Device module_device(const torch::nn::Module& m) {
  auto params = m.parameters();
  return params.empty() ? c10::Device(c10::kCPU) : params.front().device();
}

template <class T>
T to_device(T v, const c10::Device& d) {
  if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor>) return v.defined() ? v.to(d) : v;
  else return v;
}

// Runs on the owner. The module is named by its id, not by a reference passed along: a passed reference is a fork
// that the owner must confirm to the sender with a message of its own, one per call. The caller keeps its reference
// until the reply instead (RemoteModule::forward_async), so the module outlives the call all the same.
template <class M, class... A>
auto module_forward(RRefId module_id, A... args) -> Task<decltype(std::declval<M&>()->forward(std::declval<A>()...))> {
  auto slot = RRefContext::get()->slot(module_id);
  co_await slot->ready;
  M module = *slot_value<M>(*slot);
  const auto device = module_device(*module);
  co_return module->forward(to_device(std::move(args), device)...);
}

template <class M>
Task<std::vector<RRef<at::Tensor>>> module_parameters(RRef<M> ref) {
  M module = co_await ref.to_here();
  std::vector<RRef<at::Tensor>> out;
  for (auto& p : module->parameters()) out.emplace_back(p);  // owner references sharing the parameter's storage
  co_return out;
}

}  // namespace detail

/// A torch::nn module `M` (a module holder such as torch::nn::Linear) built and run on another worker (see
/// corpc/rref/remote_module.hpp). Copies, and RemoteModules passed to other workers, refer to the same module. Calls
/// return at once (the `_async` forms) or block (the others, which throw UsageError on a corpc I/O thread); errors are
/// those of rpc_async, plus the module constructor's error for every call after a failed creation.
template <class M>
class RemoteModule {
 public:
  /// `remote_device`: "worker/device", e.g. "worker1/cpu" or "worker1/cuda:0"; `args` go to M's constructor.
  template <class... A>
    requires(!detail::first_is_options<A...>)
  explicit RemoteModule(const std::string& remote_device, A&&... args)
      : RemoteModule(remote_device, CallOptions{}, std::forward<A>(args)...) {}
  /// The same with options for the creation (with_timeout(ms)): a creation that times out fails every later call.
  template <class... A>
  RemoteModule(const std::string& remote_device, const CallOptions& options, A&&... args) {
    auto [worker, device] = detail::split_remote_device(remote_device);
    device_ = device;
    module_ = remote<&detail::build_module<M, std::decay_t<A>...>>(worker, options, device, std::forward<A>(args)...);
  }

  /// Wraps a module already created on its owner (for example by remote<&make_my_module>(worker, seed)); `device` is
  /// only reported by device().
  explicit RemoteModule(RRef<M> module, std::string device = {})
      : module_(std::move(module)), device_(std::move(device)) {}

  /// forward([options,] args...) on the owner; options as for rpc_async (with_timeout(ms)).
  template <class... A>
    requires(!detail::first_is_options<A...>)
  auto forward_async(A&&... args) const { return forward_async(CallOptions{}, std::forward<A>(args)...); }
  /// As forward_async(args...), with per-call options. Returns a Future of what M's forward returns.
  template <class... A>
  auto forward_async(const CallOptions& options, A&&... args) const {
    constexpr auto forward_on_owner = &detail::module_forward<M, std::decay_t<A>...>;
    if (module_.state()->confirmed.has_error())  // as a proxy call: the creation's error, without asking the owner
      return make_exceptional_future<detail::ResultOf<forward_on_owner>>(module_.state()->confirmed.error());
    auto out =
        rpc_async<forward_on_owner>(module_.state()->owner, options, module_.state()->id, std::forward<A>(args)...);
    detail::on_ready_inline(out, [keep = module_] {});  // the reference lives until the reply (module_forward)
    return out;
  }
  /// `forward_async(args...).wait()`: blocks until the output arrives (on the CPU) and returns it.
  template <class... A>
  auto forward(A&&... args) const {
    return forward_async(std::forward<A>(args)...).wait();
  }

  /// References to the module's parameters, owned where the module is (what DistributedOptimizer takes).
  Future<std::vector<RRef<at::Tensor>>> remote_parameters_async(const CallOptions& options = {}) const {
    return rpc_async<&detail::module_parameters<M>>(module_.state()->owner, options, module_);
  }
  /// `remote_parameters_async(options).wait()`.
  std::vector<RRef<at::Tensor>> remote_parameters(const CallOptions& options = {}) const {
    return remote_parameters_async(options).wait();
  }
  /// The reference to the module itself (for proxy calls of your own: `module_rref().rpc_async<&f>(...)`).
  const RRef<M>& module_rref() const noexcept { return module_; }
  /// The device part of the `remote_device` given ("cpu", "cuda:0").
  const std::string& device() const noexcept { return device_; }

 private:
  RRef<M> module_;
  std::string device_;
};

/// @cond INTERNAL
// Shares the module: the receiver's RemoteModule refers to the same object (a fork of the same RRef).
template <class M>
struct Codec<RemoteModule<M>> {
  static void write(Writer& w, const RemoteModule<M>& m) {
    w.put(m.module_rref());
    w.put(m.device());
  }
  static RemoteModule<M> read(Reader& r) {
    auto module = r.get<RRef<M>>();
    return RemoteModule<M>(std::move(module), r.get<std::string>());
  }
};
/// @endcond

}  // namespace corpc
