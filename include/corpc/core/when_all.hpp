// corpc/core/when_all.hpp — joining many futures.
//
//   wait_all(futs)    -> Future<std::vector<T>>: all values in order; fails with the first error to occur, at once.
//   collect_all(futs) -> Future<std::vector<Future<T>>>: completes when every input has, never fails; inspect each.
//
// Both are eager Futures, so they can be awaited (`co_await wait_all(std::move(futs))`) or waited on.
#pragma once

#include <atomic>
#include <memory>
#include <optional>
#include <vector>

#include "corpc/core/future.hpp"

namespace corpc {

template <class T>
Future<std::conditional_t<std::is_void_v<T>, void, std::vector<T>>> wait_all(std::vector<Future<T>> futures) {
  using Out = std::conditional_t<std::is_void_v<T>, void, std::vector<T>>;
  struct Join {
    std::vector<Future<T>> inputs;
    std::atomic<std::size_t> remaining;
    Promise<Out> promise;
  };
  auto join = std::make_shared<Join>();
  join->remaining = futures.size();
  join->inputs = std::move(futures);
  Future<Out> out = join->promise.get_future();
  if (join->inputs.empty()) {
    if constexpr (std::is_void_v<T>) join->promise.set_value();
    else join->promise.set_value(Out{});
    return out;
  }
  for (auto& f : join->inputs) {
    detail::on_ready_inline(f, [join, f] {
      if (auto e = f.error()) {
        join->promise.set_exception(e);  // first error wins; later completions are ignored
        return;
      }
      if (join->remaining.fetch_sub(1) != 1) return;
      if constexpr (std::is_void_v<T>) {
        join->promise.set_value();
      } else {
        std::vector<T> values;
        values.reserve(join->inputs.size());
        for (auto& in : join->inputs) values.push_back(in.value());
        join->promise.set_value(std::move(values));
      }
    });
  }
  return out;
}

template <class T>
Future<std::vector<Future<T>>> collect_all(std::vector<Future<T>> futures) {
  struct Join {
    std::vector<Future<T>> inputs;
    std::atomic<std::size_t> remaining;
    Promise<std::vector<Future<T>>> promise;
  };
  auto join = std::make_shared<Join>();
  join->remaining = futures.size();
  join->inputs = std::move(futures);
  auto out = join->promise.get_future();
  if (join->inputs.empty()) {
    join->promise.set_value(std::vector<Future<T>>{});
    return out;
  }
  for (auto& f : join->inputs) {
    detail::on_ready_inline(f, [join] {
      if (join->remaining.fetch_sub(1) == 1) join->promise.set_value(join->inputs);
    });
  }
  return out;
}

}  // namespace corpc
