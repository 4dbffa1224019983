#!/usr/bin/env python3
"""gloo's uneven all-to-all (torch.distributed.all_to_all_single with split sizes) on 2 CPU
processes, at the sizes and splits of `cargo bench -p trl-runtime --bench comm`: rows of 256
f32, rank r keeping a quarter of its rows and sending three quarters to the other rank. One
JSON object per line: bytes (each rank's input) and milliseconds (the slower rank's mean)."""
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROW = 256


def iterations(mib):
    return 40 if mib <= 1 else 10 if mib <= 16 else 5 if mib <= 64 else 3


def splits(rank, rows):
    keep = rows // 4
    return [keep, rows - keep] if rank == 0 else [rows - keep, keep]


def worker(rank, port, sizes, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    for mib in sizes:
        rows = (mib << 20) // (4 * ROW)
        send = splits(rank, rows)
        recv = [splits(0, rows)[rank], splits(1, rows)[rank]]
        x = torch.ones(rows, ROW)
        y = torch.empty(sum(recv), ROW)
        dist.all_to_all_single(y, x, recv, send)
        n = iterations(mib)
        dist.barrier()
        t = time.perf_counter()
        for _ in range(n):
            dist.all_to_all_single(y, x, recv, send)
        secs = torch.tensor([(time.perf_counter() - t) / n], dtype=torch.float64)
        dist.all_reduce(secs, op=dist.ReduceOp.MAX)
        if rank == 0:
            out.put(json.dumps({"bytes": mib << 20, "time_ms": secs.item() * 1e3}))
    dist.destroy_process_group()


if __name__ == "__main__":
    port = int(sys.argv[1])
    sizes = [int(s) for s in sys.argv[2:]]
    queue = mp.get_context("spawn").Queue()
    mp.spawn(worker, args=(port, sizes, queue), nprocs=2)
    while not queue.empty():
        print(queue.get())
