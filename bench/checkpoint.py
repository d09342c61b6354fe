"""In-memory snapshots and asynchronous checkpoints against torch's own saves.

Side by side in one run, on (a) the ResNet-50 example's state (default
config: small stem, 10 classes) with AdamW state after one step and (b) a
synthetic ~1 GB state (fp32 params in 400 tensors + AdamW state; ~100 MB with
--quick), each wrapped as the Guard wraps it:

1. **blocked per checkpoint**, as the Guard checkpoints at the end of a
   training step (the state's own forward, backward and AdamW step): the
   committed state (``TrainState.committed_state_dict``), ``take(...,
   background=True)`` and the ``persist()`` request, plus what the next
   step's update waited for the copy running beside it; mean over saves
   after each slot's first use (reported apart), against ``torch.save`` +
   flush + fsync and against DCP ``async_save`` until it returns (gloo
   world of 1; its future awaited before the next), both timed after every
   measure of ours (DCP's staging thread leaves this process's OpenMP
   regions slower, see ``main``). Beside it, not a goal:
   median step time with a checkpoint less without (the copy also takes
   its share of the cores).
2. **copy bandwidth**: state bytes / take() time (in line, no training
   beside it), against one flat ``dst.copy_(src)`` between preallocated,
   touched CPU tensors.
3. **persist throughput**: file bytes / time from persist() to the worker's
   reply, against os.write in 8 MiB chunks + fsync of the same bytes, same
   disk. This VM's memory and disk are noisy (a write that grows the page
   cache into memory the host has not backed yet runs several times slower),
   so the baselines of 2 and 3 alternate sides with the saves; 2 compares
   medians, 3 and 4 the best of each (the noise only ever adds).
4. **load after restart**, until model and optimizer hold the state: from
   memory (a fresh ``Snapshots``, as the Guard loads: ``available()`` +
   ``load_verified`` + ``read_payload_into`` the model's parameters, the
   optimizer's state copied out) against storage (page cache dropped;
   ``CheckpointStore.latest()`` + ``read_stored_snapshot``); both then
   ``load_state_dict`` and write the optimizer state once in place (a mapped
   file's pages are copied there, not at the first step).
5. **throughput of the ResNet-50 example** (``trainguard run``, 2 CPU ranks),
   snapshot every step and persist every K, against no checkpoints, and
   beside them one snapshot per node for the two replicas
   (``snapshot_shared=true``); launch triples in rotated order;
   rank 0's per-step times from its log, first 3 left out; the goal takes
   the median over triples undisturbed by other processes.
6. **GPU** (CUDA only; ``--gpu-only`` runs this alone): the same two states on
   the GPU, blocked per checkpoint as in 1, and take()'s device-to-host
   bandwidth against one flat copy_ into pinned memory.
7. **FSDP** (``--fsdp-only`` runs this alone): an HSDP model on 4 gloo ranks,
   blocked per checkpoint: the Guard's ``save()`` (DCP, written in line)
   against DCP ``async_save`` until it returns and ``dcp.save``, on the same
   state (``_checkpoint_fsdp.py``).

usage: python bench/checkpoint.py [--quick] [--gpu-only | --fsdp-only]
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from trainguard.adapters.torch.checkpoints import read_stored_snapshot
from trainguard.adapters.torch.snapshot import Snapshots, destinations, filled, read_payload_into
from trainguard.adapters.torch.state import flatten
from trainguard.adapters.torch.trainstate import TrainState
from trainguard.core.checkpoint import CheckpointStore
from trainguard.core.snapshot import SnapshotDir
from trainguard.core.snapshot.ring import load_verified

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from _checkpoint_fsdp import fsdp  # noqa: E402
from _checkpoint_gpu import NOTE_6, run_gpu  # noqa: E402
from _checkpoint_states import (EXAMPLE, FINALIZE, NAME, clock, drop_caches, mean, med, on_disk,  # noqa: E402
                                raw_write, resnet_state, synthetic_state, table_rows, torch_saves)

GOALS = [("blocked per checkpoint, ours / torch.save", "vs_save", 5, "%"),  # per state: name, key, target, unit
         ("blocked per checkpoint, ours / DCP async_save", "vs_async", 1, "x"),
         ("take() bandwidth / flat memcpy", "copy", 60, "%", True),
         ("persist throughput / raw write+fsync", "persist", 80, "%", True),
         ("load from memory, speed-up over storage", "load", 5, "x", True)]


def bench_state(made: tuple, reps: int, tmp: Path, job: str) -> tuple[dict, Callable]:
    """Measures 1-4 of ours for one state; returns the state and
    ``finish(torch_saves(state, ...))`` -> (rows, what the goals judge)."""
    _, label, model, opt, train = made
    committed = TrainState(model, opt)

    def snapshot_of(step: int) -> dict:  # what the Guard snapshots: the state committed at the end of a step
        return {"state": {**committed.committed_state_dict(), "step": step}, "history": {"records": [], "pids": {}}}
    committed.commit(1)  # the Guard commits every step, snapshots or not
    state = snapshot_of(1)
    tensors = flatten(state)[1]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    src = torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in tensors])
    dst, dsts = torch.zeros_like(src), [torch.zeros_like(t) for t in tensors]
    with torch.no_grad():
        per = med([clock(lambda: [d.copy_(t) for d, t in zip(dsts, tensors)]) for _ in range(reps + 1)][1:])
    del dsts
    view = memoryview(src.numpy()).cast("B")  # the state's bytes, for the raw-write baseline

    shm, root = SnapshotDir.create(job), tmp / f"ckpt-{job}"
    snaps = Snapshots(shm, 0, count=2)
    blocked, take, persist, raw, flat, plain, with_ckpt = [], [], [], [], [], [], []

    def baselines() -> None:
        raw.append(on_disk(tmp / "raw.bin", lambda f: raw_write(f, view), buffering=0))
        flat.append(clock(lambda: dst.copy_(src)))

    def persisted(index: int | None, step: int) -> float:
        """Wait for the persist of ``step``; when it was answered."""
        snaps.wait(600)
        done = time.perf_counter()
        if snaps.errors or index is None or snaps.persisted[-1]["step"] != step:
            raise RuntimeError(f"persist failed: slot {index}, {snaps.errors}")
        for old in CheckpointStore(root).steps()[1:]:  # keep the newest only
            shutil.rmtree(CheckpointStore(root).final_path(old))
        return done
    try:
        first = [clock(lambda: snaps.take(state, step)) for step in (1, 2)]
        snaps.take(state, 3, background=True)  # starts the copy thread
        snaps.settle()
        while snaps.worker.pending:
            snaps.poll(0.5)
        for i in range(reps):
            if i % 2 == 0:
                baselines()
            plain.append(clock(train))  # a training step, no checkpoint
            # As the Guard checkpoints at the end of a step: the committed state
            # copied beside the next step, whose update waits for the copy.
            train()
            step = 10 + 2 * i
            committed.commit(step)
            t0 = time.perf_counter()
            index = snaps.take(snapshot_of(step), step, background=True)
            snaps.persist(index, step, root=str(root), name=NAME, finalize=FINALIZE)
            t1, waited = time.perf_counter(), snaps.waited
            with_ckpt.append(t1 - t0 + clock(lambda: train(snaps.settle)))
            blocked.append(t1 - t0 + snaps.waited - waited)
            persisted(index, step)
            # The copy alone (measure 2) and the persist alone (measure 3).
            step += 1
            committed.commit(step)
            state = snapshot_of(step)
            t0 = time.perf_counter()
            index = snaps.take(state, step)
            t1 = time.perf_counter()
            snaps.persist(index, step, root=str(root), name=NAME, finalize=FINALIZE)
            persist.append(persisted(index, step) - t1)
            take.append(t1 - t0)
            if i % 2 == 1:
                baselines()
        fbytes = (Path(snaps.persisted[-1]["final"]) / NAME).stat().st_size
        del dst

        def load(held: dict) -> None:
            model.load_state_dict(held["model"])
            opt.load_state_dict(held["optimizer"])
            with torch.no_grad():  # as the next step will: a mapped file's pages are copied on this write
                for t in flatten(opt.state_dict()["state"])[1]:
                    t.add_(0)

        def from_storage() -> tuple[float, float]:
            t = time.perf_counter()
            found = CheckpointStore(root).latest()
            verified = time.perf_counter() - t
            assert found.step == step
            checksum[:] = [k for k in ("sha256", "xxh3", "crc32") if found.manifest["files"][NAME].get(k)]
            load(read_stored_snapshot(found.file(NAME), "cpu"))
            return time.perf_counter() - t, verified

        def from_memory() -> tuple[float, float]:
            t = time.perf_counter()
            again = Snapshots(SnapshotDir.attach(shm.path), 0)
            held = again.available(verify=False)  # as the Guard loads: checksum of the one slot it reads
            verified = time.perf_counter() - t
            # As the Guard reads: straight into what a restarted process has (the model; its
            # optimizer has no state yet) once the checksum passed, the rest copied out.
            into = destinations({"state": {"model": model.state_dict()}})
            got, loaded = load_verified(held[max(held)][0], lambda p: read_payload_into(p, "cpu", into),
                                        filled)
            load(loaded["state"])
            dt = time.perf_counter() - t
            assert got == step
            for s, _ in held.values():  # available() leaves every slot it returns open
                s.close()
            again.close()
            return dt, verified

        storage, memory, dropped, checksum = [], [], True, []
        for i in range(reps):  # alternating which goes first
            for which in ((0, 1) if i % 2 == 0 else (1, 0)):
                if which == 0:
                    dropped = drop_caches() and dropped
                    storage.append(from_storage())
                else:
                    memory.append(from_memory())
    finally:
        snaps.close()
        shm.remove()

    measured = (blocked, take, persist, raw, flat, plain, with_ckpt, per, first, memory, storage, dropped, checksum)
    return state, lambda saves: _finish(label, reps, nbytes, fbytes, len(tensors), measured, *saves)


def _finish(label: str, reps: int, nbytes: int, fbytes: int, count: int, measured: tuple, saves: list[float],
            dcp_ret: list[float], dcp_done: list[float]) -> tuple[list[dict], dict]:
    """Rows of measures 1-4 for one state, and what the goals judge: ours
    (``measured``, from :func:`bench_state`) and torch's saves."""
    blocked, take, persist, raw, flat, plain, with_ckpt, per, first, memory, storage, dropped, checksum = measured
    t_memory, t_storage = min(t for t, _ in memory), min(t for t, _ in storage)
    ours, save, async_ = mean(blocked), mean(saves[1:]), mean(dcp_ret[1:])
    cold = "page cache dropped" if dropped else "warm page cache"
    lost = med(with_ckpt) - med(plain)
    rows = table_rows(label, (
        ("1 blocked/ckpt", "trainguard take()+persist() req+wait", ours, None,
         f"mean of {reps}; {nbytes / 1e6:.0f} MB in {count} tensors, copied beside the next training "
         f"step ({med(plain):.3g} s alone)"),
        ("1 blocked/ckpt", "trainguard: step time lost", lost, None,
         f"median step with a checkpoint {med(with_ckpt):.3g} s - without {med(plain):.3g} s: the copy's "
         f"share of the cores too (not a goal: noisy)"),
        ("1 blocked/ckpt", "trainguard first take (allocates)", mean(first), None,
         "per slot: " + ", ".join(f"{x:.3g}" for x in first) + " s"),
        ("1 blocked/ckpt", "torch.save + fsync", save, None, f"mean of {reps}; first {saves[0]:.3g} s"),
        ("1 blocked/ckpt", "DCP async_save (until return)", async_, None,
         f"mean of {reps}; first {dcp_ret[0]:.3g} s; until done {mean(dcp_done[1:]):.3g} s"),
        ("2 copy bandwidth", "trainguard take()", med(take), nbytes, f"median of {reps}"),
        ("2 copy bandwidth", "memcpy: one flat copy_", med(flat), nbytes, f"median of {reps}; goal baseline"),
        ("2 copy bandwidth", "memcpy: per-tensor copy_", per, nbytes, "back to back, preallocated tensors"),
        ("3 persist", "trainguard persist() -> reply", min(persist), fbytes,
         f"best of {reps} (median {med(persist):.3g} s); file {fbytes / 1e6:.0f} MB"),
        ("3 persist", "os.write 8 MiB + fsync", min(raw), nbytes, f"best of {reps} (median {med(raw):.3g} s)"),
        ("4 load", "memory: available()+read+load", t_memory, fbytes,
         f"best of {reps} (median {med(t for t, _ in memory):.3g} s); "
         f"available(verify=False) {min(v for _, v in memory):.2g} s"),
        ("4 load", "storage: latest()+read_stored+load", t_storage, fbytes,
         f"best of {reps} (median {med(t for t, _ in storage):.3g} s); latest() {min(v for _, v in storage):.3g} s "
         f"({'/'.join(checksum)}); {cold}")))
    samples = {"blocked": blocked, "step_plain": plain, "step_with_ckpt": with_ckpt, "take": take, "flat": flat, "persist": persist, "raw": raw, "torch_save": saves,
               "async_save": dcp_ret, "memory": [t for t, _ in memory], "storage": [t for t, _ in storage]}
    return rows, {"vs_save": 100 * ours / save, "vs_async": ours / async_, "copy": 100 * med(flat) / med(take),
                  "persist": 100 * (fbytes / min(persist)) / (nbytes / min(raw)), "load": t_storage / t_memory,
                  "floor_pct": 100 * med(flat) / save,
                  "samples": {k: [round(x, 4) for x in v] for k, v in samples.items()}}


