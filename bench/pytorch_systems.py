"""PyTorch's versions of the training systems in examples/ (tutorial code; same model, batch and one intra-op thread).

    python3 bench/pytorch_systems.py ps-async <trainers> <steps>   # parameter server, updates as gradients arrive
    python3 bench/pytorch_systems.py ps-batch <trainers> <steps>   # batch-updating server (@async_execution)
    python3 bench/pytorch_systems.py hybrid 2 <steps>              # DDP + RPC: 2 trainers, master, parameter server
Prints "pytorch <case> <trainers> <steps/s>".
"""
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # read when libopenblas loads, i.e. on `import torch`

import socket
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.nn import RemoteModule
from torch.distributed.optim import DistributedOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

WARMUP = 10
LR = 0.05


# ---- parameter servers: MLP 784-128-10, batch 32 (examples/systems/param_server.cpp) --------------------------------
def init_parameters(seed):
    g = torch.Generator().manual_seed(seed)
    b1, b2 = 1 / 784 ** 0.5, 1 / 128 ** 0.5
    return [torch.empty(128, 784).uniform_(-b1, b1, generator=g), torch.empty(128).uniform_(-b1, b1, generator=g),
            torch.empty(10, 128).uniform_(-b2, b2, generator=g), torch.empty(10).uniform_(-b2, b2, generator=g)]


def synthetic_batch(seed, trainer, step):
    teacher = torch.randn(784, 10, generator=torch.Generator().manual_seed(seed * 7919 + 17))
    g = torch.Generator().manual_seed(seed * 1000003 + trainer * 1000000 + step)
    x = torch.randn(32, 784, generator=g)
    return x, (x @ teacher).argmax(1)


def mlp(p, x):
    return F.linear(F.relu(F.linear(x, p[0], p[1])), p[2], p[3])


class AsyncParameterServer:
    def __init__(self, seed):
        self.lock = threading.Lock()
        self.params = init_parameters(seed)
        self.version = 0

    def get_parameters(self):
        with self.lock:
            return self.version, [p.clone() for p in self.params]

    @staticmethod
    def update_and_fetch(ps_rref, trainer, grads):
        self = ps_rref.local_value()
        with self.lock:
            for p, g in zip(self.params, grads):
                p.add_(g, alpha=-LR)
            self.version += 1
            return self.version, [p.clone() for p in self.params]


class BatchUpdatingParameterServer:
    def __init__(self, seed, trainers):
        self.lock = threading.Lock()
        self.params = init_parameters(seed)
        self.version = 0
        self.round = [None] * trainers
        self.received = 0
        self.future = torch.futures.Future()

    def get_parameters(self):
        with self.lock:
            return self.version, [p.clone() for p in self.params]

    @staticmethod
    @rpc.functions.async_execution
    def update_and_fetch(ps_rref, trainer, grads):
        self = ps_rref.local_value()
        with self.lock:
            self.round[trainer] = grads
            self.received += 1
            fut = self.future
            if self.received == len(self.round):
                for i, p in enumerate(self.params):
                    acc = self.round[0][i].clone()
                    for t in range(1, len(self.round)):
                        acc.add_(self.round[t][i])
                    p.add_(acc.div_(len(self.round)), alpha=-LR)
                self.version += 1
                self.round = [None] * len(self.round)
                self.received = 0
                fut.set_result((self.version, [p.clone() for p in self.params]))
                self.future = torch.futures.Future()
        return fut


def ps_trainer(ps_rref, server_cls, trainer, steps, seed):
    _, params = ps_rref.rpc_sync().get_parameters()
    for step in range(steps):
        x, y = synthetic_batch(seed, trainer, step)
        leaves = [p.detach().requires_grad_() for p in params]
        grads = torch.autograd.grad(F.cross_entropy(mlp(leaves, x), y), leaves)
        _, params = rpc.rpc_sync(ps_rref.owner(), server_cls.update_and_fetch, args=(ps_rref, trainer, list(grads)))
    return steps


