// Distributed autograd: the per-worker context container, send/recv recording, and the FAST-mode backward.
#include "corpc/autograd/dist_autograd.hpp"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/variable.h>

#include <deque>
#include <map>
#include <mutex>
#include <set>

#include "corpc/core/detail/deferred_work.hpp"
#include "corpc/core/when_all.hpp"
#include "corpc/detail/torch_compat.hpp"
#include "corpc/rpc/call.hpp"

#include "core/trace_recorder.hpp"

namespace corpc::dist_autograd {

namespace ag = torch::autograd;

namespace {

// The grad_fn of tensors received inside a context. Never run by the engine: each backward pass captures the
// gradient flowing into it and ships it to the sender instead.
class RecvFunction final : public ag::Node {
 public:
  RecvFunction(int src, std::int64_t msg_id) : src_(src), msg_id_(msg_id) {}
  ag::variable_list apply(ag::variable_list&&) override {
    throw UsageError("corpc RecvFunction is captured, never executed");
  }
  std::string name() const override { return "corpc::RecvFunction"; }
  int src() const noexcept { return src_; }
  std::int64_t msg_id() const noexcept { return msg_id_; }

 private:
  int src_;
  std::int64_t msg_id_;
};

struct ContextState {
  std::int64_t id;
  std::mutex mutex;
  std::map<std::int64_t, ag::edge_list> sends;  // message id -> gradient edges of the tensors sent
  std::set<int> peers;                          // workers this context exchanged tensors with
  GradientMap grads;

  void accumulate(const at::Tensor& leaf, const at::Tensor& grad) {
    if (!grad.defined()) return;
    std::lock_guard lock(mutex);
    auto it = grads.find(leaf);
    if (it == grads.end()) grads.emplace(leaf, grad.detach());
    else it->second = it->second + grad.detach();  // out of place: a returned gradient is never mutated later
  }
};

class Container {
 public:
  explicit Container(Runtime& rt) : rank_(rt.rank()), passes_(rt.executor(), 1) {}

  // Local backward passes run one at a time per worker, in arrival order, each with the worker's intra-op threads
  // (at::get_num_threads): concurrent passes would oversubscribe those threads, and in order they form the reverse
  // pipeline (each finished pass ships its gradients on at once). Measured with bench/pipeline_bench on 2 cores:
  // faster than unbounded or 2-wide at 4 and 8 micro-batches, slower at 2 (where the other worker's core is idle).
  void post_pass(std::function<void()> pass) {
    {
      std::lock_guard lock(passes_mutex_);
      ++passes_pending_;
      if (pass_here_) {  // behind the pass running on a handler's thread: queued when it ends, in order
        held_passes_.push_back(std::move(pass));
        return;
      }
    }
    post_counted(std::move(pass));
  }
  // Runs `pass` on the calling thread if no other pass is running or queued (returns false otherwise): a handler
  // that would only hand the pass to another pool thread and return saves that thread's wake-up.
  bool run_pass_here_if_idle(const std::function<void()>& pass) {
    {
      std::lock_guard lock(passes_mutex_);
      if (passes_pending_ != 0 || pass_here_) return false;
      pass_here_ = true;
    }
    pass();
    std::vector<std::function<void()>> held;
    {
      std::lock_guard lock(passes_mutex_);
      pass_here_ = false;
      held.swap(held_passes_);
    }
    for (auto& p : held) post_counted(std::move(p));
    return true;
  }

  std::int64_t new_id() { return (static_cast<std::int64_t>(rank_) + 1) << 40 | next_.fetch_add(1); }
  std::int64_t new_message_id() { return (static_cast<std::int64_t>(rank_) + 1) << 40 | next_msg_.fetch_add(1); }

