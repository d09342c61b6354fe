"""Warm restarts: time from a relaunched process's start to its first
completed step, with trainguard's compile cache and without.

For each framework and variant, one cycle: ``trainguard run`` of the
ResNet-50 example on 2 CPU ranks, a worker killed at step 2 (dying-gasp
checkpoint, exit 75), then the same command again, which resumes; the
measure is rank 0's time in the relaunch from its script's first line to
its first completed step (imports, model, checkpoint load, compile, step).

* torch: ``examples/resnet50/train.py compile=true`` (torch.compile,
  Inductor, CPU). Variants: *no cache* -- a fresh Inductor directory for
  each launch, as a restart on another node or in a new container finds;
  *trainguard* -- the job's compile cache (default place, under the
  checkpoint directory); and for reference *torch's local cache, same
  host* -- both launches share one Inductor directory, which a restart on
  the same machine with a persistent /tmp would find (no validation, not
  shared between nodes).
* MindSpore graph mode: ``examples/resnet50/train_mindspore_graph.py`` (the
  example's ResNet-50 model and data, ``Model.train`` with ``TrainFaultTolerance``).
  Variants: *no cache* (``TRAINGUARD_COMPILE_CACHE=off``: MindSpore
  compiles every graph) and *trainguard* (``MS_COMPILER_CACHE_PATH`` set by
  the Guard per rank).

usage: python bench/compile_cache.py [--quick] [--repeats N] [--only torch|mindspore]
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TORCH_SCRIPT = ROOT / "examples" / "resnet50" / "train.py"
MS_SCRIPT = ROOT / "examples" / "resnet50" / "train_mindspore_graph.py"
STEPS = 4
FAULT = "crash:rank=1,step=2"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp: Path, framework: str, env: dict, tag: str, fault: str | None) -> dict:
    """One launch; returns rank 0's report (and the launcher's exit code)."""
    report = tmp / f"{tag}.json"
    full = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINGUARD_", "MS_", "TORCHINDUCTOR_"))}
    full.update(env, TRAINGUARD_STRATEGIES="dump,exit", PYTHONUNBUFFERED="1")
    if fault:
        full["TRAINGUARD_FAULT"] = fault
    ckpt = tmp / "ckpt"
    if framework == "torch":
        cmd = [sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", "2", "--monitor-interval", "0.1",
               str(TORCH_SCRIPT), f"steps={STEPS}", "compile=true", "save_every=0", "log_every=0",
               f"report={report}", f"checkpoint_dir={ckpt}"]
    else:
        cmd = [sys.executable, "-m", "trainguard.cli", "run", "--framework", "mindspore", "--worker_num=2",
               "--local_worker_num=2", f"--master_port={free_port()}", "--join=True", f"--log_dir={tmp / tag}-logs",
               str(MS_SCRIPT), str(STEPS), str(report), str(ckpt)]
        full.setdefault("MS_CPU_COMM_OP_TIMEOUT", "10")
    out = subprocess.run(cmd, env=full, cwd=tmp, capture_output=True, text=True, timeout=1800)
    expected = 75 if fault else 0
    if out.returncode != expected:
        raise RuntimeError(f"{framework} {tag}: exit {out.returncode}, expected {expected}:\n"
                           f"{(out.stdout + out.stderr)[-4000:]}")
    return json.loads(report.read_text()) if report.exists() else {}


def cycle(framework: str, variant: str, work: Path) -> dict:
    """A crash, then the relaunch that is measured."""
    # No spaces in the path: Inductor's C++ build commands do not quote it.
    tmp = Path(tempfile.mkdtemp(prefix=f"{framework}-{variant.replace(' ', '_').replace(',', '')}-", dir=work))
    inductor = tmp / "inductor"

    def env(launch_no: int) -> dict:
        if variant == "no cache":
            e = {"TRAINGUARD_COMPILE_CACHE": "off"}
            if framework == "torch":
                e["TORCHINDUCTOR_CACHE_DIR"] = str(inductor / str(launch_no))  # fresh local disk
            return e
        if variant == "torch local cache, same host":
            return {"TRAINGUARD_COMPILE_CACHE": "off", "TORCHINDUCTOR_CACHE_DIR": str(inductor)}
        return {}  # trainguard: the default place under the checkpoint directory

    launch(tmp, framework, env(1), "crash", FAULT)
    r = launch(tmp, framework, env(2), "relaunch", None)
    cc = r.get("compile_cache", {})
    row = {"framework": framework, "variant": variant, "first_step_s": r.get("first_step_s"),
           "start_step": r.get("start_step", "-"), "cache": cc.get("state"),
           "restored_MB": round(cc.get("restored", {}).get("bytes", 0) / 1e6, 1) if cc.get("restored") else None,
           "hash": (r.get("final_state_sha256") or "")[:12]}
    phases = r.get("phases_s")
    if phases and r.get("first_step_s") is not None and "first_step_begins" in phases:
        # MindSpore: the start-up before the first step (imports, msrun's communication set-up, model) and
        # the first step itself (compile or load the graph, run it), which is what a compile cache can cut.
        row["before_step_s"] = phases["first_step_begins"]
        row["step_itself_s"] = round(r["first_step_s"] - phases["first_step_begins"], 3)
    if framework == "torch":
        t = cc.get("torch", {})
        row["fx_hits/misses"] = f"{t.get('fxgraph_cache_hit', '-')}/{t.get('fxgraph_cache_miss', '-')}" if t else "-"
    print(f"  {framework:9s} {variant:30s} first step after {row['first_step_s']} s (cache: {row['cache']})",
          flush=True)
    return row


def main() -> None:
    ap = common.parser(__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=None, help="cycles per variant (default 2; --quick 1)")
    ap.add_argument("--only", choices=("torch", "mindspore"), default=None)
    args = ap.parse_args()
    repeats = args.repeats or (1 if args.quick else 2)
    plan = []
    if args.only in (None, "torch"):
        plan += [("torch", v) for v in ("no cache", "trainguard")]
        if not args.quick:
            plan.append(("torch", "torch local cache, same host"))
    if args.only in (None, "mindspore"):
        plan += [("mindspore", v) for v in ("no cache", "trainguard")]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-compile-cache-") as work:
        for _ in range(repeats):
            for framework, variant in plan:  # interleaved, so drift of the machine hits every variant alike
                rows.append(cycle(framework, variant, Path(work)))
    goals, summary = [], []
    for framework in ("torch", "mindspore"):
        med = {v: statistics.median(r["first_step_s"] for r in rows if r["framework"] == framework
                                    and r["variant"] == v and r["first_step_s"] is not None)
               for v in {r["variant"] for r in rows if r["framework"] == framework}}
        if "no cache" in med and "trainguard" in med:
            speedup = med["no cache"] / med["trainguard"]
            entry = {"framework": framework, "median_first_step_s": med, "speedup": round(speedup, 2)}
            steps = {v: [r["step_itself_s"] for r in rows if r["framework"] == framework and r["variant"] == v
                         and r.get("step_itself_s") is not None] for v in ("no cache", "trainguard")}
            if all(steps.values()):
                entry["first_step_itself_speedup"] = round(statistics.median(steps["no cache"])
                                                           / statistics.median(steps["trainguard"]), 2)
            summary.append(entry)
            goals.append(common.Goal(f"{framework}: relaunch start -> first step, no cache / trainguard cache",
                                     round(speedup, 2), 3.0, "x faster", higher_is_better=True))
    columns = ["framework", "variant", "first_step_s", "before_step_s", "step_itself_s", "cache", "restored_MB",
               "fx_hits/misses", "hash"]
    common.report("compile_cache", rows, columns, goals, quick=args.quick, out=args.out,
                  extra={"summary": summary, "steps": STEPS, "fault": FAULT, "ranks": 2})


if __name__ == "__main__":
    main()
