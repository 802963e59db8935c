#!/usr/bin/python3
"""torch.distributed.pipelining (PyTorch >= 2.4) on corpc's pipeline benchmark.

The job of bench/pipeline_bench.cpp and bench/pytorch_pipeline.py: ResNet50 (the tutorial's shards from
bench/pytorch_pipeline.py, same definition and seeds, flattened into the 23 layers of corpc's Sequential), SGD lr 0.05,
MSE on one-hot labels, batch 32 of 64x64 images, 1 warm-up batch then 3 timed, one intra-op thread per process, CPU.
Here the stages run under torch.distributed.pipelining the way its documentation shows: each of 2 ranks (Gloo)
builds a PipelineStage from its nn.Sequential slice (runtime shape inference), a schedule with loss_fn drives
schedule.step(), and each rank steps its own SGD. Cut by --balance (layers per stage), as corpc's run was cut.

Schedules (2 ranks): GPipe and 1F1B with one stage per rank (--balance 2:...); Interleaved1F1B, LoopedBFS and
InterleavedZeroBubble with two stages per rank, loop placement (rank r holds stages r and r+2); ZBVZeroBubble with the
V placement (rank 0 holds stages 0 and 3, rank 1 stages 1 and 2; passed as stage_index_to_group_rank where the class
takes it, as 2.6's does; 2.14's places its V itself) (--balance 4:...).

The loss: loss_fn is MSE times the micro-batch's share of the batch, which is what corpc does, and the schedules sum
the micro-batches' gradients (2.6's always do; later releases are given scale_grads=False, since their default
divides the gradients by the number of micro-batches once more): the step's loss (the sum of the micro-batches' losses) and
its gradients are then those of the whole batch. Training-mode BatchNorm normalizes each micro-batch by its own
statistics (in corpc too), so the check's reference is the same model trained in this one process on the same
micro-batches (gradients accumulated): the first step's loss must equal it (1e-4 relative), and so must every later
step's, against the reference whose backwards ran in the run's order (micro-batch order, or reverse for LoopedBFS:
the same gradient sums, rounded differently, move the loss by up to 0.5% two SGD steps later).

Each (schedule, splits) runs in 2 fresh processes in their own process group, killed at --timeout. Failures are
reported, not raised: FAILED:timeout (a hang), FAILED:exception (with its message), and a finished run whose loss is
NaN or differs from the reference is flagged NAN / WRONG-LOSS (its time is printed but is not a valid result).

PyTorch 2.6's multi-stage schedules hang on Gloo in their first step: the batched send/receive helper
(schedules._batch_p2p) keeps only the last Work of dist.batch_isend_irecv, which on Gloo returns one Work per op
(pytorch#132644, fixed upstream by pytorch#152938 after 2.6). --p2p-fix auto (default) replaces that helper at runtime,
in the rank processes, with the upstream fix's behaviour (wait for every Work) when the installed schedules.py has the
bug, and says so in the output; --p2p-fix off runs the library as installed.

Output, one line per result (machine-readable; '#' lines are comments):
  reference <seconds|-> <first-step loss>   the unsplit model, whole batches, one process (--reference-time,
                                            --reference-only: that alone)
  reference-usage <cpu seconds> <intra-op threads> <inter-op threads>   that process's, over the timed batches
  pipelining <Schedule> <splits> <seconds|FAILED:timeout|FAILED:exception> <first-step loss|-> <ok|NAN|WRONG-LOSS|->
             # detail
  pipelining-usage <Schedule> <splits> <cpu seconds per rank, comma-separated> <intra-op threads per rank>
             <inter-op threads per rank>   after a finished run: each rank's CPU time over the timed batches
             (getrusage) and the threads torch used
and a last line "JSON: {...}".

Runs with Debian testing's python3-torch 2.14 in the root of `scripts/root.sh make forky` (what
scripts/benchmark.sh uses), or Debian 13's 2.6 in that of `scripts/root.sh make trixie --pytorch`:
  scripts/root.sh run forky python3 bench/pytorch_pipelining.py --splits 2 4 --balance 2:13,10 4:9,5,4,5
"""
import argparse
import json
import math
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time


