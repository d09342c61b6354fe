"""The GPT-3 example (megatron-core GPT) under trainguard's MindIO-compatible API.

Side by side in one run, on the same model and machine (2 CPU ranks, gloo):

* **periodic** ``save_checkpoint`` (Megatron's layout, every rank alive):
  how long the training loop is blocked by one save;
* **dying gasp**: rank 1 is SIGKILLed in iteration 4; from the fault (its
  strike time) to the finalised ``iter_0000003`` (its manifest's creation
  time): detection, prelock, rank 0's save of the lost rank's replica,
  verification, rename and tracker;
* **in-place retry**: a device memory error (UCE) on rank 1 in iteration 4,
  repaired without a restart (``mega.register_recovery_handlers``): from the
  fault to training resumed (detection + recovery as the job's report
  records them), with the number of steps lost.

With ``--gpu`` (needs CUDA and writes ``megatron-gpu.json``) the same two
rows on the GPU with megatron's DDP and trainguard's replicated distributed
optimizer (4 ranks, shards in 2 instances, bf16 model), and beside them the
device memory and step time of the distributed optimizer kept in 2
instances (replicated) against megatron's own single instance, same model,
same ranks. On a one-GPU machine all ranks share the GPU over gloo
(``tests/workers/one_gpu_megatron.py``): collectives go through host memory,
so step times are not those of NCCL on one GPU per rank; the comparison
between the two optimizers is like for like.

usage: python bench/megatron.py [--quick] [--gpu]
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
ONE_GPU = ROOT / "tests" / "workers" / "one_gpu_megatron.py"
WORKER = ROOT / "bench" / "_megatron_gpu_worker.py"
GPU_MODEL = {"num_layers": 12, "hidden_size": 1024, "num_attention_heads": 16, "ffn_hidden_size": 4096,
             "vocab_size": 32768, "seq_length": 512}  # about 200M parameters
GPU_RANKS = 4


def optimizer_rows(model: dict, bf16: bool) -> tuple[list[dict], dict]:
    """Peak device memory, optimizer state and step time per rank: megatron's
    distributed optimizer in 1 instance against 2 (trainguard's replicated)."""
    rows, by = [], {}
    for instances in (1, 2):
        env = {**os.environ, "R": str(instances), "BF16": "1" if bf16 else "0", "MODEL": json.dumps(model),
               "PYTHONUNBUFFERED": "1"}
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                              str(GPU_RANKS), str(ONE_GPU), str(WORKER)], env=env, capture_output=True, text=True,
                             timeout=900)
        got = [json.loads(line.split("RESULT ", 1)[1]) for line in out.stdout.splitlines() if "RESULT " in line]
        if out.returncode or len(got) != GPU_RANKS:
            sys.exit(f"the optimizer run with {instances} instance(s) failed:\n{(out.stdout + out.stderr)[-3000:]}")
        mean = lambda key: sum(r[key] for r in got) / len(got)  # noqa: E731
        by[instances] = {k: mean(k) for k in ("optimizer_state_bytes", "max_allocated_bytes", "step_s")}
        rows.append({"what": f"{'replicated (2 instances)' if instances == 2 else 'megatron distributed (1)'}"
                             f"{', bf16' if bf16 else ', fp32'}",
                     "seconds": by[instances]["step_s"], "optimizer_MB": by[instances]["optimizer_state_bytes"] / 2**20,
                     "peak_MB": by[instances]["max_allocated_bytes"] / 2**20, "params": got[0]["params"]})
    one, two = by[1], by[2]
    per_param = 12 if bf16 else 8  # bytes of sharded state per parameter: (fp32 main +) two fp32 moments
    expected = (2 - 1) * per_param * got[0]["params"] / GPU_RANKS
    extra = two["optimizer_state_bytes"] - one["optimizer_state_bytes"]
    return rows, {"bf16": bf16, "extra_optimizer_MB": extra / 2**20,
                  "expected_extra_MB": expected / 2**20,
                  "peak_overhead_pct": 100 * (two["max_allocated_bytes"] / one["max_allocated_bytes"] - 1),
                  "step_overhead_pct": 100 * (two["step_s"] / one["step_s"] - 1)}


def run(tmp: Path, name: str, model: list[str], *, fault: str | None = None, extra=(), nproc: int = 2,
        prefix=()) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env["TRAINGUARD_HEARTBEAT_INTERVAL_S"] = "0.5"
    if fault:
        env["TRAINGUARD_FAULT"] = fault
    cmd = [sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", str(nproc), "--monitor-interval", "0.1",
           *map(str, prefix), str(EXAMPLE), "steps=6", "log_every=0", f"report={name}.json",
           f"checkpoint_dir={name}-ckpt",
           *model, *extra]
    out = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=900)
    return out.returncode, out.stdout + out.stderr


