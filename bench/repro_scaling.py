#!/usr/bin/env python3
"""repro_scaling: the smallest program that shows why two pinned ranks are no faster than one here
(issue #19, section 2; the findings are in bench/README.md, "Why two ranks are not 2x here").

A 256 x 256 float32 matmul loop (4 matmuls a step), optionally an all_sum of the result each step.
Each rank does the work of one rank alone (weak scaling: the ideal is the same steps/s per rank).
Prints, per rank: wall and CPU seconds, steps/s, context switches, threads, CPU affinity.

Usage (MODE=none|allsum, N=256, STEPS=40):
    taskset -c 0 .venv/bin/python bench/repro_scaling.py                      # one rank alone
    taskset -c 0 .venv/bin/python bench/repro_scaling.py &                    # two plain processes,
    taskset -c 1 .venv/bin/python bench/repro_scaling.py; wait                #   no MLX distributed
    .venv/bin/mlx.launch --backend ring --hostfile hostfile.local.json -- \\
        .venv/bin/python bench/repro_scaling.py                               # two ring ranks
    # the same on pinned fabric hosts (a core each): FABRIC_PIN=1 make fabric-up HOSTS=2, then
    . runs/fabric/env.sh; mlx.launch --backend ring --hostfile "$HOSTFILE" -- "$PYTHON" "$PWD/bench/repro_scaling.py"
    # mlx.launch's own spin: CPU seconds of the launcher for a child that only sleeps
    /usr/bin/time -f '%U+%S s CPU in %e s' .venv/bin/mlx.launch --backend ring \\
        --hostfile hostfile.local.json -- sleep 5
"""

import os
import resource
import time

import mlx.core as mx

N, STEPS, MODE = int(os.environ.get("N", "256")), int(os.environ.get("STEPS", "40")), os.environ.get("MODE", "allsum")
group = mx.distributed.init()
a, b = mx.random.normal((N, N)), mx.random.normal((N, N))


def step(x):
    for _ in range(4):
        x = (x @ b) * 0.01
    return mx.distributed.all_sum(x) if MODE == "allsum" and group.size() > 1 else x


mx.eval(step(a))  # warm-up (and the ring's first connection)
t0, c0 = time.monotonic(), time.process_time()
for _ in range(STEPS):
    mx.eval(step(a))
wall, cpu, ru = time.monotonic() - t0, time.process_time() - c0, resource.getrusage(resource.RUSAGE_SELF)
print(f"rank {group.rank()}/{group.size()} mode {MODE} wall {wall:.2f} s cpu {cpu:.2f} s steps/s {STEPS / wall:.2f} "
      f"vcsw {ru.ru_nvcsw} ivcsw {ru.ru_nivcsw} threads {len(os.listdir('/proc/self/task'))} "
      f"affinity {sorted(os.sched_getaffinity(0))}", flush=True)
