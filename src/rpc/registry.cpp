// The function registry: copy-on-write snapshots, read without a lock.
#include "corpc/rpc/detail/registry.hpp"

#include <algorithm>

namespace corpc::detail {

Registry& global_registry() {
  static Registry registry;
  return registry;
}

void Registry::add(HandlerEntry entry) {
  entry.id = function_id(entry.name);
  std::lock_guard lock(write_mutex_);
  auto next = std::make_unique<Table>();
  if (const Table* t = current_.load(std::memory_order_acquire)) next->by_id = t->by_id;
  auto& v = next->by_id;
  auto it = std::lower_bound(v.begin(), v.end(), entry.id, [](const auto& e, std::uint64_t id) { return e->id < id; });
  if (it != v.end() && (*it)->id == entry.id) {
    if ((*it)->name != entry.name)
      throw UsageError("function names '" + (*it)->name + "' and '" + entry.name +
                       "' hash to the same id: register one of them under another name");
    *it = std::make_shared<const HandlerEntry>(std::move(entry));
  } else {
    v.insert(it, std::make_shared<const HandlerEntry>(std::move(entry)));
  }
  current_.store(next.get(), std::memory_order_release);
  tables_.push_back(std::move(next));
}

const HandlerEntry* Registry::find(std::uint64_t id) const noexcept {
  const Table* t = current_.load(std::memory_order_acquire);
  if (!t) return nullptr;
  auto it =
      std::lower_bound(t->by_id.begin(), t->by_id.end(), id, [](const auto& e, std::uint64_t k) { return e->id < k; });
  return it != t->by_id.end() && (*it)->id == id ? it->get() : nullptr;
}

}  // namespace corpc::detail
