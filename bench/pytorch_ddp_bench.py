"""PyTorch's DDP (gloo, CPU) on the same models, data sizes and threads as bench/ddp_bench.cpp.

    python3 bench/pytorch_ddp_bench.py <linear|cnn> [steps]    # prints "pytorch <model> <steps/s>"
"""
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn


def big_linear():
    layers = []
    for i in range(4):
        layers.append(nn.Linear(1024, 1024))
        if i < 3:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def small_cnn():
    return nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(64, 128, 3, padding=1, stride=2), nn.ReLU(),
                         nn.Conv2d(128, 256, 3, padding=1, stride=2), nn.ReLU(),
                         nn.Conv2d(256, 256, 3, padding=1, stride=2), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, 10))


def run(rank, model, steps, port):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(rank)
    if model == "linear":
        net, x, y, loss_fn = big_linear(), torch.randn(32, 1024), torch.randn(32, 1024), nn.functional.mse_loss
    else:
        net, x, y, loss_fn = small_cnn(), torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,)), nn.functional.cross_entropy
    ddp = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    warmup = 3
    for i in range(warmup + steps):
        if i == warmup:
            start = time.perf_counter()
        opt.zero_grad()
        loss_fn(ddp(x), y).backward()
        opt.step()
    dist.all_reduce(torch.zeros(1))
    secs = time.perf_counter() - start
    if rank == 0:
        print(f"pytorch {model} {steps / secs:.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    model = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(model, steps, port), nprocs=2)
