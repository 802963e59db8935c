#!/usr/bin/env python3
"""PyTorch's reference for bench/cuda_echo.cpp: CUDA tensors echoed between two processes on one GPU.

torch.distributed.rpc with the TensorPipe backend, two processes started by torch.multiprocessing; the master maps
its cuda:N to worker1's cuda:N (TensorPipeRpcBackendOptions.set_device_map) and worker1 replies through the inverse,
as PyTorch derives it. One round trip: rpc_sync of echo(t), t a float32 tensor of that many MiB on the device, then
torch.cuda.synchronize, exactly as cuda_echo. Per size: the median and minimum of --iters round trips after --warmup
untimed ones; the first reply is compared with what was sent.

Two TensorPipe channel configurations (--configs):
  default  what TensorPipe picks by itself on one host (for CUDA tensors its CUDA IPC channel when it can: the
           receiver copies straight from the sender's device memory)
  staged   the cuda_basic channel only: device memory staged through host memory on both sides, as corpc moves it

Output: a readable line per size and a line "RESULT pytorch-<config> <MiB> <median ms> <min ms>" for drivers; a
configuration that cannot run prints "RESULT-NA pytorch-<config> <why>" and the others still run.

Run with the Python that has the CUDA build of torch (on the GPU machines, /opt/torch/.venv/bin/python).
"""
import argparse
import os
import socket
import statistics
import sys
import time
import traceback

import torch
import torch.multiprocessing as mp

CONFIGS = {"default": {}, "staged": {"_channels": ["cuda_basic", "basic"]}}


def echo(t):
    return t


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def master(args, rpc):
    device = torch.device("cuda", args.device)
    for mib in args.sizes_mib:
        x = torch.rand(mib * (1 << 20) // 4, device=device)
        back = rpc.rpc_sync("worker1", echo, args=(x,))
        if back.device != device or not torch.equal(back, x):
            raise RuntimeError(f"the echo of {mib} MiB came back "
                               + (f"on {back.device}" if back.device != device else "with other values"))
        for _ in range(args.warmup):
            back = rpc.rpc_sync("worker1", echo, args=(x,))
        torch.cuda.synchronize(device)
        times = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            back = rpc.rpc_sync("worker1", echo, args=(x,))
            torch.cuda.synchronize(device)
            times.append((time.perf_counter() - t0) * 1e3)
        median = statistics.median(times)
        gbps = 2 * x.numel() * 4 / (median * 1e6)  # both directions
        print(f"{mib:8d} {median:12.3f} {min(times):12.3f} {gbps:10.2f}", flush=True)
        print(f"RESULT pytorch-{args.config} {mib} {median:.4f} {min(times):.4f}", flush=True)


def run(rank, args):
    import torch.distributed.rpc as rpc
    options = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=16, rpc_timeout=args.timeout,
        init_method=f"tcp://127.0.0.1:{args.port}", **CONFIGS[args.config])
    if rank == 0:
        options.set_device_map("worker1", {args.device: args.device})
    rpc.init_rpc(["master", "worker1"][rank], rank=rank, world_size=2, rpc_backend_options=options)
    try:
        if rank == 0:
            master(args, rpc)
    finally:
        rpc.shutdown()


def spawn(args):
    ctx = mp.spawn(run, args=(args,), nprocs=2, join=False)
    deadline = time.monotonic() + args.timeout
    try:
        while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"timed out after {args.timeout} s")
    finally:
        for proc in ctx.processes:  # only reached alive on timeout or error
            if proc.is_alive():
                proc.kill()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes-mib", type=lambda s: [int(v) for v in s.split(",")], default=[1, 16, 64])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", type=int, default=0, help="CUDA device index")
    p.add_argument("--configs", type=lambda s: s.split(","), default=list(CONFIGS),
                   help="comma-separated: " + ", ".join(CONFIGS))
    p.add_argument("--timeout", type=float, default=300, help="seconds for each configuration's run")
    args = p.parse_args()

    import torch.distributed.rpc as rpc
    if not rpc.is_available():
        for config in args.configs:
            print(f"RESULT-NA pytorch-{config} torch {torch.__version__} has no torch.distributed.rpc", flush=True)
        return 0
    if not torch.cuda.is_available() or torch.cuda.device_count() <= args.device:
        print(f"pytorch_cuda_rpc: no CUDA device cuda:{args.device} (torch {torch.__version__})", file=sys.stderr)
        return 2

    print(f"# torch {torch.__version__} (CUDA {torch.version.cuda}), TensorPipe; float32 tensors on cuda:{args.device} "
          f"echoed master -> worker1 -> master; median and min of {args.iters} round trips after {args.warmup} "
          "warm-up, each ended by torch.cuda.synchronize", flush=True)
    failed = 0
    for config in args.configs:
        if config not in CONFIGS:
            print(f"RESULT-NA pytorch-{config} unknown configuration", flush=True)
            failed += 1
            continue
        print(f"# configuration {config}: {CONFIGS[config] or 'TensorPipe chooses its transports and channels'}",
              flush=True)
        print(f"{'MiB':>8} {'median ms':>12} {'min ms':>12} {'GB/s':>10}", flush=True)
        run_args = argparse.Namespace(**vars(args))
        run_args.config, run_args.port = config, free_port()
        try:
            spawn(run_args)
        except Exception as e:  # one configuration's failure leaves the others to run
            traceback.print_exc()
            reason = " ".join(str(e).split())[:200] or type(e).__name__
            print(f"RESULT-NA pytorch-{config} {reason}", flush=True)
            failed += 1
    return 1 if failed == len(args.configs) else 0


if __name__ == "__main__":
    # The checks in main() initialize CUDA in this process; the ranks are spawned (fresh interpreters, not forks), so
    # they start CUDA for themselves.
    sys.exit(main())
