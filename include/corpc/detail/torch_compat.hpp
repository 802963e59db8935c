/// @file
/// Where libtorch's releases differ in an API corpc uses: one shim each, keyed on the feature itself (a
/// `__has_include`, a `requires` check) rather than on a version number, so that a release in between or a
/// vendor's build gets what it actually has. Each names the release that changed it. corpc's own API is the same on
/// every line (libtorch 1.13 through 2.x).
#pragma once

#include <c10/core/Allocator.h>
#include <c10/util/Optional.h>
#include <c10/util/intrusive_ptr.h>

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

// c10::variant: libtorch 1.13 has its own; 2.1 removed it (options hold std::variant, which codec.hpp covers).
#if __has_include(<c10/util/variant.h>)
#include <c10/util/variant.h>
/// 1 where libtorch has its own c10::variant (up to 2.0), 0 where options hold std::variant (2.1 on).
#define CORPC_C10_HAS_OWN_VARIANT 1
#else
/// 1 where libtorch has its own c10::variant (up to 2.0), 0 where options hold std::variant (2.1 on).
#define CORPC_C10_HAS_OWN_VARIANT 0
#endif

/// @cond INTERNAL
namespace corpc::detail {

// c10::optional: its own type in libtorch 1.13; an alias of std::optional since 2.2 (one codec serves both then).
template <class T>
inline constexpr bool c10_optional_is_own_type = !std::is_same_v<c10::optional<T>, std::optional<T>>;

// c10::Allocator: `allocate` is const up to 2.2 and not from 2.3, which also added the pure virtual `copy_data`. An
// allocator derives from CpuAllocatorBase<> and implements `allocate_bytes` (const) and `copy_bytes`; the base
// overrides whichever `allocate` this libtorch declares. The base is a dependent type so that only the branch this
// libtorch has is ever checked.
template <class Base = c10::Allocator, bool ConstAllocate = requires(const Base& a) { a.allocate(std::size_t{}); }
> class CpuAllocatorBase;

template <class Base>
class CpuAllocatorBase<Base, true> : public Base {
 public:
  c10::DataPtr allocate(std::size_t n) const override { return allocate_bytes(n); }
  void copy_data(void* dest, const void* src, std::size_t count) const { copy_bytes(dest, src, count); }

 protected:
  virtual c10::DataPtr allocate_bytes(std::size_t n) const = 0;
  virtual void copy_bytes(void* dest, const void* src, std::size_t count) const = 0;
};

template <class Base>
class CpuAllocatorBase<Base, false> : public Base {
 public:
  c10::DataPtr allocate(std::size_t n) override { return allocate_bytes(n); }
  // Overrides copy_data where this libtorch declares it (2.3 on); no `override`, in case a build lacks it.
  void copy_data(void* dest, const void* src, std::size_t count) const { copy_bytes(dest, src, count); }

 protected:
  virtual c10::DataPtr allocate_bytes(std::size_t n) const = 0;
  virtual void copy_bytes(void* dest, const void* src, std::size_t count) const = 0;
};

// Autograd nodes: owned through std::shared_ptr<Node> (Node derives from enable_shared_from_this) up to 2.13; through
// c10::intrusive_ptr<Node> (Node is a c10::intrusive_ptr_target) from 2.14 (pytorch#181782). NodeRef<N> owns a node
// of type N on either line; make_node builds one; node_ref gives a new owning reference to a node that something else
// keeps alive (the engine, a grad_fn, an accumulator). Keyed on N's base, so N must be complete where these are used
// (include torch/csrc/autograd/function.h): this header includes no autograd header, whose edge.h cannot stand alone
// on 2.14.
template <class N>
inline constexpr bool is_intrusive_node = std::is_base_of_v<c10::intrusive_ptr_target, N>;

template <class N>
using NodeRef = std::conditional_t<is_intrusive_node<N>, c10::intrusive_ptr<N>, std::shared_ptr<N>>;

template <class N, class... Args>
NodeRef<N> make_node(Args&&... args) {
  if constexpr (is_intrusive_node<N>) return c10::make_intrusive<N>(std::forward<Args>(args)...);
  else return std::make_shared<N>(std::forward<Args>(args)...);
}

// `Base` is the type the reference is to (torch::autograd::Node where an edge or a list of nodes takes it).
template <class Base, class N>
NodeRef<Base> node_ref(N* node) {
  if constexpr (is_intrusive_node<N>) return c10::intrusive_ptr<Base>::reclaim_copy(node);
  else return node->shared_from_this();
}

// c10d's Gloo group: a c10d::ProcessGroup itself up to 1.13; from 2.0 a c10d::Backend that a ProcessGroup carries
// per device type. Returns the group to hand users either way. (Templates so that this header needs no c10d header:
// only src/ddp/process_group.cpp, built with Gloo, instantiates them.)
template <class ProcessGroup, class Backend, class Store>
c10::intrusive_ptr<ProcessGroup> as_process_group(c10::intrusive_ptr<Backend> backend,
                                                  const c10::intrusive_ptr<Store>& store, int rank, int size) {
  if constexpr (std::is_base_of_v<ProcessGroup, Backend>) {
    return backend;
  } else {
    c10::intrusive_ptr<ProcessGroup> group;
    if constexpr (requires { ProcessGroup(store, rank, size); }) {
      group = c10::make_intrusive<ProcessGroup>(store, rank, size);  // 2.6
    } else {
      // Earlier 2.x: the group takes options naming its backend.
      group = c10::make_intrusive<ProcessGroup>(
          store, rank, size, c10::make_intrusive<typename ProcessGroup::Options>(std::string("gloo")));
    }
    if constexpr (requires { group->setDefaultBackend(ProcessGroup::BackendType::GLOO); }) {
      group->setDefaultBackend(ProcessGroup::BackendType::GLOO);
    }
    group->setBackend(c10::DeviceType::CPU, ProcessGroup::BackendType::GLOO, backend);
    return group;
  }
}

// c10d::TCPStore: 2.4 made libuv its default server loop, but builds without libuv (Debian's) then fail to start a
// store. corpc's stores are small rendezvous points: the classic loop serves them on every build.
template <class TCPStoreOptions>
void use_classic_tcpstore(TCPStoreOptions& options) {
  if constexpr (requires { options.useLibUV; }) options.useLibUV = false;
}

}  // namespace corpc::detail
/// @endcond
