"""The GPT-3 example (megatron-core GPT) under trainguard's MindIO-compatible API.

Side by side in one run, on the same model and machine (2 CPU ranks, gloo):

* **periodic** ``save_checkpoint`` (Megatron's layout, every rank alive):
  how long the training loop is blocked by one save;
* **dying gasp**: rank 1 is SIGKILLed in iteration 4; from the fault (its
  strike time) to the finalised ``iter_0000003`` (its manifest's creation
  time): detection, prelock, rank 0's save of the lost rank's replica,
  verification, rename and tracker.

The GPU rows (device memory and step time of the replicated distributed
optimizer against megatron's distributed optimizer) need CUDA; without it
they are reported as not run.

usage: python bench/megatron.py [--quick]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "gpt3" / "train.py"


def run(tmp: Path, name: str, model: list[str], *, fault: str | None = None, extra=()) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env["TRAINGUARD_HEARTBEAT_INTERVAL_S"] = "0.5"
    if fault:
        env["TRAINGUARD_FAULT"] = fault
    cmd = [sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", "2", "--monitor-interval", "0.1",
           str(EXAMPLE), "steps=6", "log_every=0", f"report={name}.json", f"checkpoint_dir={name}-ckpt",
           *model, *extra]
    out = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=900)
    return out.returncode, out.stdout + out.stderr


def main() -> None:
    args = common.parser(__doc__.splitlines()[0]).parse_args()
    size = ["model.num_layers=2", "model.hidden_size=256", "model.ffn_hidden_size=1024", "model.vocab_size=4096",
            "model.seq_length=64"] if args.quick else \
        ["model.num_layers=6", "model.hidden_size=768", "model.num_attention_heads=12", "model.ffn_hidden_size=3072",
         "model.vocab_size=16384", "model.seq_length=128", "micro_batch_size=2"]
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        rc, log = run(tmp, "periodic", size, extra=["save_every=3"])
        if rc != 0:
            sys.exit(f"periodic run failed:\n{log[-3000:]}")
        rep = json.loads((tmp / "periodic.json").read_text())
        ckpt_bytes = sum(f.stat().st_size for f in (tmp / "periodic-ckpt" / "iter_0000003").rglob("*.pt"))
        for s in rep["periodic_save_s"]:
            rows.append({"what": "periodic save_checkpoint (blocked)", "seconds": s, "checkpoint_MB": ckpt_bytes / 1e6,
                         "step_s": rep["step_time_s"]})
        rc, log = run(tmp, "dump", size, fault="crash:rank=1,step=3")
        if rc != 75:
            sys.exit(f"dying-gasp run ended with {rc}, not 75:\n{log[-3000:]}")
        fault = json.loads((tmp / "dump-ckpt" / ".trainguard" / "faults.jsonl").read_text().splitlines()[0])
        manifest = json.loads((tmp / "dump-ckpt" / "iter_0000003" / "manifest.json").read_text())
        dump_bytes = sum(f.stat().st_size for f in (tmp / "dump-ckpt" / "iter_0000003").rglob("*.pt"))
        rows.append({"what": "dying gasp: fault -> finalised", "seconds": manifest["created"] - fault["time"],
                     "checkpoint_MB": dump_bytes / 1e6, "step_s": rep["step_time_s"]})
    params = {"quick": size, "full": size}["quick" if args.quick else "full"]
    try:
        import torch

        gpu = torch.cuda.is_available()
    except ImportError:
        gpu = False
    extra = {"model": params, "gpu_rows": "not run: no CUDA device on this machine" if not gpu else
             "not implemented in this script yet (tests/test_gpu.py::test_megatron_replicated_optimizer_on_gpu)"}
    common.report("megatron", rows, ["what", "seconds", "checkpoint_MB", "step_s"], [], quick=args.quick,
                  out=args.out, extra=extra)


if __name__ == "__main__":
    main()
