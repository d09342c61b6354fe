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
from trainguard.adapters.torch.trainstate import TrainState
from trainguard.core.checkpoint import CheckpointStore
from trainguard.core.snapshot import SnapshotDir


def gpu_rows(made: tuple, reps: int, tmp: Path, job: str) -> tuple[list[dict], dict]:
    """Measure 6 for one state on the GPU.

    Blocked per checkpoint as the Guard checkpoints (as measure 1): after a
    training step, the committed state's ``take(..., background=True)`` and
    the persist request, plus what the next step's update waits for the copy
    (on a side stream beside that step's forward and backward); against
    torch.save and DCP async_save of the same CUDA state. Beside it, the
    median step time (synchronized) with and without that checkpoint.

    take()'s device-to-host bandwidth in line (the copy, then the host work
    a snapshot needs while it is in flight, then one synchronize) against
    one flat copy_ of the same bytes into a pinned tensor, and the time of
    the state's flatten alone (host work no copy can overlap)."""
    _, label, model, opt, train = made
    committed = TrainState(model, opt)

    def snapshot_of(step: int) -> dict:  # what the Guard snapshots: the state committed at the end of a step
        return {"state": {**committed.committed_state_dict(), "step": step}, "history": {"records": [], "pids": {}}}

    def synced(fn) -> float:
        torch.cuda.synchronize()
        return clock(lambda: (fn(), torch.cuda.synchronize()))
    committed.commit(1)
    state = snapshot_of(1)
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
    snaps.staging_bytes = 0  # the default (see staging_bytes()); with a staging buffer below: side by side
    blocked, take, flat, plain, with_ckpt, walk = [], [], [], [], [], []
    try:
        first = [clock(lambda: snaps.take(state, step)) for step in (1, 2)]
        while snaps.worker.pending:
            snaps.poll(0.5)
        for i in range(reps):
            flat.append(clock(flat_copy))
            walk.append(clock(lambda: flatten(state, [])))
            torch.cuda.synchronize()
            take.append(clock(lambda: snaps.take(state, 10 + 2 * i)))
            while snaps.worker.pending:  # its seal (a checksum pass over host memory) before the next measure
                snaps.poll(0.5)
            plain.append(synced(train))
            synced(train)  # as the Guard checkpoints: at the end of a step, the next step's update waits
            step = 11 + 2 * i
            committed.commit(step)
            t0 = time.perf_counter()
            index = snaps.take(snapshot_of(step), step, background=True)
            snaps.persist(index, step, root=str(root), name=NAME, finalize=FINALIZE)
            t1, waited = time.perf_counter(), snaps.waited
            with_ckpt.append(t1 - t0 + synced(lambda: train(snaps.settle)))
            blocked.append(t1 - t0 + snaps.waited - waited)
            snaps.wait(600)
            if snaps.errors or index is None:
                raise RuntimeError(f"persist failed: slot {index}, {snaps.errors}")
            for old in CheckpointStore(root).steps()[1:]:
                shutil.rmtree(CheckpointStore(root).final_path(old))
        pins = snaps.pins
        snaps.staging_bytes = 64 << 20  # the same take() with small tensors gathered on the device first
        snaps.forget_views()
        staged_takes = []
        for i in range(reps + 2):
            torch.cuda.synchronize()
            staged_takes.append(clock(lambda: snaps.take(state, 100 + i)))
            snaps.wait(600)
        staged, staged_takes = snaps.report(None), staged_takes[2:]  # the first of each slot registers it again
    finally:
        snaps.close()
        shm.remove()
    ours, save, async_ = mean(blocked), mean(saves[1:]), mean(dcp_ret[1:])
    rows = table_rows(label, (
        ("6 GPU blocked/ckpt", "trainguard take(background)+persist() req+wait", ours, None,
         f"mean of {reps}; {nbytes / 1e6:.0f} MB in {len(tensors)} tensors; {pins} slots pinned; the copy on a "
         "side stream beside the next forward and backward"),
        ("6 GPU blocked/ckpt", "trainguard first take (allocates, pins)", mean(first), None,
         "per slot: " + ", ".join(f"{x:.3g}" for x in first) + " s"),
        ("6 GPU blocked/ckpt", "torch.save + fsync", save, None, f"mean of {reps}"),
        ("6 GPU blocked/ckpt", "DCP async_save (until return)", async_, None, f"mean of {reps}"),
        ("6 GPU step", "training step, no checkpoint", med(plain), None, f"median of {reps}, synchronized"),
        ("6 GPU step", "training step after a snapshot + persist request", med(with_ckpt), None,
         f"median of {reps}, synchronized; the snapshot's take() and request included"),
        ("6 GPU->host", "trainguard take()", med(take), nbytes,
         f"median of {reps}; in line; one copy per tensor"),
        ("6 GPU->host", "trainguard take(), staging on", med(staged_takes), nbytes,
         f"median of {reps}; in line; {staged['staged_copies']} staged + {staged['direct_copies']} direct copies "
         f"through a {staged['staging_MB']} MiB device buffer"),
        ("6 GPU->host", "pinned copy_: one flat tensor", med(flat), nbytes, f"median of {reps}; goal baseline"),
        ("6 GPU host", "flatten() of the state alone", med(walk), None,
         f"median of {reps}; {len(tensors)} tensors: host work before the first copy can start")))
    return rows, {"vs_save": 100 * ours / save, "vs_async": ours / async_, "d2h": 100 * med(flat) / med(take),
                  "d2h_staged": 100 * med(flat) / med(staged_takes), "step": 100 * med(plain) / med(with_ckpt),
                  "samples": {"blocked": blocked, "take": take, "staged": staged_takes, "flat": flat,
                              "torch_save": saves, "async_save": dcp_ret, "plain": plain, "with_ckpt": with_ckpt,
                              "flatten": walk}}


NOTE_6 = ("state on the GPU (ResNet-50 + AdamW after one step; the synthetic state); ours: take() walks the state, "
          "then copies each tensor with non_blocking (one _foreach_copy_) into slots page-locked by cudaHostRegister "
          "(or, staging on, gathers runs of small tensors on the device into a staging buffer first, one "
          "_foreach_copy_ per dtype, and copies each run), checks the layout and encodes the metadata while the "
          "copies are in flight, then one synchronize; as the Guard checkpoints "
          "(blocked per checkpoint) the copies leave on a side stream beside the next forward and backward, and "
          "the next update waits for them; then a persist request (the worker writes from host memory); torch.save "
          "of the CUDA state + fsync; DCP async_save until it returns (it stages to CPU first); the baseline of the "
          "bandwidth: one flat device-to-host copy_ of the same bytes into a pinned tensor")
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
