#!/usr/bin/python3
"""PyTorch RPC beside bench/scale_bench: N ranks on this host, each calling every other.

The same phases as build/bench/scale_bench, with torch.distributed.rpc (TensorPipe backend, its default options: 16
worker threads per rank, TensorPipe's own choice of transports), N processes forked from this one (as scale_bench
forks its ranks, so libtorch's pages are shared between them) with a barrier between phases; a phase's time runs from
the barrier's release to the last rank's end:
  init        init_rpc (rendezvous through a TCPStore on rank 0);
  first a2a   every rank calls `noop` on every other rank, all calls in flight at once (the connections open here);
  steady a2a  the same again;
  ring        a token passed rank to rank around the ring, --hops hops, each hop an @async_execution function that
              returns the next hop's future (a chain of calls holding no thread, as scale_bench's coroutines):
              µs per hop = time / (2 x hops);
  shutdown    rpc.shutdown() (graceful), up to every rank's return.
Then, per rank (median): open file descriptors and resident memory, after the steady phase.

  scripts/root.sh run trixie --pytorch python3 bench/pytorch_scale_bench.py --ranks 8,32 --hops 300
  /usr/bin/python3 bench/pytorch_scale_bench.py --ranks 8      # Debian 12's PyTorch 1.13

The store is told not to use libuv (USE_LIBUV=0): PyTorch 2.6's libuv TCPStore fails on these machines.
A world size that does not finish within --timeout-s is killed and reported as such.
"""
import argparse
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time

os.environ.setdefault("USE_LIBUV", "0")

import torch  # noqa: E402
import torch.distributed.rpc as rpc  # noqa: E402

PHASES = ["init", "first", "steady", "ring", "shutdown"]


def noop():
    return None


@rpc.functions.async_execution
def hop(world, remaining):
    fut = torch.futures.Future()
    if remaining == 0:
        fut.set_result(0)
        return fut
    me = rpc.get_worker_info().id
    return rpc.rpc_async(f"w{(me + 1) % world}", hop, args=(world, remaining - 1))


def resident_kb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGESIZE") // 1024


def run_rank(rank, world, port, hops, barrier, released, ended, ring_s, fds, rss):
    def phase(i, body):
        barrier.wait()
        released[i * world + rank] = time.monotonic()
        body()
        ended[i * world + rank] = time.monotonic()

    def init():
        opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=300)
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=world, rpc_backend_options=opts)

    def all_to_all():
        futs = [rpc.rpc_async(f"w{j}", noop) for j in range(world) if j != rank]
        torch.futures.wait_all(futs)

    def ring():
        if rank == 0:
            t0 = time.monotonic()
            rpc.rpc_sync("w1", hop, args=(world, hops - 1))
            ring_s.value = time.monotonic() - t0

    phase(0, init)
    phase(1, all_to_all)
    phase(2, all_to_all)
    fds[rank] = len(os.listdir("/proc/self/fd"))
    rss[rank] = resident_kb()
    phase(3, ring)
    phase(4, rpc.shutdown)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(world, hops, timeout_s):
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(world)
    released = ctx.Array("d", world * len(PHASES), lock=False)
    ended = ctx.Array("d", world * len(PHASES), lock=False)
    ring_s = ctx.Value("d", 0.0, lock=False)
    fds = ctx.Array("l", world, lock=False)
    rss = ctx.Array("l", world, lock=False)
    port = free_port()
    procs = [
        ctx.Process(target=run_rank, args=(r, world, port, hops, barrier, released, ended, ring_s, fds, rss))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    late = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if late:
        return None, f"{len(late)} rank(s) still running after {timeout_s} s, killed"
    failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        return None, f"rank(s) {failed[:8]} failed (exit codes {[procs[r].exitcode for r in failed[:8]]})"

    def span(i):
        return max(ended[i * world:(i + 1) * world]) - min(released[i * world:(i + 1) * world])

    connections = world * (world - 1)
    first, steady = span(1), span(2)
    return (world, span(0), first, steady, first / steady, (first - steady) / connections * 1e6,
            ring_s.value / (2 * hops) * 1e6, span(4), statistics.median(fds), statistics.median(rss) / 1024), None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="8,32", help="comma-separated world sizes")
    ap.add_argument("--hops", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per world size")
    args = ap.parse_args()
    sizes = [int(s) for s in args.ranks.split(",")]
    if any(n < 2 for n in sizes) or args.hops < 1:
        sys.exit("--ranks: each size 2 or more; --hops: 1 or more")
    print(f"# PyTorch {torch.__version__}, TensorPipe, default options; load before: {os.getloadavg()}")
    print("| ranks | init s | first a2a s | steady a2a s | first/steady | µs per new connection (host) | ring µs/hop "
          "| shutdown s | fds/rank | RSS MiB/rank |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    status = 0
    for _ in range(args.repeats):
        for n in sizes:
            row, error = run_world(n, args.hops, args.timeout_s)
            if error:
                print(f"| {n} | {error} |", flush=True)
                status = 1
                continue
            print("| %d | %.3f | %.3f | %.3f | %.1f | %.0f | %.1f | %.3f | %d | %.0f |" % row, flush=True)
    sys.exit(status)


if __name__ == "__main__":
    main()
