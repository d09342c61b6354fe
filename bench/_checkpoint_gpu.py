"""Measure 6 of bench/checkpoint.py: the same states on a GPU (see its docstring)."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import common
from checkpoint import FINALIZE, NAME, clock, mean, med, resnet_state, synthetic_state, table_rows, torch_saves
from trainguard.adapters.torch.snapshot import Snapshots
from trainguard.adapters.torch.state import flatten
from trainguard.core.checkpoint import CheckpointStore
from trainguard.core.snapshot import SnapshotDir


def gpu_rows(made: tuple, reps: int, tmp: Path, job: str) -> tuple[list[dict], dict]:
    """Measure 6 for one state on the GPU: blocked per checkpoint (take() into
    pinned slots + persist request, against torch.save and DCP async_save of
    the same CUDA state), and take()'s device-to-host bandwidth against one
    flat copy_ of the same bytes into a pinned tensor."""
    state, label = made[:2]
    tensors = flatten(state)[1]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def flat_copy() -> None:
        pinned.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
    saves, dcp_ret, _ = torch_saves(state, reps, tmp)
    shm, root = SnapshotDir.create(job), tmp / f"ckpt-{job}"
    snaps = Snapshots(shm, 0, count=2)
    snaps.staging_bytes = 64 << 20  # staging on (off by default), then off below: side by side
    blocked, take, flat = [], [], []
    try:
        first = [clock(lambda: snaps.take(state, step)) for step in (1, 2)]
        while snaps.worker.pending:
            snaps.poll(0.5)
        for i in range(reps):
            flat.append(clock(flat_copy))
            t0 = time.perf_counter()
            index = snaps.take(state, 10 + i)
            t1 = time.perf_counter()
            snaps.persist(index, 10 + i, root=str(root), name=NAME, finalize=FINALIZE)
            blocked.append(time.perf_counter() - t0)
            take.append(t1 - t0)
            snaps.wait(600)
            if snaps.errors or index is None:
                raise RuntimeError(f"persist failed: slot {index}, {snaps.errors}")
            for old in CheckpointStore(root).steps()[1:]:
                shutil.rmtree(CheckpointStore(root).final_path(old))
        pins, staged = snaps.pins, snaps.report(None)
        snaps.staging_bytes = 0  # the same take() with every tensor copied to the host on its own
        snaps.forget_views()
        unstaged = []
        for i in range(reps + 2):
            t0 = time.perf_counter()
            snaps.take(state, 100 + i)
            unstaged.append(time.perf_counter() - t0)
            snaps.wait(600)
        unstaged = unstaged[2:]  # the first of each slot registers it again
    finally:
        snaps.close()
        shm.remove()
    ours, save, async_ = mean(blocked), mean(saves[1:]), mean(dcp_ret[1:])
    rows = table_rows(label, (
        ("6 GPU blocked/ckpt", "trainguard take()+persist() req", ours, None,
         f"mean of {reps}; {nbytes / 1e6:.0f} MB in {len(tensors)} tensors; {pins} slots pinned"),
        ("6 GPU blocked/ckpt", "trainguard first take (allocates, pins)", mean(first), None,
         "per slot: " + ", ".join(f"{x:.3g}" for x in first) + " s"),
        ("6 GPU blocked/ckpt", "torch.save + fsync", save, None, f"mean of {reps}"),
        ("6 GPU blocked/ckpt", "DCP async_save (until return)", async_, None, f"mean of {reps}"),
        ("6 GPU->host", "trainguard take()", med(take), nbytes,
         f"median of {reps}; {staged['staged_copies']} staged + {staged['direct_copies']} direct copies "
         f"through a {staged['staging_MB']} MiB device buffer"),
        ("6 GPU->host", "trainguard take(), staging off", med(unstaged), nbytes,
         f"median of {reps}; one copy per tensor"),
        ("6 GPU->host", "pinned copy_: one flat tensor", med(flat), nbytes, f"median of {reps}; goal baseline")))
    return rows, {"vs_save": 100 * ours / save, "vs_async": ours / async_, "d2h": 100 * med(flat) / med(take),
                  "d2h_unstaged": 100 * med(flat) / med(unstaged),
                  "samples": {"blocked": blocked, "take": take, "unstaged": unstaged, "flat": flat, "torch_save": saves,
                              "async_save": dcp_ret}}


NOTE_6 = ("state on the GPU (ResNet-50 + AdamW after one step; the synthetic state); ours: take() gathers runs of "
          "small tensors on the device into a staging buffer (one _foreach_copy_ per dtype) and copies each run, "
          "and each larger tensor, with non_blocking into slots page-locked by cudaHostRegister, one synchronize, "
          "then a persist "
          "request (the worker writes from host memory); torch.save of the CUDA state + fsync; DCP async_save until "
          "it returns (it stages to CPU first); the baseline of the bandwidth: one flat device-to-host copy_ of the "
          "same bytes into a pinned tensor")
GPU_GOALS = [("blocked per checkpoint, ours / torch.save", "vs_save", 5, "%"),
             ("blocked per checkpoint, ours / DCP async_save", "vs_async", 1, "x"),
             ("take() device-to-host bandwidth / pinned copy", "d2h", 80, "%", True)]


def run_gpu(reps: int, layers: int, job: str, per_state: dict) -> tuple[list[dict], list]:
    rows, goals = [], []
    with tempfile.TemporaryDirectory(prefix="tg-bench-ckpt-gpu-") as d:
        tmp = Path(d)
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp / "pg"), 1), rank=0, world_size=1)
        try:
            for i, make in enumerate((lambda: resnet_state("cuda"), lambda: synthetic_state(layers, "cuda"))):
                made = make()
                got, r = gpu_rows(made, reps, tmp, f"{job}-gpu{i}")
                rows, per_state[f"GPU {made[1]}"] = rows + got, r
                goals += [common.Goal(f"GPU {made[1].split(' (')[0]}: {what}", r[k], *target)
                          for what, k, *target in GPU_GOALS]
                del made
        finally:
            dist.destroy_process_group()
    return rows, goals
