"""PyTorch's own Gloo allreduce of a small tensor between two local processes: the floor under the hybrid's step
(examples/ddp_rpc_hybrid --phases times the same allreduce through corpc's process group).

    scripts/root.sh run trixie --pytorch 'python3 bench/pytorch_gloo_allreduce.py [numel] [calls]'   # default 136, 500

Prints each rank's mean microseconds per dist.all_reduce, after 20 unmeasured calls.
"""
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank, port, numel, calls):
    torch.set_num_threads(1)
    # use_libuv=0: Debian 13's PyTorch 2.6 is built without libuv, which its TCPStore otherwise asks for.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}?use_libuv=0", rank=rank, world_size=2)
    t = torch.zeros(numel)
    for _ in range(20):
        dist.all_reduce(t)
    start = time.perf_counter()
    for _ in range(calls):
        dist.all_reduce(t)
    us = (time.perf_counter() - start) / calls * 1e6
    print(f"pytorch {torch.__version__} rank {rank}: gloo all_reduce of {numel} floats {us:.1f} us", flush=True)
    dist.destroy_process_group()


def main():
    numel = int(sys.argv[1]) if len(sys.argv) > 1 else 136
    calls = int(sys.argv[2]) if len(sys.argv) > 2 else 500
    with socket.socket() as s:  # a free port from the OS
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(port, numel, calls), nprocs=2)


if __name__ == "__main__":
    main()
