#!/usr/bin/python3
"""PyTorch reference for corpc's pipeline benchmark.

The "Distributed Pipeline Parallelism Using RPC" tutorial: ResNet50 split
into two shards on two RPC workers, driven by a master that pipelines
micro-batches with RRefs and rpc_async, trains with distributed autograd and
a DistributedOptimizer (SGD, lr 0.05) on MSE against one-hot labels.

Differences from the tutorial, on purpose:
  * --splits is the NUMBER of micro-batches (x.chunk), where the tutorial's
    x.split(split_size) silently made it a chunk size;
  * the shards are written here (no torchvision) to match
    examples/resnet/resnet_shards.cpp, with a --base-width knob;
  * --warmup batches (default 1) run untimed first, then exactly --num-batches batches are timed, like the C++ bench.

--device cuda:N puts both shards on that device, as the tutorial's GPU version does: each shard moves its input
there and returns its output on the CPU, so tensors cross RPC (TensorPipe) on the CPU and no device map is needed;
the timed batches end with a synchronize of each worker's device. The backend is torch.distributed.rpc's TensorPipe
either way: no c10d process group (Gloo or NCCL) is involved.

Run with /usr/bin/python3 (Debian's python3-torch), or the Python of a CUDA build of torch for --device cuda:N.
The last line of output is "JSON: {...}" for drivers.
"""
import argparse
import json
import os
import socket
import sys
import threading
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef

EXPANSION = 4


def conv(inp, out, k, stride, pad):
    c = nn.Conv2d(inp, out, k, stride=stride, padding=pad, bias=False)
    nn.init.kaiming_normal_(c.weight, mode="fan_out", nonlinearity="relu")
    return c


class Bottleneck(nn.Module):
    def __init__(self, inplanes, planes, stride=1):
        super().__init__()
        out = planes * EXPANSION
        self.conv1, self.bn1 = conv(inplanes, planes, 1, 1, 0), nn.BatchNorm2d(planes)
        self.conv2, self.bn2 = conv(planes, planes, 3, stride, 1), nn.BatchNorm2d(planes)
        self.conv3, self.bn3 = conv(planes, out, 1, 1, 0), nn.BatchNorm2d(out)
        self.downsample = None
        if stride != 1 or inplanes != out:
            self.downsample = nn.Sequential(conv(inplanes, out, 1, stride, 0),
                                            nn.BatchNorm2d(out))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = torch.relu(self.bn1(self.conv1(x)))
        out = torch.relu(self.bn2(self.conv2(out)))
        return torch.relu(self.bn3(self.conv3(out)) + identity)


def make_layer(inplanes, planes, blocks, stride):
    layers = [Bottleneck(inplanes, planes, stride)]
    layers += [Bottleneck(planes * EXPANSION, planes) for _ in range(blocks - 1)]
    return nn.Sequential(*layers)


class Shard(nn.Module):
    """Runs on a worker; the master holds an RRef to it."""

    def __init__(self, body, device):
        super().__init__()
        self.device = torch.device(device)
        self.body = body.to(self.device)
        # RPC threads deliver micro-batches concurrently; one at a time per
        # shard is what a pipeline stage means (and what the tutorial does).
        self._lock = threading.Lock()

    def forward(self, x_rref):
        x = x_rref.to_here().to(self.device)  # no copy on the CPU
        with self._lock:
            return self.body(x).cpu()

    def parameter_rrefs(self):
        return [RRef(p) for p in self.parameters()]


def make_shard(index, base_width, num_classes, seed, device):
    # Seed on the worker so both split counts start from the same weights.
    torch.manual_seed(seed)
    w = base_width
    if index == 1:
        body = nn.Sequential(conv(3, w, 7, 2, 3), nn.BatchNorm2d(w), nn.ReLU(),
                             nn.MaxPool2d(3, stride=2, padding=1),
                             make_layer(w, w, 3, 1),
                             make_layer(w * EXPANSION, 2 * w, 4, 2))
    else:
        body = nn.Sequential(make_layer(2 * w * EXPANSION, 4 * w, 6, 2),
                             make_layer(4 * w * EXPANSION, 8 * w, 3, 2),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                             nn.Linear(8 * w * EXPANSION, num_classes))
    return Shard(body, device)


