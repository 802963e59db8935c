"""What page faults cost a CPU training step here, outside corpc: ResNet50 (bench/pytorch_pipeline.py's layers)
forward and backward on one batch, one thread, with Debian's torch. Run it twice, with glibc's default malloc and with
glibc told to keep freed memory, and compare the per-step times and minor faults:

  /usr/bin/time -f "%e s, %R minor faults" /usr/bin/python3 bench/page_fault_cost.py 48 128
  GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736:glibc.malloc.arena_max=1 \\
      /usr/bin/time -f "%e s, %R minor faults" /usr/bin/python3 bench/page_fault_cost.py 48 128

Arguments: batch size, image size, steps (default 3)."""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pytorch_pipeline as pp  # noqa: E402


def main():
    batch, size = int(sys.argv[1]), int(sys.argv[2])
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    torch.set_num_threads(1)
    first, second = pp.make_shard(1, 64, 1000, 0).body, pp.make_shard(2, 64, 1000, 0).body
    x = torch.randn(batch, 3, size, size)
    for step in range(steps):
        t0 = time.time()
        second(first(x)).sum().backward()
        print(f"step {step}: {time.time() - t0:.2f} s", flush=True)


if __name__ == "__main__":
    main()
