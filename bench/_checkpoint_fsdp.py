"""Measure 7 of ``bench/checkpoint.py``: a periodic checkpoint of an HSDP
model (``fully_shard`` over a 2x2 mesh, 4 gloo ranks on this host), blocked
per checkpoint: the Guard's ``save()`` (DCP files written by one rank of
each shard, metadata merged and the checkpoint finalised by rank 0, all
before it returns) against DCP's own ``async_save`` until it returns (its
future awaited before the next save) and ``dcp.save``; the same state,
alternating sides, the slowest rank's time each save.

Run alone: ``python bench/_checkpoint_fsdp.py [--quick]`` launches the 4
ranks with torchrun and prints the rows; ``bench/checkpoint.py`` adds them
to its table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RANKS = 4


def fsdp(quick: bool, per_state: dict) -> tuple[list[dict], list]:
    """Measure 7: its rows and goal (its numbers into ``per_state["fsdp"]``)."""
    import common
    with tempfile.TemporaryDirectory(prefix="tg-bench-fsdp-") as d:
        rows, r = run_fsdp(Path(d), quick)
    per_state["fsdp"] = r
    return rows, [common.Goal("HSDP 2x2 (4 ranks): blocked per checkpoint, ours / DCP async_save",
                              r["ours"] / r["async"], 1, "x")]


def run_fsdp(tmp: Path, quick: bool) -> tuple[list[dict], dict]:
    """Launch the ranks; returns the table rows and ``{"ours": s, "async": s, "save": s, "bytes": n}``."""
    out = tmp / "fsdp.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS),
           __file__, "worker", str(tmp), str(out), "1" if quick else "0"]
    proc = subprocess.run(cmd, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=1800)
    if proc.returncode or not out.exists():
        raise RuntimeError(f"the FSDP measure failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    r = json.loads(out.read_text())
    label = f"HSDP 2x2, {RANKS} ranks, {r['bytes'] / 1e6:.0f} MB (AdamW)"
    rows = [{"measure": "7 FSDP blocked", "state": label, "method": method, "seconds": r[key],
             "note": f"mean of {r['reps']} saves, slowest rank each" + extra}
            for method, key, extra in (
                ("Guard.save (DCP, sync)", "ours", "; every rank waits for the finalised checkpoint"),
                ("DCP async_save until it returns", "async", "; its future awaited before the next save"),
                ("dcp.save", "save", ""))]
    return rows, r


def _worker(tmp: Path, out: Path, quick: bool) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainguard.torch import Guard

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, RANKS // 2), mesh_dim_names=("replicate", "shard"))
    layers, width, reps = (4, 512, 3) if quick else (16, 1024, 5)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters())
    guard = Guard(model, opt, checkpoint_dir=tmp / "ours", keep=1)
    for _ in guard.steps(1):
        with guard.protect():
            model(torch.randn(8, width)).square().mean().backward()
            guard.optimizer.step()
            guard.optimizer.zero_grad()
    nbytes = 3 * sum(p.numel() * p.element_size() for p in model.parameters())  # weights + 2 AdamW moments

    def slowest(fn) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        took = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        return float(took)

    times: dict[str, list[float]] = {"ours": [], "async": [], "save": []}
    pending = [None]

    def async_save(i: int) -> None:
        msd, osd = get_state_dict(model, opt)
        pending[0] = dcp.async_save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp / f"async-{i}"))

    def save(i: int) -> None:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp / f"save-{i}"))

    # Ours first in each pair: DCP's async staging thread leaves this process's OpenMP regions slower
    # (bench/checkpoint.py's main), which would count against whoever runs after it.
    for i in range(reps):
        times["ours"].append(slowest(guard.save))
        times["save"].append(slowest(lambda: save(i)))
        times["async"].append(slowest(lambda: async_save(i)))
        pending[0].result()
    guard.close()
    if rank == 0:
        out.write_text(json.dumps({**{k: sum(v) / len(v) for k, v in times.items()}, "bytes": nbytes, "reps": reps,
                                   "all": times}))
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        _worker(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4] == "1")
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import common  # noqa: E402
        with tempfile.TemporaryDirectory(prefix="tg-bench-fsdp-") as d:
            rows, r = run_fsdp(Path(d), "--quick" in sys.argv)
        print(common.table(rows, ["measure", "state", "method", "seconds", "note"]))
        print(f"ours / async_save: {r['ours'] / r['async']:.2f}x; ours / dcp.save: {r['ours'] / r['save']:.2f}x")
