"""How fast this host hands a process fresh memory: map N GB of anonymous memory, write one
byte a page (each write a page fault: the kernel finds and zeroes a page), unmap; GB/s per size.

    python bench/fresh_memory.py [--sizes 2,6,12] [--repeats 3]

A tracer that maps and unmaps its copies' memory every step pays this rate on the bytes it
takes fresh (store/buffers.py keeps its buffers mapped for that reason). On a VM whose balloon
reports free memory back to the hypervisor, the rate falls once a process touches more than
the memory the host still backs: on the development host 2 and 6 GB ran at ~2.8 GB/s, 12 GB at
0.4-1.1 GB/s (docs/performance.md, 349M full mode).
"""
from __future__ import annotations

import argparse
import mmap
import time


def touch(nbytes: int) -> float:
    """Seconds to fault in ``nbytes`` of fresh private anonymous memory, one write a page."""
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    page = mmap.PAGESIZE
    start = time.perf_counter()
    for at in range(0, nbytes, page):
        memory[at] = 1
    took = time.perf_counter() - start
    memory.close()
    return took


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="2,6,12", help="GB to touch, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    print("| GB | seconds per run | GB/s per run |\n|---|---|---|")
    for gb in (float(x) for x in args.sizes.split(",")):
        runs = [touch(int(gb * (1 << 30))) for _ in range(args.repeats)]
        print(f"| {gb:g} | {', '.join(f'{t:.2f}' for t in runs)} | "
              f"{', '.join(f'{gb / t:.2f}' for t in runs)} |", flush=True)


if __name__ == "__main__":
    main()