def run_ps(rank, world, case, steps, port):
    torch.set_num_threads(1)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc("ps" if rank == 0 else f"trainer{rank - 1}", rank=rank, world_size=world, rpc_backend_options=opts)
    if rank == 0:
        trainers = world - 1
        server_cls = AsyncParameterServer if case == "ps-async" else BatchUpdatingParameterServer
        server = AsyncParameterServer(0) if case == "ps-async" else BatchUpdatingParameterServer(0, trainers)
        ps_rref = rpc.RRef(server)

        def run_all(n):
            futs = [rpc.rpc_async(f"trainer{t}", ps_trainer, args=(ps_rref, server_cls, t, n, 0)) for t in range(trainers)]
            for f in futs:
                f.wait()

        run_all(WARMUP)
        start = time.perf_counter()
        run_all(steps)
        secs = time.perf_counter() - start
        print(f"pytorch {case} {trainers} {steps * trainers / secs:.2f}", flush=True)
    rpc.shutdown()


# ---- DDP + RPC: the tutorial's HybridModel (examples/systems/hybrid.cpp) ---------------------------------------------
NUM_EMBEDDINGS, EMBEDDING_DIM = 100, 16


class HybridModel(nn.Module):
    def __init__(self, remote_emb_module):
        super().__init__()
        self.remote_emb_module = remote_emb_module
        self.fc = DDP(nn.Linear(16, 8))

    def forward(self, indices, offsets):
        return self.fc(self.remote_emb_module.forward(indices, offsets))


def get_batch(trainer, step):
    g = torch.Generator().manual_seed(1000003 * 0 + trainer * 1000000 + step)
    n = int(torch.randint(20, 51, (1,), generator=g))
    indices = torch.randint(0, NUM_EMBEDDINGS, (n,), generator=g)
    offsets, start = [], 0
    while start < n:
        offsets.append(start)
        start += int(torch.randint(1, 11, (1,), generator=g))
    return indices, torch.LongTensor(offsets), torch.randint(0, 8, (len(offsets),), generator=g)


def hybrid_trainer(remote_emb_module, rank, steps):
    model = HybridModel(remote_emb_module)
    params = model.remote_emb_module.remote_parameters()
    for p in model.fc.parameters():
        params.append(rpc.RRef(p))
    opt = DistributedOptimizer(torch.optim.SGD, params, lr=LR)
    criterion = nn.CrossEntropyLoss()
    for step in range(WARMUP + steps):
        if step == WARMUP:
            start = time.perf_counter()
        indices, offsets, target = get_batch(rank, step)
        with dist_autograd.context() as context_id:
            loss = criterion(model(indices, offsets), target)
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
    return time.perf_counter() - start


def run_hybrid(rank, world, case, steps, port, pg_port):
    torch.set_num_threads(1)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    if rank == 2:
        rpc.init_rpc("master", rank=rank, world_size=world, rpc_backend_options=opts)
        emb = RemoteModule("ps", nn.EmbeddingBag, args=(NUM_EMBEDDINGS, EMBEDDING_DIM), kwargs={"mode": "sum"})
        futs = [rpc.rpc_async(f"trainer{t}", hybrid_trainer, args=(emb, t, steps)) for t in (0, 1)]
        secs = max(f.wait() for f in futs)
        print(f"pytorch {case} 2 {steps / secs:.2f}", flush=True)
    elif rank <= 1:
        dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{pg_port}")
        rpc.init_rpc(f"trainer{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    else:
        rpc.init_rpc("ps", rank=rank, world_size=world, rpc_backend_options=opts)
    rpc.shutdown()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    if sys.argv[1:] == ["--version"]:
        print(torch.__version__)
        sys.exit(0)
    case, trainers, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if case == "hybrid":
        mp.start_processes(run_hybrid, args=(4, case, steps, free_port(), free_port()), nprocs=4, start_method="fork")
    else:
        mp.start_processes(run_ps, args=(trainers + 1, case, steps, free_port()), nprocs=trainers + 1, start_method="fork")