def cpu_seconds():
    """This process's user + system CPU time (getrusage), to compare with its wall-clock time."""
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def _threads_argument():
    """--threads, read before torch loads OpenBLAS, whose pool size comes from the environment at load time."""
    for i, a in enumerate(sys.argv):
        if a == "--threads" and i + 1 < len(sys.argv):
            return sys.argv[i + 1]
        if a.startswith("--threads="):
            return a.split("=", 1)[1]
    return "1"


# OpenMP's and OpenBLAS's pools, as pipeline_bench caps them (bench::set_blas_threads); the ranks inherit these.
os.environ["OMP_NUM_THREADS"] = os.environ["OPENBLAS_NUM_THREADS"] = _threads_argument()

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pytorch_pipeline import make_batch, make_shard  # noqa: E402  the tutorial comparison's model and data

# name -> (stages per rank, placement)
SCHEDULES = {
    "GPipe": (1, "loop"),
    "1F1B": (1, "loop"),
    "Interleaved1F1B": (2, "loop"),
    "LoopedBFS": (2, "loop"),
    "InterleavedZeroBubble": (2, "loop"),
    "ZBVZeroBubble": (2, "v"),
}
WORLD = 2
RTOL = 1e-4  # relative, between a step's loss and the one-process reference's
ORDERS = ("micro-batch order", "reverse micro-batch order")  # the backward order of the reference's micro-batches


def stage_ranks(stages_per_rank, placement):
    """stage index -> rank."""
    n = WORLD * stages_per_rank
    if placement == "v":  # rank r: stages r and n-1-r
        return {s: (s if s < WORLD else n - 1 - s) for s in range(n)}
    return {s: s % WORLD for s in range(n)}


def model_layers(args):
    """The tutorial's two shards (seeds 0 and 1), flattened into corpc's 23 layers: stem (4), 16 bottlenecks,
    head (3)."""
    layers = []
    for index, seed in ((1, 0), (2, 1)):
        for m in make_shard(index, args.base_width, args.num_classes, seed, "cpu").body:
            layers += list(m) if isinstance(m, nn.Sequential) else [m]
    return layers


def bounds(balance):
    out = [0]
    for n in balance:
        out.append(out[-1] + n)
    return out


def chunk_share(y, batch):
    return y.shape[0] / batch


def make_loss_fn(batch):
    def loss_fn(output, target):  # the micro-batch's MSE times its share of the batch (corpc's scaling)
        return F.mse_loss(output, target) * chunk_share(target, batch)

    return loss_fn


def step_inputs(args):
    """The batches of each step, warm-up first: corpc warms up on batch 0, then times batches 0..N-1."""
    data = [make_batch(args.batch_size, args.image_size, args.num_classes, b) for b in range(args.num_batches)]
    return data[:1] * args.warmup, data


# ---------------------------------------------------------------------------------------------------------- the ranks
class _AllWorks:
    """What pytorch#152938 makes _batch_p2p return in effect: every Work of one batch_isend_irecv, waited together."""

    def __init__(self, works):
        self.works = works

    def wait(self):
        for w in self.works:
            w.wait()
        return True


def p2p_fix_needed():
    import inspect

    from torch.distributed.pipelining import schedules

    return "batch_isend_irecv(p2p_ops).pop()" in inspect.getsource(schedules._batch_p2p)


def apply_p2p_fix():
    import torch.distributed as dist
    from torch.distributed.pipelining import schedules

    def _batch_p2p(p2p_ops, desc=None):
        if len(p2p_ops) == 0:
            return None
        return _AllWorks(dist.batch_isend_irecv(p2p_ops))

    schedules._batch_p2p = _batch_p2p  # _sorted_batch_p2p and every schedule look it up in the module