def fault_rows(size: list[str], **how) -> tuple[list[dict], dict]:
    """A periodic save_checkpoint and a dying gasp of the same model."""
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        rc, log = run(tmp, "periodic", size, extra=["save_every=3", *how.get("extra", ())],
                      **{k: v for k, v in how.items() if k != "extra"})
        if rc != 0:
            sys.exit(f"periodic run failed:\n{log[-3000:]}")
        rep = json.loads((tmp / "periodic.json").read_text())
        ckpt_bytes = sum(f.stat().st_size for f in (tmp / "periodic-ckpt" / "iter_0000003").rglob("*.pt"))
        for s in rep["periodic_save_s"]:
            rows.append({"what": "periodic save_checkpoint (blocked)", "seconds": s, "checkpoint_MB": ckpt_bytes / 1e6,
                         "step_s": rep["step_time_s"]})
        rc, log = run(tmp, "dump", size, fault="crash:rank=1,step=3", **how)
        if rc != 75:
            sys.exit(f"dying-gasp run ended with {rc}, not 75:\n{log[-3000:]}")
        fault = json.loads((tmp / "dump-ckpt" / ".trainguard" / "faults.jsonl").read_text().splitlines()[0])
        manifest = json.loads((tmp / "dump-ckpt" / "iter_0000003" / "manifest.json").read_text())
        dump_bytes = sum(f.stat().st_size for f in (tmp / "dump-ckpt" / "iter_0000003").rglob("*.pt"))
        rows.append({"what": "dying gasp: fault -> finalised", "seconds": manifest["created"] - fault["time"],
                     "checkpoint_MB": dump_bytes / 1e6, "step_s": rep["step_time_s"],
                     "note": "saved by " + ", ".join(f"{s['saved_by']} for {s['copies']}"
                                                     for s in manifest["layout"]["shards"])})
        rc, log = run(tmp, "retry", size, fault="uce:rank=1,step=3,phase=backward", **how)
        retried = json.loads((tmp / "retry.json").read_text()) if rc == 0 else {}
        records = retried.get("recoveries", [])
        if rc != 0 or [r["strategy"] for r in records] != ["retry"] or \
                any(len(pids) != 1 for pids in retried["pids"].values()):
            sys.exit(f"in-place retry run ended with {rc}, recoveries {records}:\n{log[-3000:]}")
        r = records[0]
        rows.append({"what": "in-place retry (UCE): fault -> resumed", "seconds": r["detect_s"] + r["recover_s"],
                     "step_s": retried["step_time_s"],
                     "note": f"{r['reason']}; detect {r['detect_s']:.3f} s, recover {r['recover_s']:.3f} s, "
                             f"lost {r['lost_steps']} steps, same processes"})
    return rows, rep


def main_gpu(args) -> None:
    import torch

    if not torch.cuda.is_available():
        sys.exit("--gpu needs a CUDA device")
    model = dict(GPU_MODEL, num_layers=4, hidden_size=512, num_attention_heads=8, ffn_hidden_size=2048) \
        if args.quick else GPU_MODEL
    rows, overheads = [], []
    for bf16 in (True, False):
        got, over = optimizer_rows(model, bf16)
        rows, overheads = rows + got, overheads + [over]
    size = [f"model.{k}={v}" for k, v in model.items()] + ["micro_batch_size=2"]
    how = {"nproc": GPU_RANKS, "prefix": [ONE_GPU],
           "extra": ["device=cuda", "backend=trainguard", "optimizer=replicated", "replicas=2", "bf16=true"]}
    saves, rep = fault_rows(size, **how)
    for r in saves:
        r["what"] = "replicated, bf16: " + r["what"]
    rows += saves
    goals = [common.Goal(f"replicated optimizer state beyond megatron's ({'bf16' if o['bf16'] else 'fp32'}) equals "
                         f"(r-1) x {12 if o['bf16'] else 8} bytes x params / DP", o["extra_optimizer_MB"],
                         o["expected_extra_MB"] * 1.001, "MB") for o in overheads]
    gpu = torch.cuda.get_device_name()
    common.report("megatron-gpu", rows, ["what", "seconds", "optimizer_MB", "peak_MB", "checkpoint_MB", "step_s",
                                         "note"], goals, quick=args.quick, out=args.out,
                  extra={"gpu": gpu, "ranks": GPU_RANKS, "model": model, "overheads": overheads,
                         "setup": f"{GPU_RANKS} ranks share one {gpu} over gloo (tests/workers/one_gpu_megatron.py): "
                                  "collectives go through host memory, so absolute step times are not NCCL's; "
                                  "the two optimizers run the same model on the same ranks",
                         "dump_report": {k: rep.get(k) for k in ("optimizer", "cuda_max_allocated_MB")}})


def main() -> None:
    ap = common.parser(__doc__.splitlines()[0])
    ap.add_argument("--gpu", action="store_true", help="the GPU rows (megatron-gpu.json)")
    args = ap.parse_args()
    if args.gpu:
        return main_gpu(args)
    size = ["model.num_layers=2", "model.hidden_size=256", "model.ffn_hidden_size=1024", "model.vocab_size=4096",
            "model.seq_length=64"] if args.quick else \
        ["model.num_layers=6", "model.hidden_size=768", "model.num_attention_heads=12", "model.ffn_hidden_size=3072",
         "model.vocab_size=16384", "model.seq_length=128", "micro_batch_size=2"]
    rows, _ = fault_rows(size)
    params = {"quick": size, "full": size}["quick" if args.quick else "full"]
    try:
        import torch

        gpu = torch.cuda.is_available()
    except ImportError:
        gpu = False
    extra = {"model": params, "gpu_rows": "python bench/megatron.py --gpu on a CUDA machine: "
                                          "bench/results/megatron-gpu.json" + ("" if gpu else " (no CUDA here)")}
    common.report("megatron", rows, ["what", "seconds", "checkpoint_MB", "step_s", "note"], [], quick=args.quick,
                  out=args.out, extra=extra)


if __name__ == "__main__":
    main()
