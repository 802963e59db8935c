// TCP and loopback connections: framing, gathered writes from tensor storage, reads straight into new tensors.
#include "connection.hpp"

#include <ATen/ATen.h>

#include <cstring>

namespace corpc::detail {

namespace {

// A frame ready for the socket: header + metadata in one buffer, then the body, then each tensor's bytes.
struct OutFrame {
  std::string head;                  // FrameHeader followed by tensor metadata
  std::string body;
  std::vector<at::Tensor> tensors;   // kept alive until written
};

OutFrame prepare(Message&& msg) {
  OutFrame f;
  std::string meta;
  std::uint64_t total = 0;
  f.tensors = encode_tensor_meta(msg.tensors, meta, total);
  FrameHeader h;
  h.kind = msg.kind;
  h.id = msg.id;
  h.flags = msg.flags;
  h.meta_len = static_cast<std::uint32_t>(meta.size());
  h.body_len = static_cast<std::uint32_t>(msg.body.size());
  h.num_tensors = static_cast<std::uint32_t>(f.tensors.size());
  h.tensor_bytes = total;
  f.head.resize(sizeof h + meta.size());
  std::memcpy(f.head.data(), &h, sizeof h);
  std::memcpy(f.head.data() + sizeof h, meta.data(), meta.size());
  f.body = std::move(msg.body);
  return f;
}

class TcpConnection final : public Connection {
 public:
  TcpConnection(asio::ip::tcp::socket s, WireLimits limits, FrameHandler on_frame, CloseHandler on_close)
      : socket_(std::move(s)), limits_(limits), on_frame_(std::move(on_frame)), on_close_(std::move(on_close)) {}

  void start_reading() {
    asio::error_code ec;
    socket_.set_option(asio::ip::tcp::no_delay(true), ec);
    auto ep = socket_.remote_endpoint(ec);
    if (!ec) remote_address = ep.address().to_string();
    connected_ = true;
    asio::co_spawn(socket_.get_executor(), read_loop(shared_from_this()), asio::detached);
    write_more();
  }

  void dial(std::string host, std::uint16_t port) {
    asio::co_spawn(socket_.get_executor(), connect(std::static_pointer_cast<TcpConnection>(shared_from_this()),
                                                   std::move(host), port),
                   asio::detached);
  }

  void send(Message msg) override {
    auto frame = std::make_shared<OutFrame>(prepare(std::move(msg)));
    asio::post(socket_.get_executor(), [self = shared_from_this(), frame]() {
      auto* me = static_cast<TcpConnection*>(self.get());
      if (me->closed_) return;
      me->queue_.push_back(std::move(*frame));
      me->write_more();
    });
  }

  void close(std::string why) override {
    asio::post(socket_.get_executor(), [self = shared_from_this(), why = std::move(why)]() {
      static_cast<TcpConnection*>(self.get())->fail(why);
    });
  }

  void close_when_flushed() override {
    asio::post(socket_.get_executor(), [self = shared_from_this()]() {
      auto* me = static_cast<TcpConnection*>(self.get());
      me->close_when_flushed_ = true;
      if (!me->writing_ && (me->queue_.empty() || !me->connected_)) me->fail("closed");
    });
  }

 private:
  static asio::awaitable<void> connect(std::shared_ptr<TcpConnection> self, std::string host, std::uint16_t port) {
    try {
      asio::ip::tcp::resolver resolver(self->socket_.get_executor());
      auto endpoints = co_await resolver.async_resolve(host, std::to_string(port), asio::use_awaitable);
      co_await asio::async_connect(self->socket_, endpoints, asio::use_awaitable);
    } catch (const std::exception& e) {
      self->fail("cannot connect to " + host + ":" + std::to_string(port) + ": " + e.what());
      co_return;
    }
    if (!self->closed_) self->start_reading();
  }

  static asio::awaitable<void> read_loop(std::shared_ptr<Connection> base) {
    auto* self = static_cast<TcpConnection*>(base.get());
    try {
      for (;;) {
        FrameHeader h;
        co_await asio::async_read(self->socket_, asio::buffer(&h, sizeof h), asio::use_awaitable);
        validate_header(h, self->limits_);
        std::string meta(h.meta_len, '\0');
        Message msg;
        msg.kind = h.kind;
        msg.id = h.id;
        msg.flags = h.flags;
        msg.body.resize(h.body_len);
        std::array<asio::mutable_buffer, 2> head_bufs{asio::buffer(meta), asio::buffer(msg.body)};
        co_await asio::async_read(self->socket_, head_bufs, asio::use_awaitable);
        msg.tensors = decode_tensor_meta(meta, h.num_tensors, h.tensor_bytes, self->limits_);
        if (h.tensor_bytes) {
          std::vector<asio::mutable_buffer> data;
          data.reserve(msg.tensors.size());
          for (auto& t : msg.tensors) {
            if (t.numel()) data.emplace_back(t.data_ptr(), static_cast<std::size_t>(t.nbytes()));
          }
          co_await asio::async_read(self->socket_, data, asio::use_awaitable);
        }
        if (msg.kind == FrameKind::Goodbye) self->said_goodbye = true;
        if (self->closed_) co_return;
        self->on_frame_(base, std::move(msg));
      }
    } catch (const ProtocolError& e) {
      self->fail(std::string("protocol error: ") + e.what());
    } catch (const std::system_error& e) {
      self->fail(e.code() == asio::error::eof ? "connection closed by peer" : e.what());
    } catch (const std::exception& e) {
      self->fail(e.what());
    }
  }