  // nullptr for a context already released here: a late message must not bring it (and the graph it pins) back.
  std::shared_ptr<ContextState> get_or_create(std::int64_t id) {
    std::lock_guard lock(mutex_);
    if (released_.count(id)) return nullptr;
    auto& c = contexts_[id];
    if (!c) {
      c = std::make_shared<ContextState>();
      c->id = id;
    }
    return c;
  }
  std::shared_ptr<ContextState> find(std::int64_t id) {
    std::lock_guard lock(mutex_);
    auto it = contexts_.find(id);
    return it == contexts_.end() ? nullptr : it->second;
  }
  // Remembered as released even when not alive here: a peer's release can be handled before the request that brings
  // the context (the two run as separate pool jobs), and that request must not create it afterwards.
  std::shared_ptr<ContextState> erase(std::int64_t id) {
    std::lock_guard lock(mutex_);
    std::shared_ptr<ContextState> c;
    if (auto it = contexts_.find(id); it != contexts_.end()) {
      c = std::move(it->second);
      contexts_.erase(it);
    }
    if (!released_.insert(id).second) return c;
    released_order_.push_back(id);
    if (released_order_.size() > kRememberReleased) {
      released_.erase(released_order_.front());
      released_order_.pop_front();
    }
    return c;
  }
  std::size_t size() {
    std::lock_guard lock(mutex_);
    return contexts_.size();
  }

  // Sender side: remember where gradients for these tensors must go.
  std::int64_t on_send(std::int64_t ctx_id, int dst, const std::vector<at::Tensor>& tensors) {
    ag::edge_list edges;
    for (const auto& t : tensors)
      if (t.defined() && t.requires_grad()) edges.push_back(ag::impl::gradient_edge(t));
    if (edges.empty()) return -1;
    auto ctx = get_or_create(ctx_id);
    if (!ctx) return -1;
    const std::int64_t msg = new_message_id();
    std::lock_guard lock(ctx->mutex);
    ctx->sends.emplace(msg, std::move(edges));
    ctx->peers.insert(dst);
    return msg;
  }

  // Receiver side: received tensors that require grad get a recv function as their grad_fn.
  void on_recv(std::int64_t ctx_id, std::int64_t msg_id, int src, std::vector<at::Tensor>& tensors) {
    auto ctx = get_or_create(ctx_id);
    if (!ctx) return;
    {
      std::lock_guard lock(ctx->mutex);
      ctx->peers.insert(src);
    }
    auto recv = corpc::detail::make_node<RecvFunction>(src, msg_id);
    for (auto& t : tensors) {
      if (!t.defined() || !t.requires_grad()) continue;
      t.set_requires_grad(false);  // from a leaf to the output of `recv`
      ag::set_history(t, recv);
    }
  }

 private:
  void post_counted(std::function<void()> pass) {
    passes_.post([this, pass = std::move(pass)] {
      pass();
      std::lock_guard lock(passes_mutex_);
      --passes_pending_;
    });
  }