def schedule_kwargs(cls, placement, to_rank):
    """What this release's schedule class takes beyond the stages, micro-batches and loss, by its signature:
    - scale_grads=False (after 2.6): each micro-batch's loss is already its share of the batch's (make_loss_fn), so the
      schedule must not divide the gradients by the number of micro-batches a second time (its default does);
    - the V placement, where the class asks for it (2.6's ZBVZeroBubble; 2.14's places its V itself)."""
    import inspect

    params = inspect.signature(cls.__init__).parameters
    kw = {}
    if "scale_grads" in params:
        kw["scale_grads"] = False
    if placement == "v" and "stage_index_to_group_rank" in params:
        kw["stage_index_to_group_rank"] = to_rank
    return kw


def run_rank(args):
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed import pipelining

    torch.set_num_threads(args.threads)
    if args.p2p_fix == "on":
        apply_p2p_fix()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}?use_libuv=0", rank=args.rank,
                            world_size=WORLD, timeout=timedelta(seconds=args.timeout))
    per_rank, placement = SCHEDULES[args.schedule]
    n_stages = WORLD * per_rank
    to_rank = stage_ranks(per_rank, placement)
    b = bounds(args.balance[n_stages])
    layers = model_layers(args)
    mine = sorted(s for s, r in to_rank.items() if r == args.rank)
    stages = [pipelining.PipelineStage(nn.Sequential(*layers[b[s]:b[s + 1]]), s, n_stages, torch.device("cpu"))
              for s in mine]
    del layers
    cls = getattr(pipelining, "Schedule" + args.schedule)
    loss_fn = make_loss_fn(args.batch_size)
    schedule = cls(stages[0] if per_rank == 1 else stages, n_microbatches=args.splits, loss_fn=loss_fn,
                   **schedule_kwargs(cls, placement, to_rank))
    opt = torch.optim.SGD([p for s in stages for p in s.submod.parameters()], lr=0.05)
    has_first, has_last = 0 in mine, n_stages - 1 in mine

    def step(x, y):
        opt.zero_grad()
        inputs = (x,) if has_first else ()
        losses = []
        if has_last:
            schedule.step(*inputs, target=y, losses=losses)
        else:
            schedule.step(*inputs)
        opt.step()
        return sum(loss.item() for loss in losses) if has_last else None

    warmup, data = step_inputs(args)
    step_losses = []
    for k, (x, y) in enumerate(warmup):
        step_losses.append(step(x, y))
        print(f"STEP {k + 1}", flush=True)
    dist.barrier()
    t0, cpu0 = time.perf_counter(), cpu_seconds()
    for k, (x, y) in enumerate(data):
        step_losses.append(step(x, y))
        print(f"STEP {len(warmup) + k + 1}", flush=True)
    dist.barrier()
    seconds, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    print("RESULT " + json.dumps({"rank": args.rank, "seconds": seconds, "losses": step_losses if has_last else None,
                                  "cpu": cpu, "threads": torch.get_num_threads(),
                                  "interop": torch.get_num_interop_threads()}), flush=True)
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------------- the driver
def reference_losses(args, splits, order):
    """Every step's loss of the unsplit model trained here on the same micro-batches: the micro-batches' forwards, then
    their backwards in `order` (one of ORDERS), gradients accumulated. The order matters after the first step: the
    same gradients summed in another order round differently, and two SGD steps later that shows in the loss (0.5%
    at 4 micro-batches). LoopedBFS runs its backwards in reverse order; the other schedules in order."""
    net = nn.Sequential(*model_layers(args))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    loss_fn = make_loss_fn(args.batch_size)
    warmup, data = step_inputs(args)
    out = []
    for x, y in warmup + data:
        opt.zero_grad()
        losses = [loss_fn(net(xs), ys) for xs, ys in zip(torch.tensor_split(x, splits), torch.tensor_split(y, splits))]
        for loss in reversed(losses) if order == ORDERS[1] else losses:
            loss.backward()
        opt.step()
        out.append(sum(loss.item() for loss in losses))
    return out


