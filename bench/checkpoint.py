"""In-memory snapshots and asynchronous checkpoints against torch's own saves.

Side by side in one run, on two states -- (a) the ResNet-50 example (the
example's default config: small stem, 10 classes) with AdamW state after one
step, and (b) a synthetic ~1 GB state (fp32 params in ~400 tensors + AdamW
exp_avg/exp_avg_sq; ~100 MB with --quick) -- each wrapped as the Guard
wraps it (``{"state": {model, optimizer, host, step}, "history": ...}``):

1. **blocked per checkpoint**: trainguard's ``Snapshots.take()`` +
   ``persist()`` (the request only), mean over saves after each slot's first
   use (which allocates and pre-touches it: reported apart), against
   ``torch.save`` to a file + flush + fsync, and against
   ``torch.distributed.checkpoint.async_save`` (time until it returns; gloo
   world of 1; its future is waited on before the next save). One warm-up
   save of each baseline is left out too.
2. **snapshot copy bandwidth**: state bytes / take() time, against one flat
   ``dst.copy_(src)`` of the same bytes between two preallocated, touched
   CPU tensors (the goal's baseline), and a per-tensor copy into
   preallocated tensors.
3. **persist throughput**: file bytes / time from persist() to the worker's
   reply (CRC seal, write with SHA-256 on a thread, fsync, manifest, rename,
   tracker), against os.write of the same bytes in 8 MiB chunks + fsync on
   the same disk, interleaved with the persists (the disk is noisy).
4. **load after restart**: from memory (a fresh ``Snapshots`` on the same
   directory: ``available()``, which CRC-verifies every slot, +
   ``read_payload``) against storage (page cache dropped when permitted;
   ``CheckpointStore.latest()``, SHA-256, + ``read_stored_snapshot``); both
   time getting the state as CPU tensors, no ``load_state_dict``.
5. **throughput of the ResNet-50 example** (``trainguard run``, 2 CPU ranks)
   with a snapshot every step and a persist every K steps, against no
   checkpointing; per-step times from the rank-0 log, first 3 steps left out.
6. **GPU**: device-to-host take() bandwidth against a copy into pinned host
   memory (not run without CUDA).

usage: python bench/checkpoint.py [--quick]
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from trainguard.adapters.torch.checkpoints import read_stored_snapshot
from trainguard.adapters.torch.snapshot import Snapshots, read_payload
from trainguard.adapters.torch.state import flatten
from trainguard.core.checkpoint import CheckpointStore, shard_file
from trainguard.core.snapshot import SnapshotDir

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "resnet50"
NAME = shard_file(0, (0,), ".safetensors")  # the file a one-rank Guard's async save writes
CHUNK, GB = 8 << 20, 1e9
mean, med = statistics.fmean, statistics.median


def wrap(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict:
    return {"state": {"model": model.state_dict(), "optimizer": opt.state_dict(), "host": {}, "step": step},
            "history": {"records": [], "pids": {}}}


def resnet_state() -> tuple[dict, str]:
    from omegaconf import OmegaConf
    sys.path.insert(0, str(EXAMPLE))
    from model import resnet50
    cfg = OmegaConf.load(EXAMPLE / "conf" / "config.yaml")
    torch.manual_seed(0)
    model = resnet50(cfg.model.num_classes or 10, stem=cfg.model.stem)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=tuple(cfg.optim.betas),
                            weight_decay=cfg.optim.weight_decay)
    x = torch.randn(cfg.batch_size, 3, cfg.image_size, cfg.image_size)
    torch.nn.functional.cross_entropy(model(x), torch.randint(0, 10, (cfg.batch_size,))).backward()
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    return wrap(model, opt, 1), f"ResNet-50 ({n / 1e6:.1f}M params) + AdamW"


def synthetic_state(layers: int) -> tuple[dict, str]:
    torch.manual_seed(0)
    model = torch.nn.ParameterList()
    for _ in range(layers):  # a 1024x832 matrix, its bias and a norm's weight and bias
        for shape in ((1024, 832), (1024,), (1024,), (1024,)):
            model.append(torch.nn.Parameter(torch.randn(shape)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model:
        p.grad = torch.randn_like(p)
    opt.step()
    n = sum(p.numel() for p in model)
    return wrap(model, opt, 1), f"synthetic ({n / 1e6:.1f}M fp32 params) + AdamW"


def clock(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def drop_caches() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


def raw_write(path: Path, view: memoryview) -> float:
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for pos in range(0, len(view), CHUNK):
            chunk = view[pos:pos + CHUNK]
            while chunk:
                chunk = chunk[os.write(fd, chunk):]
        os.fsync(fd)
    finally:
        os.close(fd)
    dt = time.perf_counter() - t
    path.unlink()
    return dt


def torch_save(state: dict, path: Path) -> float:
    t = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t
    path.unlink()
    return dt


def bench_state(state: dict, label: str, reps: int, tmp: Path, job: str) -> tuple[list[dict], dict]:
    """Rows of measures 1-4 for one state, and the ratios the goals judge."""
    tensors = flatten(state)[1]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    rows, r = [], {}

    def row(measure, method, seconds, nbytes_=None, note=""):
        rows.append({"measure": measure, "state": label, "method": method, "seconds": seconds,
                     "GB_s": nbytes_ / seconds / GB if nbytes_ and seconds else None, "note": note})

    # 2. memcpy baselines: one flat copy, and per-tensor into preallocated tensors
    src = torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in tensors])
    dst = torch.zeros_like(src)
    flat = med([clock(lambda: dst.copy_(src)) for _ in range(reps + 1)][1:])
    dsts = [torch.zeros_like(t) for t in tensors]
    with torch.no_grad():
        per = med([clock(lambda: [d.copy_(t) for d, t in zip(dsts, tensors)]) for _ in range(reps + 1)][1:])
    del dsts, dst
    view = memoryview(src.numpy()).cast("B")  # the state's bytes, for the raw-write baseline

    # 1. baselines: torch.save + fsync, DCP async_save
    saves = [torch_save(state, tmp / f"save{i}.pt") for i in range(reps + 1)]
    dcp_ret, dcp_total = [], []
    for i in range(reps + 1):
        t = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=str(tmp / f"dcp{i}"))
        dcp_ret.append(time.perf_counter() - t)
        fut.result()
        dcp_total.append(time.perf_counter() - t)
        shutil.rmtree(tmp / f"dcp{i}")

    # ours: warm-up (first use of each slot), then take + persist, each persist awaited
    shm = SnapshotDir.create(job)
    snaps = Snapshots(shm, 0, count=2)
    root = tmp / f"ckpt-{job}"
    try:
        first = [clock(lambda: snaps.take(state, step)) for step in (1, 2)]
        while snaps.worker.pending:
            snaps.poll(0.5)
        blocked, take, persist, raw = [], [], [], []
        for i in range(reps):
            step = 10 + i
            raw.append(raw_write(tmp / "raw.bin", view))
            t0 = time.perf_counter()
            index = snaps.take(state, step)
            t1 = time.perf_counter()
            snaps.persist(index, step, root=str(root), name=NAME, finalize={
                "expected": [NAME], "timeout_s": 600, "keep": 0,
                "layout": {"world_size": 1, "shards": [{"kind": 0, "copies": [0], "full": True, "saved_by": 0,
                                                        "files": [NAME]}]},
                "meta": {"history": {"records": [], "pids": {}}, "finalised_by": 0}})
            t2 = time.perf_counter()
            snaps.wait(600)
            t3 = time.perf_counter()
            if snaps.errors or index is None or len(snaps.persisted) != i + 1:
                raise RuntimeError(f"persist failed: index {index}, {snaps.errors}")
            take.append(t1 - t0)
            blocked.append(t2 - t0)
            persist.append(t3 - t1)
            for old in CheckpointStore(root).steps()[1:]:  # keep only the newest on disk
                shutil.rmtree(CheckpointStore(root).final_path(old))
        fbytes = (Path(snaps.persisted[-1]["final"]) / NAME).stat().st_size

        # 4. load after restart: storage (cold when permitted), then memory
        def from_storage() -> float:
            t = time.perf_counter()
            found = CheckpointStore(root).latest()
            stored = read_stored_snapshot(found.file(NAME), "cpu")
            dt = time.perf_counter() - t
            assert found.step == step and len(flatten(stored)[1]) == len(flatten(state["state"])[1])
            return dt

        def from_memory() -> float:
            t = time.perf_counter()
            again = Snapshots(SnapshotDir.attach(shm.path), 0)
            held = again.available()
            slot, _ = held[max(held)]
            slot.lock(False, block=True)
            got_step, loaded = read_payload(slot.payload(), "cpu")
            dt = time.perf_counter() - t
            assert got_step == step and len(flatten(loaded)[1]) == len(tensors)
            for s, _ in held.values():  # available() leaves every slot it returns open
                s.close()
            again.close()
            return dt

        storage, dropped = [], True
        for _ in range(reps):
            dropped = drop_caches() and dropped
            storage.append(from_storage())
        t_storage, t_memory = med(storage), med([from_memory() for _ in range(reps)])
    finally:
        snaps.close()
        shm.remove()

    mb = f"{nbytes / 1e6:.0f} MB in {len(tensors)} tensors"
    ours, save, async_ = mean(blocked), mean(saves[1:]), mean(dcp_ret[1:])
    row("1 blocked/ckpt", "trainguard take()+persist() req", ours, None, f"mean of {reps}; {mb}")
    row("1 blocked/ckpt", "trainguard first take (allocates)", mean(first), None,
        "per slot: " + ", ".join(f"{x:.3g}" for x in first) + " s")
    row("1 blocked/ckpt", "torch.save + fsync", save, None, f"mean of {reps}; first {saves[0]:.3g} s")
    row("1 blocked/ckpt", "DCP async_save (until return)", async_, None,
        f"mean of {reps}; first {dcp_ret[0]:.3g} s; until done {mean(dcp_total[1:]):.3g} s")
    row("2 copy bandwidth", "trainguard take()", med(take), nbytes, f"median of {reps}")
    row("2 copy bandwidth", "memcpy: one flat copy_", flat, nbytes, "goal baseline")
    row("2 copy bandwidth", "memcpy: per-tensor copy_", per, nbytes, "into preallocated tensors")
    row("3 persist", "trainguard persist() -> reply", med(persist), fbytes,
        f"median of {reps}; file {fbytes / 1e6:.0f} MB")
    row("3 persist", "os.write 8 MiB + fsync", med(raw), nbytes, "interleaved with the persists")
    row("4 load", "memory: available()+read_payload", t_memory, fbytes, f"median of {reps}; CRC32 of both slots")
    row("4 load", "storage: latest()+read_stored", t_storage, fbytes,
        f"median of {reps}; " + ("page cache dropped" if dropped else "warm page cache"))
    r = {"vs_save": 100 * ours / save, "vs_async": ours / async_, "copy": 100 * flat / med(take),
         "persist": 100 * (fbytes / med(persist)) / (nbytes / med(raw)), "load": t_storage / t_memory,
         "floor": {"flat memcpy / torch.save, %": 100 * flat / save, "bytes": nbytes, "tensors": len(tensors)}}
    return rows, r


def train(tmp: Path, tag: str, steps: int, every: int, snapshot: bool) -> tuple[list[float], dict]:
    """Rank 0's per-step times of one ``trainguard run`` of the example, and its report."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    cmd = [sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", "2", "--job-id", tag,
           str(EXAMPLE / "train.py"), f"steps={steps}", "log_every=1", f"report={tag}.json",
           f"checkpoint_dir={tag}-ckpt", f"save_every={every if snapshot else 0}", f"snapshot_every={1 if snapshot else 0}"]
    out = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{tag} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    log = out.stdout + out.stderr
    times = {int(s): float(t) for s, t in re.findall(r"step (\d+)/\d+ .* ([\d.]+) s/step", log)}
    return [times[s] for s in sorted(times)], json.loads((tmp / f"{tag}.json").read_text())