  void write_more() {
    if (writing_ || !connected_ || closed_ || queue_.empty()) return;
    // Coalesce whatever is queued into one gathered write: many small frames cost one syscall.
    std::vector<asio::const_buffer> bufs;
    std::size_t frames = 0, bytes = 0;
    for (auto& f : queue_) {
      if (frames && (frames >= 64 || bytes > (1u << 20))) break;
      bufs.emplace_back(asio::buffer(f.head));
      if (!f.body.empty()) bufs.emplace_back(asio::buffer(f.body));
      for (auto& t : f.tensors)
        if (t.numel()) bufs.emplace_back(t.data_ptr(), static_cast<std::size_t>(t.nbytes()));
      bytes += f.head.size() + f.body.size();
      ++frames;
    }
    writing_ = true;
    asio::async_write(socket_, bufs, [self = shared_from_this(), frames](const asio::error_code& ec, std::size_t) {
      auto* me = static_cast<TcpConnection*>(self.get());
      me->writing_ = false;
      if (ec) return me->fail("write failed: " + ec.message());
      for (std::size_t i = 0; i < frames && !me->queue_.empty(); ++i) me->queue_.pop_front();
      if (me->queue_.empty() && me->close_when_flushed_) return me->fail("closed");
      me->write_more();
    });
  }

  void fail(const std::string& why) {
    if (closed_) return;
    closed_ = true;
    asio::error_code ec;
    socket_.shutdown(asio::ip::tcp::socket::shutdown_both, ec);
    socket_.close(ec);
    queue_.clear();
    auto handler = std::move(on_close_);
    on_frame_ = nullptr;
    if (handler) handler(shared_from_this(), why);
  }

  asio::ip::tcp::socket socket_;
  WireLimits limits_;
  FrameHandler on_frame_;
  CloseHandler on_close_;
  std::deque<OutFrame> queue_;
  bool writing_ = false;
  bool connected_ = false;
  bool closed_ = false;
  bool close_when_flushed_ = false;
};

class LoopbackConnection final : public Connection {
 public:
  LoopbackConnection(asio::io_context& io, FrameHandler on_frame) : io_(io), on_frame_(std::move(on_frame)) {}

  void send(Message msg) override {
    // Same semantics as the wire: the receiver gets its own copy of every tensor, detached, requires_grad kept.
    for (auto& t : msg.tensors) {
      if (!t.defined()) continue;
      bool rg = t.requires_grad();
      t = t.detach().to(at::kCPU).clone();
      if (rg) t.set_requires_grad(true);
    }
    asio::post(io_, [self = shared_from_this(), msg = std::move(msg)]() mutable {
      auto* me = static_cast<LoopbackConnection*>(self.get());
      if (me->on_frame_) me->on_frame_(self, std::move(msg));
    });
  }
  void close(std::string) override {
    asio::post(io_, [self = shared_from_this()] { static_cast<LoopbackConnection*>(self.get())->on_frame_ = nullptr; });
  }
  void close_when_flushed() override { close({}); }

 private:
  asio::io_context& io_;
  FrameHandler on_frame_;
};

}  // namespace

std::shared_ptr<Connection> make_tcp_connection(asio::ip::tcp::socket socket, WireLimits limits, FrameHandler on_frame,
                                                CloseHandler on_close) {
  auto c = std::make_shared<TcpConnection>(std::move(socket), limits, std::move(on_frame), std::move(on_close));
  c->start_reading();
  return c;
}

std::shared_ptr<Connection> dial_tcp_connection(asio::io_context& io, int peer_rank, std::string host,
                                                std::uint16_t port, WireLimits limits, FrameHandler on_frame,
                                                CloseHandler on_close) {
  auto c = std::make_shared<TcpConnection>(asio::ip::tcp::socket(io), limits, std::move(on_frame), std::move(on_close));
  c->peer_rank = peer_rank;
  c->outgoing = true;
  c->dial(std::move(host), port);
  return c;
}

std::shared_ptr<Connection> make_loopback_connection(asio::io_context& io, FrameHandler on_frame) {
  return std::make_shared<LoopbackConnection>(io, std::move(on_frame));
}

}  // namespace corpc::detail