class References:
    """reference_losses for one number of micro-batches, each order computed when first asked for (and printed)."""

    def __init__(self, args, splits):
        self.args, self.splits, self.cache = args, splits, {}

    def __call__(self, order=ORDERS[0]):
        if self.splits == 1:
            order = ORDERS[0]  # one micro-batch: one order
        if order not in self.cache:
            self.cache[order] = reference_losses(self.args, self.splits, order)
            print(f"# reference losses at {self.splits} micro-batch(es), one process, backwards in {order}: "
                  + " ".join(f"{v:.6g}" for v in self.cache[order]), flush=True)
        return self.cache[order]


def reference_time(args):
    """The unsplit model, whole batches, this process: the floor, like pipeline_bench's one-process run."""
    net = nn.Sequential(*model_layers(args))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    warmup, data = step_inputs(args)

    def step(x, y):
        opt.zero_grad()
        loss = F.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    first = [step(x, y) for x, y in warmup]
    t0, cpu0 = time.perf_counter(), cpu_seconds()
    losses = [step(x, y) for x, y in data]
    return time.perf_counter() - t0, (first + losses)[0], cpu_seconds() - cpu0


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def last_error(text):
    """The exception line of a traceback (or the last non-empty line)."""
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", line).strip() for line in text.splitlines()]
    lines = [line for line in lines if line]
    for line in reversed(lines):
        if not line.startswith(("File ", "^", "~")) and ("Error" in line or "Exception" in line or ":" in line):
            return line[:300]
    return lines[-1][:300] if lines else "no output"


def run_one(args, schedule, splits, p2p_fix):
    """Two rank processes in a new process group; returns (seconds or None, losses or None, failure or None, each
    rank's {"cpu", "threads", "interop"} in rank order)."""
    port = free_port()
    env = dict(os.environ, USE_LIBUV="0")
    common = [sys.executable, os.path.abspath(__file__), "--rank-of", schedule, "--splits", str(splits),
              "--port", str(port), "--p2p-fix", p2p_fix, "--timeout", str(args.timeout),
              "--batch-size", str(args.batch_size), "--image-size", str(args.image_size),
              "--num-batches", str(args.num_batches), "--warmup", str(args.warmup), "--threads", str(args.threads),
              "--base-width", str(args.base_width), "--num-classes", str(args.num_classes),
              "--balance"] + [f"{n}:{','.join(map(str, b))}" for n, b in args.balance.items()]
    logs = tempfile.TemporaryDirectory(prefix="pipelining_")
    procs, outs, errs = [], [], []
    for rank in range(WORLD):
        out = open(os.path.join(logs.name, f"out{rank}"), "w+")
        err = open(os.path.join(logs.name, f"err{rank}"), "w+")
        group = 0 if rank == 0 else procs[0].pid  # a new process group, rank 0's: killed together
        kw = ({"process_group": group} if sys.version_info >= (3, 11) else
              {"preexec_fn": lambda g=group: os.setpgid(0, g)})
        procs.append(subprocess.Popen(common + ["--rank", str(rank)], stdout=out, stderr=err, env=env, **kw))
        outs.append(out)
        errs.append(err)
    deadline = time.monotonic() + args.timeout
    failure = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c == 0 for c in codes):
            break
        bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if bad:
            time.sleep(1)  # let the other rank end too: its error may be the cause, this one's the consequence
            found = []
            for r, p in enumerate(procs):
                if p.poll() not in (None, 0):
                    errs[r].seek(0)
                    found.append((r, last_error(errs[r].read())))
            cause = [f for f in found if "Connection closed by peer" not in f[1]] or found
            failure = f"exception: rank {cause[0][0]}: {cause[0][1]}"
            break
        if time.monotonic() >= deadline:
            steps = []
            for f in outs:
                f.seek(0)
                steps.append(sum(1 for line in f if line.startswith("STEP ")))
            failure = (f"timeout: no result in {args.timeout:g} s (a hang: steps finished per rank "
                       f"{' / '.join(map(str, steps))} of {args.warmup + args.num_batches})")
            break
        time.sleep(0.1)
    try:
        os.killpg(procs[0].pid, signal.SIGKILL)  # the group: both ranks and anything they started
    except ProcessLookupError:
        pass
    for p in procs:
        p.wait()
    seconds, losses, usage = None, None, {}
    if failure is None:
        for f in outs:
            f.seek(0)
            for line in f:
                if line.startswith("RESULT "):
                    r = json.loads(line[7:])
                    seconds = max(seconds or 0.0, r["seconds"])
                    losses = r["losses"] if r["losses"] is not None else losses
                    usage[r["rank"]] = {k: r.get(k) for k in ("cpu", "threads", "interop")}
    if args.verbose or failure:
        for rank, f in enumerate(errs):
            f.seek(0)
            text = f.read().strip()
            if args.verbose and text:
                print("\n".join(f"#   rank {rank}: {line}" for line in text.splitlines()[-20:]), file=sys.stderr)
    for f in outs + errs:
        f.close()
    logs.cleanup()
    return seconds, losses, failure, [usage[r] for r in sorted(usage)]


