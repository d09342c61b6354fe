"""Measure 6 of bench/checkpoint.py: the same states on a GPU (see its docstring)."""

from __future__ import annotations

import mmap
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import common
from _checkpoint_states import FINALIZE, NAME, clock, mean, med, resnet_state, synthetic_state, table_rows, torch_saves
from trainguard.adapters.torch.snapshot import Snapshots, staging_bytes
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
    one flat copy_ of the same bytes into a pinned tensor, in five variants
    side by side: the copies started after the walk of the state (the code
    before) or ahead of it, each tensor copied on its own or small ones
    gathered through a staging buffer (the gathers in line, or beside the
    copies out); and the time of the state's flatten
    alone. Blocked per checkpoint likewise with the walk first and the
    copies ahead, alternately."""
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
    shared = _Registered(nbytes)  # memory as a snapshot slot is: a shared-memory mapping, page-locked in place

    def flat_copy(into: torch.Tensor = pinned) -> None:
        into.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
    saves, dcp_ret, _ = torch_saves(state, reps, tmp)
    shm, root = SnapshotDir.create(job), tmp / f"ckpt-{job}"
    snaps = Snapshots(shm, 0, count=2)
    snaps.staging_bytes = staging_bytes()  # the default
    blocked, plain, with_ckpt, walk, flat = {True: [], False: []}, [], [], [], []
    try:
        first = [clock(lambda: snaps.take(state, step)) for step in (1, 2)]
        while snaps.worker.pending:
            snaps.poll(0.5)
        for i in range(2 * reps):  # the copies started ahead of the walk (the default) and after it, alternately
            snaps.copy_ahead = ahead = i % 2 == 0
            plain.append(synced(train))
            synced(train)  # as the Guard checkpoints: at the end of a step, the next step's update waits
            step = 11 + 2 * i
            committed.commit(step)
            t0 = time.perf_counter()
            index = snaps.take(snapshot_of(step), step, background=True)
            snaps.persist(index, step, root=str(root), name=NAME, finalize=FINALIZE)
            t1, waited = time.perf_counter(), snaps.waited
            step_s = t1 - t0 + synced(lambda: train(snaps.settle))
            if ahead:
                with_ckpt.append(step_s)
            blocked[ahead].append(t1 - t0 + snaps.waited - waited)
            snaps.wait(600)
            if snaps.errors or index is None:
                raise RuntimeError(f"persist failed: slot {index}, {snaps.errors}")
            for old in CheckpointStore(root).steps()[1:]:
                shutil.rmtree(CheckpointStore(root).final_path(old))
        pins = snaps.pins
    finally:
        snaps.close()
        shm.remove()
    # take() in line, five variants side by side: the walk first (the code before) or the copies ahead of it;
    # one copy per tensor, or small tensors gathered through a 64 MiB staging buffer, the gathers in line
    # (the code before) or on a stream of their own beside the copies out; each take is of the committed
    # state after a commit, as the Guard takes it
    variants = [(False, 0, False), (False, 64, False), (True, 0, False), (True, 64, False), (True, 64, True),
                (True, 256, True), (True, 1024, True)]
    kinds = sorted({(mb, overlap) for _, mb, overlap in variants})
    dirs = {k: SnapshotDir.create(f"{job}-d2h{k[0]}{'o' if k[1] else ''}") for k in kinds}
    rings = {k: Snapshots(d, 0, count=2) for k, d in dirs.items()}
    takes: dict = {v: [] for v in variants}
    flat_shared: list[float] = []
    try:
        for (mb, overlap), ring in rings.items():
            ring.staging_bytes, ring.staging_overlap = mb << 20, overlap
        for i in range(reps + 2):  # the first two fill (and register) both slots of each ring
            flat.append(clock(flat_copy))
            flat_shared.append(clock(lambda: flat_copy(shared.tensor)))
            walk.append(clock(lambda: flatten(state, [])))
            for ahead, mb, overlap in variants:
                ring = rings[mb, overlap]
                ring.copy_ahead = ahead
                committed.commit(100 + i)
                taken = snapshot_of(100 + i)
                torch.cuda.synchronize()
                takes[ahead, mb, overlap].append(clock(lambda: ring.take(taken, 100 + i)))
                while ring.worker.pending:  # its seal (a checksum pass over host memory) before the next measure
                    ring.poll(0.5)
        reports = {k: ring.report(None) for k, ring in rings.items()}
    finally:
        for ring in rings.values():
            ring.close()
        for d in dirs.values():
            d.remove()
        shared.close()
    takes = {v: t[2:] for v, t in takes.items()}
    default = (True, staging_bytes() >> 20, bool(staging_bytes()))
    name = {(False, 0, False): "walk first (before), one copy per tensor",
            (False, 64, False): "walk first (before), staging on, gathers in line",
            (True, 0, False): "copies ahead of the walk, one copy per tensor",
            (True, 64, False): "copies ahead of the walk, staging on, gathers in line",
            (True, 64, True): "copies ahead of the walk, staging on, gathers beside the copies out",
            (True, 256, True): "the same, a 256 MiB staging buffer",
            (True, 1024, True): "the same, a 1024 MiB staging buffer"}
    label_of = lambda v: f"{'ahead' if v[0] else 'walk'}_{v[1]}MiB{'_overlap' if v[2] else ''}"  # noqa: E731
    ours, save, async_ = mean(blocked[True]), mean(saves[1:]), mean(dcp_ret[1:])
    rows = table_rows(label, (
        ("6 GPU blocked/ckpt", "trainguard take(background)+persist() req+wait", ours, None,
         f"mean of {reps}; {nbytes / 1e6:.0f} MB in {len(tensors)} tensors; {pins} slots pinned; copies ahead of "
         "the walk, on a side stream beside the next forward and backward"),
        ("6 GPU blocked/ckpt", "the same, the walk first (before)", mean(blocked[False]), None,
         f"mean of {reps}, alternating with the row above"),
        ("6 GPU blocked/ckpt", "trainguard first take (allocates, pins)", mean(first), None,
         "per slot: " + ", ".join(f"{x:.3g}" for x in first) + " s"),
        ("6 GPU blocked/ckpt", "torch.save + fsync", save, None, f"mean of {reps}"),
        ("6 GPU blocked/ckpt", "DCP async_save (until return)", async_, None, f"mean of {reps}"),
        ("6 GPU step", "training step, no checkpoint", med(plain), None, f"median of {2 * reps}, synchronized"),
        ("6 GPU step", "training step after a snapshot + persist request", med(with_ckpt), None,
         f"median of {reps}, synchronized; the snapshot's take() and request included"),
        *(("6 GPU->host", f"take(): {name[v]}" + (" (default)" if v == default else ""), med(takes[v]), nbytes,
           f"median of {reps}; in line, the committed state after a commit; "
           + (f"{reports[v[1:]]['staged_copies']} staged + {reports[v[1:]]['direct_copies']} direct copies through "
              f"a {v[1]} MiB device buffer" if v[1] else "one copy per tensor"))
          for v in variants),
        ("6 GPU->host", "pinned copy_: one flat tensor", med(flat), nbytes, f"median of {reps + 2}; goal baseline"),
        ("6 GPU->host", "the same into shared memory page-locked in place", med(flat_shared), nbytes,
         f"median of {reps + 2}; memory as a snapshot slot's (/dev/shm, cudaHostRegister): the ceiling of a take"),
        ("6 GPU host", "flatten() of the state alone", med(walk), None,
         f"median of {reps + 2}; {len(tensors)} tensors: host work that copies started ahead of it overlap")))
    return rows, {"vs_save": 100 * ours / save, "vs_async": ours / async_, "d2h": 100 * med(flat) / med(takes[default]),
                  **{f"d2h_{label_of(v)}": 100 * med(flat) / med(takes[v]) for v in variants},
                  "d2h_flat_shared": 100 * med(flat) / med(flat_shared),
                  "step": 100 * med(plain) / med(with_ckpt),
                  "samples": {"blocked": blocked[True], "blocked_walk_first": blocked[False], "flat": flat,
                              "flat_shared": flat_shared,
                              **{f"take_{label_of(v)}": takes[v] for v in variants},
                              "torch_save": saves, "async_save": dcp_ret, "plain": plain, "with_ckpt": with_ckpt,
                              "flatten": walk}}


NOTE_6 = ("state on the GPU (ResNet-50 + AdamW after one step; the synthetic state); ours: take() starts the "
          "copies of the tensors the last take found, then walks the state and checks each still sits where it did "
          "(the code before, 'walk first': walks the state, then starts the copies); it copies each tensor with non_blocking (one _foreach_copy_) into slots page-locked by cudaHostRegister "
          "(or, staging on, gathers runs of small tensors on the device into a staging buffer first, one "
          "_foreach_copy_ per dtype, and copies each run), checks the layout and encodes the metadata while the "
          "copies are in flight, then one synchronize; as the Guard checkpoints "
          "(blocked per checkpoint) the copies leave on a side stream beside the next forward and backward, and "
          "the next update waits for them; then a persist request (the worker writes from host memory); torch.save "
          "of the CUDA state + fsync; DCP async_save until it returns (it stages to CPU first); the baseline of the "
          "bandwidth: one flat device-to-host copy_ of the same bytes into a pinned tensor")
GPU_GOALS = [("blocked per checkpoint, ours / torch.save", "vs_save", 5, "%"),
             ("blocked per checkpoint, ours / DCP async_save", "vs_async", 1, "x"),
             ("take() device-to-host bandwidth / pinned copy", "d2h", None, "%", True)]
#: take()'s bandwidth goal per state (issue 45): ResNet-50's 800 mostly small tensors, the 1 GB synthetic state.
D2H_TARGET = (80, 90)


class _Registered:
    """A shared-memory mapping of ``nbytes`` page-locked in place, as a snapshot slot is."""

    def __init__(self, nbytes: int) -> None:
        self._file = tempfile.TemporaryFile(dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
        self._file.truncate(nbytes)
        self._map = mmap.mmap(self._file.fileno(), nbytes)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        rc = int(torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, 0))
        if rc:
            raise RuntimeError(f"cudaHostRegister failed ({rc})")

    def close(self) -> None:
        torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
        self.tensor = self._map = None  # the mapping goes with the last view of it
        self._file.close()


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
                goals += [common.Goal(f"GPU {made[1].split(' (')[0]}: {what}", r[k],
                                      D2H_TARGET[i] if target is None else target, *rest)
                          for what, k, target, *rest in GPU_GOALS]
                del made
        finally:
            dist.destroy_process_group()
    return rows, goals