def gpu_rows(reps: int, job: str) -> tuple[list[dict], float]:
    """take() of 1 GiB of fp32 on the GPU against copy_ into pinned host tensors."""
    t = [torch.randn(1 << 20, device="cuda") for _ in range(256)]
    pinned = [torch.empty(x.shape, pin_memory=True) for x in t]
    shm = SnapshotDir.create(f"{job}-gpu")
    snaps = Snapshots(shm, 0, count=2)
    try:
        snaps.take({"t": t}, 0), snaps.take({"t": t}, 1)
        ours = mean([clock(lambda: snaps.take({"t": t}, 2 + i)) for i in range(reps)])
    finally:
        snaps.close()
        shm.remove()

    def pin():
        for p, x in zip(pinned, t):
            p.copy_(x, non_blocking=True)
        torch.cuda.synchronize()
    pin()
    base = mean([clock(pin) for _ in range(reps)])
    return [{"measure": "6 GPU->host", "state": "1 GiB fp32 on GPU", "method": m, "seconds": s,
             "GB_s": (1 << 30) / s / GB} for m, s in (("trainguard take()", ours), ("pinned copy_", base))], \
        100 * base / ours


def main() -> None:
    args = common.parser(__doc__.splitlines()[0]).parse_args()
    load_avg = os.getloadavg()
    layers, reps = (10, 3) if args.quick else (100, 6)
    steps, every, pairs, skip = (12, 5, 1, 3) if args.quick else (30, 10, 2, 3)
    rows, goals, floors, job = [], [], {}, f"bench-checkpoint-{os.getpid()}"
    with tempfile.TemporaryDirectory(prefix="tg-bench-ckpt-") as d:
        tmp = Path(d)
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp / "pg"), 1), rank=0, world_size=1)
        try:
            for i, make in enumerate((resnet_state, lambda: synthetic_state(layers))):
                state, label = make()
                got, r = bench_state(state, label, reps, tmp, f"{job}-{i}")
                rows += got
                short, floors[label] = label.split(" (")[0], r["floor"]
                goals += [common.Goal(f"{short}: blocked per checkpoint, ours / torch.save", r["vs_save"], 5, "%"),
                          common.Goal(f"{short}: blocked per checkpoint, ours / DCP async_save", r["vs_async"], 1.0,
                                      "x"),
                          common.Goal(f"{short}: take() bandwidth / flat memcpy", r["copy"], 60, "%", True),
                          common.Goal(f"{short}: persist throughput / raw write+fsync", r["persist"], 80, "%", True),
                          common.Goal(f"{short}: load from memory, speed-up over storage", r["load"], 5, "x", True)]
                del state
        finally:
            dist.destroy_process_group()

        # 5. the example's throughput, launches alternating
        base, ckpt, reports = [], [], []
        for p in range(pairs):
            for snapshot in ((False, True) if p % 2 == 0 else (True, False)):
                times, rep = train(tmp, f"{job}-{'ckpt' if snapshot else 'base'}{p}", steps, every, snapshot)
                (ckpt if snapshot else base).extend(times[skip:])
                if snapshot:
                    reports.append(rep.get("snapshots"))
    per_base, per_ckpt = mean(base), mean(ckpt)
    label = "ResNet-50 example, 2 ranks, SGD"
    rows.append({"measure": "5 throughput", "state": label, "method": "no checkpoints", "seconds": per_base,
                 "note": f"{1 / per_base:.3g} steps/s; s/step, {len(base)} steps"})
    rows.append({"measure": "5 throughput", "state": label, "method": f"snapshot every step, persist every {every}",
                 "seconds": per_ckpt, "note": f"{1 / per_ckpt:.3g} steps/s; s/step, {len(ckpt)} steps"})
    goals.append(common.Goal("ResNet-50 example: throughput with snapshots / without", 100 * per_base / per_ckpt,
                             97, "%", True))

    # 6. GPU: device-to-host take() against a copy into pinned memory
    gpu = gpu_rows(reps, job) if torch.cuda.is_available() else None
    rows += gpu[0] if gpu else [{"measure": "6 GPU->host", "state": "-", "method": "trainguard take() vs pinned copy_",
                                 "note": "no GPU in this run"}]
    goals.append(common.Goal("GPU: take() device-to-host bandwidth / pinned copy", gpu and gpu[1], 60, "%", True))

    left = sorted(p.name for p in Path("/dev/shm").glob(f"trainguard-{job}-*"))  # ours only: tests may run beside
    extra = {"notes": {
        "1": "ours: take() (copy into a shared-memory slot, header, seal request) + persist() (a request to the "
             "worker); torch.save: pickle to a file + flush + fsync; DCP: torch.distributed.checkpoint.async_save "
             "with defaults (DefaultStager: a fresh CPU copy each save, thread executor, FileSystemWriter with "
             "sync_files) until it returns",
        "2": "bytes of the state's tensors / time; baseline: dst.copy_(src) of one flat uint8 tensor holding all "
             "the bytes, both preallocated and touched",
        "3": "ours: persist() -> reply: CRC32 seal, write (SHA-256 on a thread), fsync, manifest, rename, tracker; "
             "baseline: os.write in 8 MiB chunks + fsync of the same bytes, same disk (medians)",
        "4": "state as CPU tensors, no load_state_dict; memory: a fresh Snapshots on the same directory; storage: "
             "after `echo 1 > /proc/sys/vm/drop_caches` when permitted (the guest's cache; a VM host may still cache)",
        "5": f"`trainguard run --nproc-per-node 2 examples/resnet50/train.py steps={steps} save_every={every} "
             f"snapshot_every=1` vs `save_every=0 snapshot_every=0` (default optimizer: SGD), {pairs} launch "
             f"pair(s) alternating; mean of rank-0 per-step times from its log, first {skip} steps of each left out",
        "6": "device-to-host take() bandwidth vs copy_ into pinned host tensors",
        "blocked_floor": "a snapshot cannot beat one flat memcpy of the state: flat memcpy / torch.save is the lowest "
                         "ours / torch.save can reach on this machine"},
        "blocked_floor": floors, "snapshot_reports": reports, "shm_left": left, "tmp_dir": tempfile.gettempdir(),
        "load_avg_at_start": load_avg}
    common.report("checkpoint", rows, ["measure", "state", "method", "seconds", "GB_s", "note"], goals,
                  quick=args.quick, out=args.out, extra=extra)
    if left:
        sys.exit(f"left in /dev/shm: {left}")


if __name__ == "__main__":
    main()