def check(losses, references):
    """ok, NAN or WRONG-LOSS, and a detail. The first step's loss decides first: it must equal the one-process loss
    (RTOL), which is the same in either backward order. Then every later step's: none NaN, and all within RTOL of the
    reference trained with its backwards in one of ORDERS."""
    if not losses:
        return "NAN", "no loss came back from the last stage"
    bad = lambda v: math.isnan(v) or math.isinf(v)  # noqa: E731

    def rel(reference):
        return [abs(a - b) / abs(b) if not bad(a) else math.inf for a, b in zip(losses, reference)]

    def shown(reference):
        return f"losses {[round(v, 6) for v in losses]}, reference {[round(v, 6) for v in reference]}"

    first = references()
    if bad(losses[0]):
        return "NAN", f"first step's loss is {losses[0]}; {shown(first)}"
    if rel(first)[0] > RTOL:
        return "WRONG-LOSS", f"first step's loss differs by {rel(first)[0]:.2g} relative; {shown(first)}"
    for k, v in enumerate(losses[1:], start=2):
        if bad(v):
            return "NAN", f"first step matches, step {k}'s loss is {v}; {shown(first)}"
    for order in ORDERS:
        r = rel(references(order))
        if max(r) <= RTOL:
            return "ok", (f"every step's loss {'equals' if max(r) == 0 else f'within {max(r):.1g} relative of'} the "
                          f"one-process reference's (backwards in {order})")
    r = rel(first)
    k = next(i for i, v in enumerate(r) if v > RTOL)
    return "WRONG-LOSS", (f"first step matches, step {k + 1}'s loss differs by {r[k]:.2g} relative (and from the "
                          f"reverse-order reference's); {shown(first)}")


