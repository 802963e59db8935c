/// @file
/// Distributed autograd: backward passes that cross workers.
///
/// ```cpp
///   {
///     corpc::dist_autograd::Context ctx;            // one per iteration; current until it is destroyed
///     auto out = co_await model.forward(x);          // RPCs inside carry the context
///     std::vector<at::Tensor> roots{loss_fn(out)};   // named first: GCC 12.2 miscompiles a braced list in co_await
///     co_await ctx.backward(roots);                  // runs on every worker the forward touched
///     co_await optimizer.step(ctx);                  // corpc::DistributedOptimizer
///   }                                                // released on every worker it touched
/// ```
///
/// Inside a context, every RPC (arguments, results, to_here, RRef proxies) whose tensors require grad records a *send*
/// function on the sender and a *recv* function (the received tensors' grad_fn) on the receiver, paired by a message id
/// unique across workers. `backward` (FAST mode) runs the local engine from the roots; each recv function's gradient is
/// shipped to its sender, which continues from the matching send function, and so on. It completes when every worker
/// involved has finished, and fails (on the caller) if any of them fails.
///
/// Gradients accumulate per context and per worker (several backward passes in one context add up); `.grad` is never
/// touched. Each worker keeps its part of the graph until the context is released, so repeated backward passes within
/// one context always work (`retain_graph` is accepted for parity with PyTorch and has no further effect).
///
/// The context follows its coroutine across threads (corpc/core/call_context.hpp). Code that is not a coroutine and
/// hands work to other threads passes `ctx.id()` and opens a `ContextScope` there.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <unordered_map>
#include <vector>

#include "corpc/core/call_context.hpp"
#include "corpc/core/future.hpp"
#include "corpc/rpc/worker_info.hpp"

namespace corpc::dist_autograd {

/// Hashes a tensor by identity (its TensorImpl), not by value: GradientMap's key hash.
struct TensorIdentityHash {
  /// The hash of `t`'s TensorImpl pointer.
  std::size_t operator()(const at::Tensor& t) const noexcept {
    return std::hash<const void*>()(t.unsafeGetTensorImpl());
  }
};
/// Compares tensors by identity (`is_same`): GradientMap's key equality.
struct TensorIdentityEqual {
  /// True if `a` and `b` are the same tensor.
  bool operator()(const at::Tensor& a, const at::Tensor& b) const noexcept { return a.is_same(b); }
};
/// Leaf tensor -> its gradient in one context.
using GradientMap = std::unordered_map<at::Tensor, at::Tensor, TensorIdentityHash, TensorIdentityEqual>;

namespace detail {
// The CallContext slot holding the current distributed autograd context id (-1: none).
int context_slot();
// The calling coroutine's CallContext with the autograd context set to `id`.
CallContext with_context(std::int64_t id);
}  // namespace detail

/// The distributed autograd context current in the calling coroutine, or -1.
std::int64_t current_context_id();

/// One distributed autograd context (one training iteration), as `with dist_autograd.context()` in PyTorch. It is
/// current in the creating coroutine from construction to destruction: RPCs issued meanwhile (after any number of
/// co_awaits, on whatever thread) carry it. Not copyable or movable: create it on the stack of the coroutine or
/// function that runs the iteration. Needs a running runtime (ShutdownError otherwise).
class Context {
 public:
  /// Opens a new context with an id unique across the job and makes it current.
  Context();
  /// Restores the previous context and releases this one here and, in the background, on every worker it touched.
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  /// The id, unique across workers; pass it to code that runs outside this coroutine (ContextScope).
  std::int64_t id() const noexcept { return id_; }
  /// dist_autograd::backward(id(), roots, retain_graph).
  Future<void> backward(std::vector<at::Tensor> roots, bool retain_graph = false) const;
  /// The same from one root, the usual loss: `co_await ctx.backward(loss)` (GCC 12 miscompiles a braced list
  /// inside `co_await`, so `co_await ctx.backward({loss})` fails to build there).
  Future<void> backward(const at::Tensor& root, bool retain_graph = false) const {
    return backward(std::vector<at::Tensor>{root}, retain_graph);
  }
  /// This worker's gradients in this context (get_gradients(id())).
  GradientMap gradients() const;

 private:
  std::int64_t id_;
  CallContextScope scope_;
};

/// Makes context `id` current (for code that received the id explicitly).
class ContextScope {
 public:
  /// Makes context `id` current on the calling thread (the running coroutine) until the scope is destroyed.
  explicit ContextScope(std::int64_t id) : scope_(detail::with_context(id)) {}

 private:
  CallContextScope scope_;
};

/// Runs a backward pass from `roots` (each seeded with ones: pass the scalar losses) through context `context_id`'s
/// graph on every worker its RPCs touched (FAST mode, see corpc/autograd/dist_autograd.hpp); gradients accumulate in
/// the context on each worker, never in `.grad`. Completes when every worker involved has finished. Fails, on the
/// future, with UsageError if the context is not alive here or a root does not require grad, or with the first error of
/// any worker's part (ConnectionError if one died). `retain_graph` is accepted for parity; graphs are kept until the
/// context is released anyway.
Future<void> backward(std::int64_t context_id, std::vector<at::Tensor> roots, bool retain_graph = false);
GradientMap get_gradients(std::int64_t context_id);  ///< this worker's gradients in that context (empty if none)

/// For layers that hook a leaf's gradient accumulator (DistributedDataParallel does). A distributed backward pass does
/// not run the leaves' AccumulateGrad nodes (their gradients go to the context, not to .grad); as PyTorch's
/// distributed engine does, it runs their post hooks instead, right after adding each leaf's gradient to the context,
/// with these available inside the hook:
namespace leaf_hooks {
/// The context whose pass runs the calling hook on this thread; -1 inside an ordinary (local) backward.
std::int64_t pass_context_id();
/// Runs `fn` when this worker's current local pass has run the hooks of all its leaves (the distributed counterpart of
/// autograd's Engine::queue_callback). An exception from `fn` fails the backward pass. Throws UsageError outside a
/// leaf hook of a distributed pass.
void at_end_of_pass(std::function<void()> fn);
/// Leaf's gradient in context `context_id` (undefined if none, or if the context is not alive here).
at::Tensor gradient(std::int64_t context_id, const at::Tensor& leaf);
/// Replaces leaf's gradient in context `context_id`; UsageError if the context is not alive here.
void set_gradient(std::int64_t context_id, const at::Tensor& leaf, at::Tensor grad);
}  // namespace leaf_hooks

/// The distributed-autograd contexts alive on this worker: a leak check (a context outlives its iteration when nothing
/// released it, and holds its graph and gradients until then).
std::size_t live_contexts();
/// The same, on `worker`, by RPC.
Future<std::uint64_t> live_contexts(const WorkerRef& worker);

}  // namespace corpc::dist_autograd
