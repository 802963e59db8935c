"""PyTorch's DDP (gloo, CPU) on the same models, data sizes and threads as bench/ddp_bench.cpp.

    /usr/bin/python3 bench/pytorch_ddp_bench.py <linear|cnn|resnet18> [steps] [--phases]
    # prints "# params <model> <count>" and "pytorch <model> <steps/s>"; --phases: per-rank ms/step on stderr
"""
import ctypes
import os
import socket
import sys
import time

# "1 intra-op thread" as on the C++ side (bench_util.hpp's set_blas_threads): torch.set_num_threads does not reach
# Debian's OpenBLAS, whose own pool would otherwise run the matmuls (and convolutions lowered to them) on every core.
# Read when OpenBLAS loads, so before torch is imported; set OPENBLAS_NUM_THREADS yourself to measure otherwise.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402


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


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock, written out (Debian's python3-torchvision need not be installed)."""

    def __init__(self, inp, out, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(inp, out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out)
        self.conv2 = nn.Conv2d(out, out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out)
        self.downsample = None
        if stride != 1 or inp != out:
            self.downsample = nn.Sequential(nn.Conv2d(inp, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + (x if self.downsample is None else self.downsample(x)))


def resnet18(classes=1000):
    """torchvision.models.resnet18's layers in its registration order: 11,689,512 parameters."""
    layers = [nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
              nn.MaxPool2d(3, stride=2, padding=1)]
    inp = 64
    for width in (64, 128, 256, 512):
        layers += [BasicBlock(inp, width, 1 if width == 64 else 2), BasicBlock(width, width, 1)]
        inp = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes)]
    return nn.Sequential(*layers)


def make(model):
    """Model, this rank's batch, loss: as data() and make_model() in bench/ddp_bench.cpp."""
    if model == "linear":
        return big_linear(), torch.randn(32, 1024), torch.randn(32, 1024), nn.functional.mse_loss
    if model == "resnet18":
        return resnet18(), torch.randn(16, 3, 32, 32), torch.randint(0, 1000, (16,)), nn.functional.cross_entropy
    return small_cnn(), torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,)), nn.functional.cross_entropy


def blas_threads():
    try:
        return ctypes.CDLL("libopenblas.so.0").openblas_get_num_threads()
    except (OSError, AttributeError):
        return -1


def run(rank, model, steps, phases, port):
    torch.set_num_threads(1)
    # USE_LIBUV=0: Debian's PyTorch 2.14 (and 2.6) is built without libuv, which its TCPStore otherwise asks for
    # ("use_libuv was requested but PyTorch was built without libuv support"). The store only does the rendezvous.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), USE_LIBUV="0")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(rank)
    net, x, y, loss_fn = make(model)
    ddp = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    warmup = 3
    fwd = bwd = stp = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            start = time.perf_counter()
            cpu = time.process_time()  # every thread of this process: Gloo's too
            fwd = bwd = stp = 0.0
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = loss_fn(ddp(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        fwd, bwd, stp = fwd + t1 - t0, bwd + t2 - t1, stp + t3 - t2
    dist.all_reduce(torch.zeros(1))
    secs = time.perf_counter() - start
    cpu = time.process_time() - cpu
    if rank == 0:
        print(f"# params {model} {sum(p.numel() for p in net.parameters())}", flush=True)
        print(f"# threads pytorch: intra-op {torch.get_num_threads()}, OpenBLAS {blas_threads()}")
        print(f"pytorch {model} {steps / secs:.3f}", flush=True)
    if phases:
        ms = 1000 / steps
        print(f"# rank {rank} pytorch {model} ms/step: forward {fwd * ms:.1f} backward {bwd * ms:.1f} "
              f"step {stp * ms:.1f} cpu {cpu * ms:.1f}", file=sys.stderr, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    model = args[0]
    steps = int(args[1]) if len(args) > 1 else 20
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(model, steps, "--phases" in sys.argv, port), nprocs=2)