def parse_balance(items):
    out = {}
    for item in items:
        n, _, layers = item.partition(":")
        b = [int(v) for v in layers.split(",")]
        if int(n) != len(b):
            raise SystemExit(f"--balance {item}: {n} stages but {len(b)} numbers")
        out[int(n)] = b
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated: " + ",".join(SCHEDULES))
    p.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8], help="micro-batches per step")
    p.add_argument("--balance", nargs="+", default=["2:13,10", "4:9,5,4,5"],
                   help="layers per stage, as STAGES:N,N,...; 2 stages for GPipe/1F1B, 4 for the others")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--num-batches", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="untimed batches first (batch 0 again, as corpc)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--base-width", type=int, default=64)
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--timeout", type=float, default=180, help="seconds for each (schedule, splits) run")
    p.add_argument("--p2p-fix", choices=["auto", "on", "off"], default="auto",
                   help="replace schedules._batch_p2p by the upstream fix (pytorch#152938) where it is needed")
    p.add_argument("--reference-time", action="store_true", help="also time the unsplit model in one process")
    p.add_argument("--reference-only", action="store_true", help="time the unsplit model in one process, nothing else")
    p.add_argument("--probe", action="store_true", help="print the torch version and whether pipelining imports")
    p.add_argument("--verbose", action="store_true", help="the ranks' stderr on this one's")
    p.add_argument("--rank-of", help=argparse.SUPPRESS)  # internal: run one rank of this schedule
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.balance = parse_balance(args.balance)
    os.environ["USE_LIBUV"] = "0"  # this Gloo's TCPStore has no libuv

    if args.rank_of:
        args.schedule, args.splits = args.rank_of, args.splits[0]
        run_rank(args)
        return
    if args.probe:
        from torch.distributed import pipelining  # noqa: F401

        print(f"torch {torch.__version__}: torch.distributed.pipelining imports")
        return

    torch.set_num_threads(args.threads)
    schedules = [s for s in args.schedules.split(",") if s]
    for s in schedules:
        if s not in SCHEDULES:
            raise SystemExit(f"unknown schedule {s}; known: {', '.join(SCHEDULES)}")
    needed = p2p_fix_needed()
    p2p_fix = {"auto": "on" if needed else "off", "on": "on", "off": "off"}[args.p2p_fix]
    print(f"# torch {torch.__version__}: torch.distributed.pipelining, Gloo, CPU, {WORLD} ranks, "
          f"{args.threads} thread(s) each; balance "
          + " ".join(f"{n}:{','.join(map(str, b))}" for n, b in sorted(args.balance.items())), flush=True)
    if p2p_fix == "on":
        print("# PATCHED at runtime: torch.distributed.pipelining.schedules._batch_p2p waits for every Work of "
              "batch_isend_irecv (upstream fix pytorch#152938 for the Gloo hang pytorch#132644; "
              f"installed version {'has' if needed else 'lacks'} the bug)", flush=True)
    elif needed:
        print("# NOT patched (--p2p-fix off): schedules._batch_p2p waits for the last Work only (pytorch#132644)",
              flush=True)
    results = {"torch": torch.__version__, "p2p_fix": p2p_fix == "on", "runs": []}
    if args.reference_time or args.reference_only:
        seconds, loss, cpu = reference_time(args)
        results["reference"] = seconds
        print(f"reference {seconds:.3f} {loss:.6g}", flush=True)
        print(f"reference-usage {cpu:.3f} {torch.get_num_threads()} {torch.get_num_interop_threads()}", flush=True)
    for splits in [] if args.reference_only else args.splits:
        references = References(args, splits)
        references()
        for name in schedules:
            seconds, losses, failure, usage = run_one(args, name, splits, p2p_fix)
            run = {"schedule": name, "splits": splits, "seconds": seconds, "losses": losses}
            if failure:
                kind = failure.split(":")[0]
                run["failed"] = failure
                failure += "; p2p fix applied" if p2p_fix == "on" else ""
                print(f"pipelining {name} {splits} FAILED:{kind} - - # {failure}", flush=True)
            else:
                flag, detail = check(losses, references)
                run["check"] = flag
                first = f"{losses[0]:.6g}" if losses else "-"
                detail += "; p2p fix applied" if p2p_fix == "on" else ""
                print(f"pipelining {name} {splits} {seconds:.3f} {first} {flag} # {detail}", flush=True)
                column = lambda key, fmt: ",".join(fmt.format(u[key]) for u in usage)  # noqa: E731
                print(f"pipelining-usage {name} {splits} {column('cpu', '{:.3f}')} {column('threads', '{}')} "
                      f"{column('interop', '{}')}", flush=True)
            results["runs"].append(run)
    print("JSON: " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
