// The runtime's private state. Threads: the network thread owns connections and timers; the worker pool runs
// handlers; any thread may call. Fields say which lock or thread guards them.
#pragma once

#include <asio.hpp>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_map>

#include "connection.hpp"
#include "corpc/rpc/runtime.hpp"

namespace corpc {

struct Runtime::Impl {
  RpcOptions options;
  WorkerInfo self;
  int world_size = 0;
  std::vector<WorkerInfo> workers;  // by rank; written once by rendezvous before init_rpc returns
  std::unordered_map<std::string, int> rank_by_name;

  asio::io_context io;
  asio::executor_work_guard<asio::io_context::executor_type> work{io.get_executor()};
  asio::ip::tcp::acceptor acceptor{io};
  std::thread io_thread;
  std::unique_ptr<ThreadPool> pool;

  // Connections, guarded by conn_mutex.
  std::mutex conn_mutex;
  std::vector<std::shared_ptr<detail::Connection>> outgoing;  // by rank: where our requests to that rank go
  std::set<std::shared_ptr<detail::Connection>> incoming;      // accepted connections
  std::vector<std::string> dead;                               // by rank: why it is gone ("" = alive)
  bool closing = false;

  // Calls in flight, guarded by pending_mutex.
  // Timeouts: one timer for all calls, armed for the earliest deadline (calls made with the same timeout arrive in
  // deadline order, so it rarely needs re-arming), instead of a timer and a network-thread post per call.
  using Deadlines = std::multimap<std::chrono::steady_clock::time_point, std::uint64_t>;
  struct Pending {
    int dst;
    std::string function;
    ReplyCallback callback;
    Deadlines::iterator deadline;
    std::chrono::milliseconds timeout;
    bool counted;
  };
  std::mutex pending_mutex;
  std::unordered_map<std::uint64_t, Pending> pending;
  Deadlines deadlines;                                                    // pending_mutex
  std::chrono::steady_clock::time_point armed_for = std::chrono::steady_clock::time_point::max();  // pending_mutex
  asio::steady_timer sweeper{io};                                         // network thread
  // Removes a pending call (pending_mutex held); false if it is not there any more.
  bool take_pending(std::uint64_t id, Pending& out);
  void arm_sweeper();  // network thread
  void sweep();        // network thread
  std::atomic<std::uint64_t> next_request_id{1};

  std::atomic<std::uint64_t> accepted{0}, accept_errors{0};  // diagnostics for rendezvous failures
  std::atomic<std::uint64_t> requests_sent{0}, requests_handled{0}, calls_in_flight{0}, handlers_running{0};
  // Per peer, for graceful shutdown: user requests we sent to rank j / finished handling from rank i.
  std::unique_ptr<std::atomic<std::uint64_t>[]> sent_to, handled_from;
  std::vector<std::uint64_t> counts(const std::unique_ptr<std::atomic<std::uint64_t>[]>& c) const {
    std::vector<std::uint64_t> v(world_size);
    for (int i = 0; i < world_size; ++i) v[i] = c[i].load();
    return v;
  }

  std::mutex extensions_mutex;
  std::map<std::type_index, std::shared_ptr<void>> extensions;

  std::mutex hooks_mutex;
  TensorHooks tensor_hooks;
  std::vector<std::function<void(int, const std::string&)>> failure_listeners;
  std::function<bool()> quiescence_probe;

  // Rendezvous (network thread). On rank 0: registrations so far. Elsewhere: the answer.
  std::map<int, std::pair<WorkerInfo, std::shared_ptr<detail::Connection>>> registrations;  // conn_mutex
  Promise<void> world_ready;
  std::atomic<bool> world_known{false};
  // Requests that arrive before we have the world table (a peer heard from rank 0 first); network thread.
  std::vector<std::pair<std::shared_ptr<detail::Connection>, Message>> early_requests;

  // Graceful shutdown bookkeeping on rank 0, guarded by barrier_mutex.
  struct Round {
    std::map<int, std::pair<std::vector<std::uint64_t>, std::vector<std::uint64_t>>> reports;  // rank -> (sent_to, handled_from)
    bool all_idle = true;
    Promise<std::pair<std::uint64_t, bool>> done;  // (requests between live ranks, balanced and idle)
  };
  std::mutex barrier_mutex;
  std::map<std::int64_t, Round> rounds;

  // ---- runtime.cpp ----
  void start_threads();
  void on_frame(const std::shared_ptr<detail::Connection>& conn, Message&& msg);
  void on_close(const std::shared_ptr<detail::Connection>& conn, const std::string& why);
  void handle_request(std::shared_ptr<detail::Connection> conn, Message msg);
  void deliver_reply(Message&& msg);
  void send_error(const std::shared_ptr<detail::Connection>& conn, std::uint64_t id, std::exception_ptr error,
                  std::string_view function);
  std::shared_ptr<detail::Connection> connection_to(int rank);
  void mark_dead(int rank, const std::string& why);
  void fail_pending(int rank, std::exception_ptr error);
  void fail_all_pending(std::exception_ptr error);
  void accept_loop();
  void close_everything(bool say_goodbye);
  std::function<void(const std::shared_ptr<detail::Connection>&, Message&&)> frame_handler();
  std::function<void(const std::shared_ptr<detail::Connection>&, const std::string&)> close_handler();
  void check_rounds();
  std::string name_of(int rank) const;

  // ---- rendezvous.cpp ----
  void rendezvous(const std::string& master_host, std::uint16_t master_port, int listen_fd);
  void on_hello(const std::shared_ptr<detail::Connection>& conn, Message&& msg);
  void refuse(const std::shared_ptr<detail::Connection>& conn, const std::string& why);
  void on_world(Message&& msg);
  void publish_world_if_complete();
};

void validate_worker_name(const std::string& name);
// The first frame on every dialed connection (rendezvous.cpp).
Message hello_message(const WorkerInfo& self, int world_size, bool rendezvous);

}  // namespace corpc