def synchronize(device):
    """Waits for the kernels queued on this worker's `device` (nothing to wait for on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class DistResNet50(nn.Module):
    def __init__(self, num_splits, base_width, num_classes, seed, device):
        super().__init__()
        self.num_splits = num_splits
        self.p1_rref = rpc.remote("worker1", make_shard, args=(1, base_width, num_classes, seed, device))
        self.p2_rref = rpc.remote("worker2", make_shard, args=(2, base_width, num_classes, seed + 1, device))

    def forward(self, xs):
        futs = []
        for x in xs.chunk(self.num_splits):
            y_rref = self.p1_rref.remote().forward(RRef(x))
            futs.append(self.p2_rref.rpc_async().forward(y_rref))
        return torch.cat(torch.futures.wait_all(futs))

    def parameter_rrefs(self):
        return (self.p1_rref.remote().parameter_rrefs().to_here() +
                self.p2_rref.remote().parameter_rrefs().to_here())


def make_batch(batch, image_size, num_classes, index):
    g = torch.Generator().manual_seed(1000 + index)
    images = torch.randn(batch, 3, image_size, image_size, generator=g)
    g = torch.Generator().manual_seed(2000 + index)
    idx = torch.randint(num_classes, (batch, 1), generator=g)
    labels = torch.zeros(batch, num_classes).scatter_(1, idx, 1.0)
    return images, labels


def too_small_micro_batch(batch, image_size, splits):
    """Training-mode BatchNorm needs more than one value per channel; layer4
    is image_size/32 pixels wide. Returns the offending size, or 0."""
    hw = image_size
    for _ in range(5):  # five stride-2 stages
        hw = (hw - 1) // 2 + 1
    smallest = min(len(c) for c in torch.empty(batch).chunk(splits))
    return smallest if smallest * hw * hw < 2 else 0


def sync_workers(device):
    if torch.device(device).type != "cpu":
        for worker in ("worker1", "worker2"):
            rpc.rpc_sync(worker, synchronize, args=(device,))


def run_master(args):
    print(f"# torch {torch.__version__}: torch.distributed.rpc, TensorPipe backend; shards on {args.device}",
          flush=True)
    data = [make_batch(args.batch_size, args.image_size, args.num_classes, b)
            for b in range(args.num_batches)]
    loss_fn = nn.MSELoss()
    results = {}
    for splits in args.splits:
        n = too_small_micro_batch(args.batch_size, args.image_size, splits)
        if n:
            print(f"splits {splits:3d}: skipped: a micro-batch of {n} image(s) of "
                  f"{args.image_size}px leaves one value per BatchNorm channel "
                  "in layer4", flush=True)
            continue
        model = DistResNet50(splits, args.base_width, args.num_classes, 0, args.device)
        opt = DistributedOptimizer(torch.optim.SGD, model.parameter_rrefs(), lr=0.05)
        for images, labels in data[:1] * args.warmup:  # untimed, like the C++ bench
            with dist_autograd.context() as ctx:
                dist_autograd.backward(ctx, [loss_fn(model(images), labels)])
                opt.step(ctx)
        sync_workers(args.device)
        t0 = time.perf_counter()
        for images, labels in data:
            with dist_autograd.context() as ctx:
                loss = loss_fn(model(images), labels)
                dist_autograd.backward(ctx, [loss])
                opt.step(ctx)
        sync_workers(args.device)
        seconds = time.perf_counter() - t0
        results[str(splits)] = seconds
        ips = args.batch_size * args.num_batches / seconds
        print(f"splits {splits:3d}: {seconds:8.3f} s  {ips:8.1f} images/s  "
              f"loss {loss.item():.5f}", flush=True)
        del model, opt  # frees the shards on the workers before the next run
    print("JSON: " + json.dumps({"splits": results}), flush=True)


def run_worker(rank, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.port)
    torch.set_num_threads(args.threads)
    options = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=64, rpc_timeout=args.timeout,
        init_method=f"tcp://127.0.0.1:{args.port}")
    name = "master" if rank == 0 else f"worker{rank}"
    rpc.init_rpc(name, rank=rank, world_size=3, rpc_backend_options=options)
    if rank == 0:
        run_master(args)
    rpc.shutdown()  # waits for every worker: the master's work ends the run


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--num-batches", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warmup", type=int, default=1, help="untimed batches before timing each split")
    p.add_argument("--base-width", type=int, default=64)
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--device", default="cpu", help="the shards' device: cpu or cuda:N")
    p.add_argument("--port", type=int, default=0, help="0: ask the OS")
    p.add_argument("--timeout", type=float, default=600,
                   help="seconds for each RPC and for the whole run")
    args = p.parse_args()
    if args.port == 0:
        args.port = free_port()

    # OpenMP's thread count is per thread: set it for every thread of the (freshly spawned) workers, RPC threads too.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ["OPENBLAS_NUM_THREADS"] = str(args.threads)  # OpenBLAS's own pool, as the C++ bench caps it
    ctx = mp.spawn(run_worker, args=(args,), nprocs=3, join=False)
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