def cpu_seconds() -> float:
    """Busy CPU seconds of the whole machine since boot, less this process's and its finished children's."""
    v = [int(x) for x in Path("/proc/stat").read_text().split()[1:9]]
    ours = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK") - sum(r.ru_utime + r.ru_stime for r in ours)


def train(tmp: Path, tag: str, steps: int, every: int, snapshot: bool,
          shared: bool = False) -> tuple[list[float], dict, float]:
    """Rank 0's per-step times in one ``trainguard run`` of the example, its report, and the CPU cores
    other processes used meanwhile (other work on the machine skews the comparison); ``shared``: the
    two ranks share one snapshot (``snapshot_shared``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    cmd = [sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", "2", "--job-id", tag,
           str(EXAMPLE / "train.py"), f"steps={steps}", "log_every=1", f"report={tag}.json",
           f"checkpoint_dir={tag}-ckpt", f"save_every={every if snapshot else 0}",
           f"snapshot_every={1 if snapshot else 0}", f"snapshot_shared={str(shared).lower()}"]
    c, t = cpu_seconds(), time.monotonic()
    out = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=900)
    others = (cpu_seconds() - c) / (time.monotonic() - t)
    if out.returncode != 0:
        raise RuntimeError(f"{tag} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    found = re.findall(r"step (\d+)/\d+ .* ([\d.]+) s/step", out.stdout + out.stderr)
    times = {int(s): float(t) for s, t in found}
    return [times[s] for s in sorted(times)], json.loads((tmp / f"{tag}.json").read_text()), others


def main() -> None:
    ap = common.parser(__doc__.splitlines()[0])
    ap.add_argument("--gpu-only", action="store_true", help="measure 6 alone (bench/results/checkpoint-gpu.json)")
    ap.add_argument("--fsdp-only", action="store_true", help="measure 7 alone (bench/results/checkpoint-fsdp.json)")
    args = ap.parse_args()
    load_avg = os.getloadavg()
    git = ["git", "-C", str(EXAMPLE.parent.parent)]  # the code measured: the tree may hold uncommitted changes
    tree = lambda: [subprocess.run([*git, *a], capture_output=True, text=True).stdout.strip()  # noqa: E731
                    for a in (["rev-parse", "--short", "HEAD"], ["status", "--short", "trainguard"])]
    tree_at_start = tree()
    layers, reps = (10, 3) if args.quick else (100, 8)
    steps, every, pairs, skip = (12, 5, 1, 3) if args.quick else (30, 10, 5, 3)
    rows, goals, per_state, job = [], [], {}, f"bench-checkpoint-{os.getpid()}"
    if args.gpu_only:
        if not torch.cuda.is_available():
            sys.exit("--gpu-only needs a CUDA device")
        rows, goals = run_gpu(reps, layers, job, per_state)
        common.report("checkpoint-gpu", rows, ["measure", "state", "method", "seconds", "GB_s", "note"], goals,
                      quick=args.quick, out=args.out, extra={"per_state": per_state, "note": NOTE_6,
                                                             "trainguard_tree": {"start": tree_at_start,
                                                                                 "end": tree()}})
        return
    if args.fsdp_only:
        rows, goals = fsdp(args.quick, per_state)
        common.report("checkpoint-fsdp", rows, ["measure", "state", "method", "seconds", "note"], goals,
                      quick=args.quick, out=args.out, extra={"per_state": per_state, "trainguard_tree": {
                          "start": tree_at_start, "end": tree()}, "load_avg": {"start": load_avg,
                                                                                "end": os.getloadavg()}})
        return
    with tempfile.TemporaryDirectory(prefix="tg-bench-ckpt-") as d:
        tmp = Path(d)
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp / "pg"), 1), rank=0, world_size=1)
        try:
            ours = []
            for i, make in enumerate((resnet_state, lambda: synthetic_state(layers))):
                made, c, t = make(), cpu_seconds(), time.monotonic()
                state, finish = bench_state(made, reps, tmp, f"{job}-{i}")
                ours.append((made[1], state, finish, (cpu_seconds() - c) / (time.monotonic() - t)))  # as in train()
                del made
            # torch's own saves after all of ours: DCP async_save's staging thread runs torch copies,
            # whose OpenMP team of that thread leaves every parallel region of this one waking its
            # workers at each barrier (ResNet-50's copy in 806 tensors: 27 ms before, 58 ms after).
            for label, state, finish, other in ours:
                got, r = finish(torch_saves(state, reps, tmp))
                r["other_cores"] = other
                got[0]["note"] += f"; other processes: {other:.2f} cores"
                rows, per_state[label], short = rows + got, r, label.split(" (")[0]
                goals += [common.Goal(f"{short}: {what}", r[k], *target) for what, k, *target in GOALS]
            del ours
        finally:
            dist.destroy_process_group()

        # Per launch, rank 0's step times: no checkpoints, a snapshot per rank (the default), one per
        # node for the two replicas (snapshot_shared); each triple in a rotated order.
        modes = {"base": (False, False), "ckpt": (True, False), "shared": (True, True)}
        runs, reports, busy = {m: [] for m in modes}, [], [0.0] * pairs
        for p in range(pairs):
            order = list(modes)[p % 3:] + list(modes)[:p % 3]
            for mode in order:
                times, rep, others = train(tmp, f"{job}-{mode}{p}", steps, every, *modes[mode])
                runs[mode].append(times[skip:])
                busy[p] = max(busy[p], others)
                if mode != "base":
                    reports.append({"mode": mode, **(rep.get("snapshots") or {})})
    base = runs["base"]
    label = "ResNet-50 example, 2 ranks, SGD"
    ratios = {m: [100 * mean(b) / mean(c) for b, c in zip(base, runs[m])] for m in ("ckpt", "shared")}
    quiet = [p for p, b in enumerate(busy) if b < 0.25]  # launches no other work disturbed
    used = quiet or list(range(pairs))
    for method, mode in (("no checkpoints", "base"), (f"snapshot every step, persist every {every}", "ckpt"),
                         ("... one snapshot per node for the replicas (snapshot_shared)", "shared")):
        times = [t for run in runs[mode] for t in run]
        rows.append({"measure": "5 throughput", "state": label, "method": method, "seconds": mean(times),
                     "note": f"s/step; {1 / mean(times):.3g} steps/s over {len(times)} steps, {pairs} launches"})
        if mode != "base":
            rows[-1]["note"] += f"; per launch triple {mode}/base " + ", ".join(
                f"{r:.1f}% ({b:.2f} other cores)" for r, b in zip(ratios[mode], busy))
    for what, mode in (("a snapshot per rank", "ckpt"), ("one per node (snapshot_shared)", "shared")):
        goals.append(common.Goal(f"ResNet-50 example: throughput with snapshots ({what}) / without (median of "
                                 f"{len(used)} {'quiet ' if quiet else ''}launch triples)",
                                 med([ratios[mode][p] for p in used]), 97, "%", True))

    if torch.cuda.is_available():
        got, gpu_goals = run_gpu(reps, layers, job, per_state)
        rows, goals = rows + got, goals + gpu_goals
    else:
        rows.append({"measure": "6 GPU", "state": "-", "method": "-", "note": "no GPU in this run: see "
                     "bench/results/checkpoint-gpu.json (--gpu-only on a GPU machine)"})
    got, fsdp_goals = fsdp(args.quick, per_state)
    rows, goals = rows + got, goals + fsdp_goals

    left = sorted(p.name for p in Path("/dev/shm").glob(f"trainguard-{job}-*"))  # only ours: tests may run beside
    extra = {"notes": {
        "1": "ours: committed state dict, header, the copy into a shared-memory slot started on a thread, a persist "
             "request, then the wait of the next step's update for the copy (the copy thread asks for the seal and "
             "the persist is sent when the copy lands); torch.save: "
             "buffered file + flush + fsync; DCP async_save with its defaults (a CPU copy per save, thread executor, "
             "FileSystemWriter with sync_files). floor_pct = flat memcpy / torch.save: the least ours can reach",
        "3": "persist() to reply: the worker's XXH3-64 seal (when it had not sealed the slot yet), the copy to the "
             "file, fsync, manifest, rename and tracker",
        "4": "memory, as the Guard loads: available(verify=False) + load_verified (XXH3-64 of the slot read) + "
             "read_payload_into (the model's parameters filled in place after the check, the optimizer's state "
             "copied out); storage: latest() (the manifest's checksum, named in the row) + "
             "safetensors (maps the file); both then load_state_dict and "
             "add_(0) on every optimizer state tensor. drop_caches drops the guest's page cache only",
        "5": f"`trainguard run --nproc-per-node 2 examples/resnet50/train.py steps={steps} save_every={every} "
             f"snapshot_every=1` vs `save_every=0 snapshot_every=0` (default optimizer SGD, batch 8, 32x32), and the "
             f"first again with snapshot_shared=true; {pairs} launch triples in rotated order; per launch, "
             f"mean of rank 0's logged step times (first {skip} left out); the goal: median over triples where "
             f"other processes used < 0.25 cores (else over all)"},
        "6": NOTE_6, "per_state": per_state, "step_times_s": runs, "snapshot_reports": reports,
        "shm_left": left, "tmp_dir": tempfile.gettempdir(), "load_avg": {"start": load_avg, "end": os.getloadavg()},
        "trainguard_tree": {"start": tree_at_start, "end": tree()}}
    common.report("checkpoint", rows, ["measure", "state", "method", "seconds", "GB_s", "note"], goals,
                  quick=args.quick, out=args.out, extra=extra)
    if left:
        sys.exit(f"left in /dev/shm: {left}")


if __name__ == "__main__":
    main()
