#!/usr/bin/python3
"""PyTorch RPC microbenchmark, the reference for corpc's RPC numbers.

Two processes on 127.0.0.1 with the TensorPipe backend. Measures the
round-trip latency of rpc_sync to a no-op and of echoing a float32 tensor
(4 KiB .. 64 MiB), the throughput of no-op rpc_async with 64 calls in
flight, remote() + to_here() of a small value, and a chain across 3 workers
(client -> server -> server2, the middle hop an @async_execution function). Iterations are calibrated so each case takes about 1.5 s
(times --iters-scale). The last line of output is "JSON: {...}".

Two TensorPipe configurations: "tcp" (the uv TCP transport and the basic channel only: every byte through a socket,
as corpc's TCP path) runs every case; "default" (what TensorPipe picks by itself on one host: the shared-memory
transport and the cross-memory-attach channel, process_vm_readv) runs the large echoes (--default-cases), after the
TCP run, and its results are in the JSON as "<case>@default".

Run with /usr/bin/python3 (Debian's python3-torch).
"""
import argparse
import collections
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp

SIZES = {"4KiB": 4 << 10, "1MiB": 1 << 20, "16MiB": 16 << 20, "64MiB": 64 << 20}
CASES = ["noop", *SIZES, "async64", "remote", "chain"]
# TensorPipe's private options: None leaves its own choice (the default configuration).
CONFIGS = {"tcp": {"_transports": ["uv"], "_channels": ["basic"]}, "default": {}}
TARGET_S = 1.5
MIN_ITERS, MAX_ITERS = 5, 100_000
IN_FLIGHT = 64


def noop():
    return None


def echo(t):
    return t


def small_value():
    return 42


@rpc.functions.async_execution
def relay_noop():
    # The middle of the chain: returns the future of the next hop, holding no thread (as corpc's coroutine does).
    return rpc.rpc_async("server2", noop)


def remote_to_here():
    if rpc.remote("server", small_value).to_here() != 42:
        raise RuntimeError("remote: wrong value")


def iterations(per_call_s, scale):
    n = int(TARGET_S / max(per_call_s, 1e-9) * scale)
    return max(MIN_ITERS, min(MAX_ITERS, n))


def latency_case(fn, args, scale, call=None):
    call = call or (lambda: rpc.rpc_sync("server", fn, args=args))
    # Warm-up, which also opens the connection and calibrates.
    for _ in range(3):
        call()
    t0 = time.perf_counter()
    for _ in range(5):
        call()
    n = iterations((time.perf_counter() - t0) / 5, scale)
    samples = []
    for _ in range(n):
        t = time.perf_counter_ns()
        call()
        samples.append((time.perf_counter_ns() - t) / 1e3)
    samples.sort()
    p99 = samples[min(len(samples) - 1, int(0.99 * len(samples)))]
    return {"median_us": statistics.median(samples), "p99_us": p99, "iters": n}


def async_case(scale):
    def run(n):
        window = collections.deque()
        t0 = time.perf_counter()
        for _ in range(n):
            if len(window) == IN_FLIGHT:
                window.popleft().wait()
            window.append(rpc.rpc_async("server", noop))
        for f in window:
            f.wait()
        return time.perf_counter() - t0

    probe = 4 * IN_FLIGHT
    n = iterations(run(probe) / probe, scale)
    return {"calls_per_s": n / run(n), "iters": n}


def client(args):
    results = {}
    print(f"== TensorPipe configuration: {args.config}", flush=True)
    print(f"{'case':>8} {'iters':>7} {'median us':>11} {'p99 us':>11} {'MB/s':>9}",
          flush=True)
    for case in args.cases:
        if case == "async64":
            r = async_case(args.iters_scale)
            print(f"{case:>8} {r['iters']:7d} {r['calls_per_s']:>18.0f} calls/s",
                  flush=True)
        elif case == "noop":
            r = latency_case(noop, (), args.iters_scale)
        elif case == "remote":
            r = latency_case(None, (), args.iters_scale, call=remote_to_here)
        elif case == "chain":
            r = latency_case(relay_noop, (), args.iters_scale)
        else:
            t = torch.rand(SIZES[case] // 4)
            r = latency_case(echo, (t,), args.iters_scale)
        if case != "async64":
            nbytes = SIZES.get(case, 0)
            # The tensor travels both ways.
            mbps = f"{2 * nbytes / r['median_us']:9.0f}" if nbytes else f"{'-':>9}"
            print(f"{case:>8} {r['iters']:7d} {r['median_us']:11.1f} "
                  f"{r['p99_us']:11.1f} {mbps}", flush=True)
        del r["iters"]
        results[case] = r
    with open(args.out, "w") as f:
        json.dump(results, f)


def run(rank, args):
    torch.set_num_threads(1)
    options = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=16, rpc_timeout=args.timeout,
        init_method=f"tcp://127.0.0.1:{args.port}", **CONFIGS[args.config])
    rpc.init_rpc(["client", "server", "server2"][rank], rank=rank, world_size=args.world,
                 rpc_backend_options=options)
    if rank == 0:
        client(args)
    rpc.shutdown()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters-scale", type=float, default=1.0)
    p.add_argument("--cases", nargs="+", choices=CASES, default=CASES)
    p.add_argument("--port", type=int, default=0, help="0: ask the OS")
    p.add_argument("--timeout", type=float, default=300,
                   help="seconds for each RPC and for each configuration's run")
    p.add_argument("--default-cases", nargs="*", choices=list(SIZES), default=["1MiB", "16MiB", "64MiB"],
                   help="echo cases also run in TensorPipe's default configuration (none: skip it)")
    args = p.parse_args()
    results = {}
    runs = [("tcp", args.cases)]
    if args.default_cases:
        runs.append(("default", args.default_cases))
    for config, cases in runs:
        run_args = argparse.Namespace(**vars(args))
        run_args.config, run_args.cases = config, cases
        run_args.port = args.port or free_port()
        run_args.world = 3 if "chain" in cases else 2
        run_args.out = f"/tmp/pytorch_rpc_bench.{os.getpid()}.{config}.json"
        spawn(run_args)
        with open(run_args.out) as f:
            for case, r in json.load(f).items():
                results[case if config == "tcp" else f"{case}@{config}"] = r
        os.unlink(run_args.out)
        print(flush=True)
    print("JSON: " + json.dumps(results), flush=True)


def spawn(args):
    ctx = mp.spawn(run, args=(args,), nprocs=args.world, join=False)
    deadline = time.monotonic() + args.timeout
    try:
        while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                print(f"timed out after {args.timeout} s", file=sys.stderr)
                sys.exit(1)
    finally:
        for proc in ctx.processes:  # only reached alive on timeout or error
            if proc.is_alive():
                proc.kill()


if __name__ == "__main__":
    main()