  int rank_;
  std::mutex passes_mutex_;
  std::size_t passes_pending_ = 0;  // posted to passes_ (or held), not finished
  bool pass_here_ = false;          // a pass runs on a handler's thread (run_pass_here_if_idle)
  std::vector<std::function<void()>> held_passes_;
  BoundedExecutor passes_;  // after what its jobs touch: destroyed first, it waits for them
  std::atomic<std::int64_t> next_{1}, next_msg_{1};
  std::mutex mutex_;
  std::map<std::int64_t, std::shared_ptr<ContextState>> contexts_;
  static constexpr std::size_t kRememberReleased = 1 << 16;
  std::set<std::int64_t> released_;
  std::deque<std::int64_t> released_order_;
};

std::shared_ptr<Container> container() { return Runtime::get().extension<Container>(); }

const int g_context_slot = CallContext::new_slot();

const bool g_hooks_installed = [] {
  add_runtime_initializer([](Runtime& rt) {
    auto c = rt.extension<Container>();
    std::weak_ptr<Container> weak = c;
    corpc::detail::TensorHooks hooks;
    hooks.context_slot = detail::context_slot();
    hooks.on_send = [weak](std::int64_t ctx, int dst, const std::vector<at::Tensor>& ts) -> std::int64_t {
      auto c = weak.lock();
      return c ? c->on_send(ctx, dst, ts) : -1;
    };
    hooks.on_recv = [weak](std::int64_t ctx, std::int64_t msg, int src, std::vector<at::Tensor>& ts) {
      if (auto c = weak.lock()) c->on_recv(ctx, msg, src, ts);
    };
    rt.set_tensor_hooks(std::move(hooks));
  });
  return true;
}();

Future<void> continue_from_send(std::int64_t ctx_id, std::int64_t msg_id, std::vector<at::Tensor> grads);

// The local pass running leaf hooks on this thread (see leaf_hooks in the header).
struct LeafHookPass {
  std::int64_t context;
  std::vector<std::function<void()>> at_end;
};
thread_local LeafHookPass* tls_leaf_pass = nullptr;

// Adds a leaf's gradient to the context, then runs the post hooks of its accumulator.
void accumulate_leaf(ContextState& ctx, LeafHookPass& pass, ag::AccumulateGrad& acc, const at::Tensor& grad) {
  ctx.accumulate(acc.variable, grad);
  if (acc.post_hooks().empty() || !grad.defined()) return;
  tls_leaf_pass = &pass;
  try {
    for (auto& hook : acc.post_hooks()) (*hook)({}, {grad});
  } catch (...) {
    tls_leaf_pass = nullptr;
    throw;
  }
  tls_leaf_pass = nullptr;
}

// The gradients for the senders of what this worker received, summed per input of each recv function.
class Shipment {
 public:
  void add(RecvFunction* recv, std::uint32_t nr, const at::Tensor& g) {
    auto& slot = by_recv_[recv];
    slot.resize(recv->num_inputs());
    at::Tensor grad = g.defined() ? g : recv->input_metadata(nr).zeros_like();
    slot[nr] = slot[nr].defined() ? slot[nr] + grad : grad;
  }

  // Ships each recv function's gradients to its sender; completes when the senders' passes have.
  std::vector<Future<void>> send(std::int64_t ctx_id) const {
    std::vector<Future<void>> remote;
    CallContextScope no_ctx(detail::with_context(-1));  // gradients are not themselves recorded
    for (auto& [recv, g] : by_recv_)
      remote.push_back(rpc_async<&continue_from_send>(recv->src(), ctx_id, recv->msg_id(), g));
    return remote;
  }

 private:
  std::map<RecvFunction*, std::vector<at::Tensor>> by_recv_;
};

// What the engine should hand back instead of accumulating or running: leaves and the inputs of recv functions.
struct EngineOutputs {
  ag::edge_list edges;
  std::vector<ag::AccumulateGrad*> leaves;  // parallel to edges; nullptr for a recv function's input
  std::vector<RecvFunction*> recvs;         // parallel to edges; nullptr for leaves
};

// The leaves and recv functions reachable from `roots`, where the engine's walk stops.
EngineOutputs engine_outputs(const ag::edge_list& roots) {
  EngineOutputs out;
  std::set<ag::Node*> seen;
  std::vector<ag::Node*> stack;
  for (auto& e : roots) stack.push_back(e.function.get());
  while (!stack.empty()) {
    ag::Node* n = stack.back();
    stack.pop_back();
    if (!n || !seen.insert(n).second) continue;
    if (auto* acc = dynamic_cast<ag::AccumulateGrad*>(n)) {
      out.edges.emplace_back(corpc::detail::node_ref<ag::Node>(acc), 0);
      out.leaves.push_back(acc);
      out.recvs.push_back(nullptr);
      continue;
    }
    if (auto* recv = dynamic_cast<RecvFunction*>(n)) {
      for (std::uint32_t i = 0; i < recv->num_inputs(); ++i) {
        out.edges.emplace_back(corpc::detail::node_ref<ag::Node>(recv), i);
        out.leaves.push_back(nullptr);
        out.recvs.push_back(recv);
      }
      continue;
    }
    for (const auto& e : n->next_edges()) stack.push_back(e.function.get());
  }
  return out;
}

// One worker's share of a backward pass: run the local engine from `roots`, keep the gradients of leaves in the
// context, and ship the gradients that reach recv functions to their senders. Completes when those have finished.
Future<void> local_pass(const std::shared_ptr<ContextState>& ctx, const ag::edge_list& roots, ag::variable_list grads) {
  Shipment shipment;
  LeafHookPass hook_pass{ctx->id, {}};
  // Roots that are leaves or recv functions take their gradient as is; the engine runs from the others.
  ag::edge_list engine_roots;
  ag::variable_list engine_grads;
  for (std::size_t i = 0; i < roots.size(); ++i) {
    ag::Node* fn = roots[i].function.get();
    if (auto* acc = dynamic_cast<ag::AccumulateGrad*>(fn)) accumulate_leaf(*ctx, hook_pass, *acc, grads[i]);
    else if (auto* recv = dynamic_cast<RecvFunction*>(fn)) shipment.add(recv, roots[i].input_nr, grads[i]);
    else if (fn) engine_roots.push_back(roots[i]), engine_grads.push_back(grads[i]);
  }

  const auto outputs = engine_outputs(engine_roots);
  ag::variable_list captured;
  if (!outputs.edges.empty()) {
    CallContextScope no_ctx(detail::with_context(-1));  // gradients are not themselves recorded
    captured =
        ag::Engine::get_default_engine().execute(engine_roots, engine_grads, /*keep_graph=*/true,
                                                 /*create_graph=*/false, /*accumulate_grad=*/false, outputs.edges);
  }
  for (std::size_t i = 0; i < outputs.edges.size(); ++i) {
    if (outputs.recvs[i]) shipment.add(outputs.recvs[i], outputs.edges[i].input_nr, captured[i]);
    else accumulate_leaf(*ctx, hook_pass, *outputs.leaves[i], captured[i]);
  }
  auto remote = shipment.send(ctx->id);
  // The senders' gradients leave before the end-of-pass callbacks run, so that their passes overlap what the
  // callbacks wait for (DDP's allreduce): a callback may block where this thread's staged sends are not flushed.
  if (!hook_pass.at_end.empty()) corpc::detail::run_deferred_work();
  for (auto& fn : hook_pass.at_end) fn();
  return when_all(std::move(remote));
}

// `here`: the caller (a request handler on the worker pool) would return right after; it runs the pass itself if
// no other is running or queued.
Future<void> run_pass(std::shared_ptr<ContextState> ctx, ag::edge_list roots, ag::variable_list grads,
                      bool here = false) {
  auto done = std::make_shared<Promise<void>>();
  auto result = done->get_future();
  std::function<void()> pass = [ctx = std::move(ctx), roots = std::move(roots), grads = std::move(grads),
                                done]() mutable {
    Future<void> shipped;
    try {
      trace::detail::ScopedRecord slice([&] {
        return trace::detail::Record{.kind = trace::detail::Kind::backward,
                                     .request = static_cast<std::uint64_t>(ctx->id),
                                     .bytes = 0,
                                     .name = {}};
      });
      shipped = local_pass(ctx, roots, std::move(grads));
    } catch (...) {
      shipped = make_exceptional_future<void>(std::current_exception());
    }
    corpc::detail::on_ready_inline(shipped, [shipped, done] {
      if (auto e = shipped.error()) done->set_exception(e);
      else done->set_value();
    });
  };
  auto c = container();
  if (!(here && c->run_pass_here_if_idle(pass))) c->post_pass(std::move(pass));
  return result;
}

// Runs on the sender of message `msg_id`, when its receiver's backward pass reached the matching recv function.
Future<void> continue_from_send(std::int64_t ctx_id, std::int64_t msg_id, std::vector<at::Tensor> grads) {
  auto ctx = container()->find(ctx_id);
  if (!ctx)
    throw UsageError("distributed autograd context " + std::to_string(ctx_id) + " is not alive on worker '" +
                     get_worker_info().name + "'");
  ag::edge_list roots;
  {
    std::lock_guard lock(ctx->mutex);
    auto it = ctx->sends.find(msg_id);
    if (it == ctx->sends.end()) throw UsageError("no send function " + std::to_string(msg_id) + " in this context");
    roots = it->second;
  }
  if (roots.size() != grads.size()) throw ProtocolError("gradient count does not match the tensors sent");
  return run_pass(ctx, roots, std::move(grads), /*here=*/!blocking_forbidden());
}

// Releases a context here and, if it was alive, on every worker it exchanged tensors with except `from`, the worker
// whose release this is (it released its own before telling us; -1 when the release starts here). Idempotent.
void release_context(std::int64_t ctx_id, int from) {
  auto c = Runtime::try_get() ? container()->erase(ctx_id) : nullptr;
  if (!c) return;
  std::set<int> peers;
  {
    std::lock_guard lock(c->mutex);
    peers = c->peers;
  }
  CallContextScope no_ctx(detail::with_context(-1));
  const int self = Runtime::get().rank();
  for (int p : peers)
    if (p != self && p != from && Runtime::get().is_alive(p))
      corpc::detail::send_control<&release_context>(p, ctx_id, self);
}

std::uint64_t live_contexts_here() { return container()->size(); }

}  // namespace

Context::Context() : id_(container()->new_id()), scope_(detail::with_context(id_)) {
  (void)container()->get_or_create(id_);
}

Context::~Context() {
  try {
    release_context(id_, -1);
  } catch (...) {
    // Runtime gone: nothing left to release.
  }
}

Future<void> Context::backward(std::vector<at::Tensor> roots, bool retain_graph) const {
  return dist_autograd::backward(id_, std::move(roots), retain_graph);
}
GradientMap Context::gradients() const { return get_gradients(id_); }

Future<void> backward(std::int64_t context_id, std::vector<at::Tensor> roots, bool) {
  try {
    auto ctx = container()->find(context_id);
    if (!ctx)
      throw UsageError("backward: distributed autograd context " + std::to_string(context_id) + " is not alive");
    ag::edge_list edges;
    ag::variable_list grads;
    for (auto& r : roots) {
      if (!r.requires_grad()) throw UsageError("backward: a root does not require grad");
      edges.push_back(ag::impl::gradient_edge(r));
      grads.push_back(at::ones_like(r));
    }
    return run_pass(ctx, edges, std::move(grads));
  } catch (...) {
    return make_exceptional_future<void>(std::current_exception());
  }
}

GradientMap get_gradients(std::int64_t context_id) {
  auto ctx = container()->find(context_id);
  if (!ctx) return {};
  std::lock_guard lock(ctx->mutex);
  return ctx->grads;
}

namespace leaf_hooks {
std::int64_t pass_context_id() { return tls_leaf_pass ? tls_leaf_pass->context : -1; }
void at_end_of_pass(std::function<void()> fn) {
  if (!tls_leaf_pass) throw UsageError("dist_autograd::leaf_hooks::at_end_of_pass outside a leaf hook of a pass");
  tls_leaf_pass->at_end.push_back(std::move(fn));
}
at::Tensor gradient(std::int64_t context_id, const at::Tensor& leaf) {
  auto ctx = container()->find(context_id);
  if (!ctx) return {};
  std::lock_guard lock(ctx->mutex);
  auto it = ctx->grads.find(leaf);
  return it == ctx->grads.end() ? at::Tensor() : it->second;
}
void set_gradient(std::int64_t context_id, const at::Tensor& leaf, at::Tensor grad) {
  auto ctx = container()->find(context_id);
  if (!ctx) throw UsageError("distributed autograd context " + std::to_string(context_id) + " is not alive");
  std::lock_guard lock(ctx->mutex);
  ctx->grads.insert_or_assign(leaf, std::move(grad));
}
}  // namespace leaf_hooks

std::size_t live_contexts() { return container()->size(); }
Future<std::uint64_t> live_contexts(const WorkerRef& worker) { return rpc_async<&live_contexts_here>(worker); }

namespace detail {
int context_slot() { return g_context_slot; }
CallContext with_context(std::int64_t id) {
  CallContext c = current_call_context();
  c.set(g_context_slot, id);
  return c;
}
}  // namespace detail

std::int64_t current_context_id() { return current_call_context().get(g_context_slot); }

}  // namespace corpc::dist_autograd
