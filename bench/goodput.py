"""Goodput under faults: trainguard beside torchrun and torchft, one worker.

One training loop (``bench/_goodput_worker.py``: a small GPT with dropout,
two data-parallel ranks on gloo) and one seeded fault schedule -- a fault
every N steps, each a process kill, a device memory error (UCE), a
communication error, a hang in Python or a SIGSTOP, on a random rank --
run under:

* **torchrun**: ``torchrun --max-restarts F`` (F: the schedule's faults) and
  a ``torch.save`` checkpoint every K steps; a launch that still fails is
  relaunched, as a scheduler would. A hang or a stopped rank is noticed only
  when its peer's collective times out (the process group's timeout: 30 s
  here, against gloo's default of 30 min);
* **torchft** 0.2: two replica groups of one process each, each under its
  own ``torchrun --max-restarts F``, a lighthouse, the quorum every step; a
  replica that comes back heals from its live peer;
* **trainguard (defaults)**: ``trainguard run`` with no trainguard flag and
  the Guard's defaults (no snapshots in memory: a restart in place copies
  the state from a replica); exit 75 is relaunched, as a scheduler would;
* **trainguard (best)**: the strategies that suit a schedule of lost
  processes, device and communication errors (``retry,recover-in-place,
  dump,exit``) with a restart budget that covers every fault.

For each: goodput = fault-free time of the steps done (a plain torchrun
launch of the same steps with no checkpoints, measured in this run) / wall
time, steps lost (computed twice), faults survived, and whether the final
parameters equal that layer's fault-free run's, bit for bit.

A job that gains no step for 120 s is ended as stuck (not finished), and
so is one past 6x the fault-free time.

usage: python bench/goodput.py [--quick] [--intervals 10,25,50] [--steps S]
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

WORKER = Path(__file__).resolve().parent / "_goodput_worker.py"
NPROC = 2
KINDS = ("crash", "uce", "comm", "hang", "stop")
SAVE_EVERY = 10  # the torchrun baseline's checkpoint interval (steps)
LAYERS = ("torchrun", "torchft", "trainguard-defaults", "trainguard-best")


def schedule(steps: int, interval: int, seed: int) -> list[dict]:
    """A fault every ``interval`` steps (jittered by up to a quarter of it),
    the kinds taken in a seeded order, each on a random rank."""
    rng = random.Random(seed * 1000 + interval)
    kinds = list(KINDS)
    rng.shuffle(kinds)
    out, at = [], interval
    while at < steps:
        step = min(steps - 1, max(2, at + rng.randint(-(interval // 4), interval // 4)))
        if not out or step > out[-1]["step"]:
            out.append({"step": step, "kind": kinds[len(out) % len(kinds)], "rank": rng.randrange(NPROC)})
        at += interval
    return out


def spec(faults: list[dict]) -> str:
    phase = {"hang": "forward", "stop": "forward"}
    return ";".join(f"{f['kind']}:rank={f['rank']},step={f['step']},phase={phase.get(f['kind'], 'backward')}"
                    for f in faults)


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINGUARD_", "TORCHELASTIC_"))}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return env


#: A job whose timeline gained no step for this long is stuck (torchft
#: with a replica hung in Python: its heartbeats go on, so the quorum keeps
#: it), and is ended as not finished.
STALL_S = 120.0


def _wait(procs: list[subprocess.Popen], deadline: float, done=lambda: False, timeline: Path | None = None) -> bool:
    """Wait for every process (or ``done()``); False past the deadline or
    when ``timeline`` gained no line for :data:`STALL_S`."""
    last, size = time.monotonic(), -1
    while time.monotonic() < deadline:
        if all(p.poll() is not None for p in procs) or done():
            return True
        now_size = timeline.stat().st_size if timeline is not None and timeline.exists() else 0
        if now_size != size:
            last, size = time.monotonic(), now_size
        elif timeline is not None and time.monotonic() - last > STALL_S:
            print(f"no step for {STALL_S:.0f} s: ending the job as stuck", file=sys.stderr)
            return False
        time.sleep(0.1)
    return False


def _descendants(pid: int) -> list[int]:
    """Every living process below ``pid`` (torchrun starts its workers in
    sessions of their own, so killing the launcher's group leaves them)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat[stat.rindex(")") + 2:].split()[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _kill(procs: list[subprocess.Popen]) -> None:
    """End each launch and everything it started (a worker left stopped or
    hung by a fault would else run on beside the next launches)."""
    for p in procs:
        below = _descendants(p.pid)
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in below:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait()


def run_layer(layer: str, faults: list[dict], steps: int, size: list[str], tmp: Path, limit_s: float) -> dict:
    """One job under ``layer`` to the end (relaunching as a scheduler would),
    or until ``limit_s``; its timeline, wall time and result."""
    tmp.mkdir(parents=True)
    timeline, result, ckpt, fault_log = tmp / "timeline", tmp / "result.json", tmp / "ckpt", tmp / "faults"
    worker = [str(WORKER), "--steps", str(steps), "--timeline", str(timeline), "--result", str(result),
              "--ckpt", str(ckpt), *size]
    env = _clean_env()
    restarts = str(len(faults) + 1)
    launches, start = [], time.monotonic()
    deadline = start + limit_s
    finished = False
    if layer == "torchft":
        finished = _torchft(worker, faults, fault_log, env, restarts, result, tmp, deadline, launches)
    else:
        for _ in range(len(faults) + 2):
            if layer == "torchrun":
                env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # without it torch 2.13's restarted workers hang
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--max-restarts", restarts,
                       "--nproc-per-node", str(NPROC), "--monitor-interval", "0.1", *worker, "--mode", "plain",
                       "--save-every", str(SAVE_EVERY), "--faults", spec(faults), "--fault-log", str(fault_log)]
            else:
                cmd = [sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", str(NPROC),
                       "--monitor-interval", "0.1"]
                if layer == "trainguard-best":
                    cmd += ["--max-restarts", restarts, "--strategies", "retry,recover-in-place,dump,exit"]
                cmd += [*worker, "--mode", "guard"]
                if faults:
                    env["TRAINGUARD_FAULT"] = spec(faults)
            with open(tmp / f"launch-{len(launches)}.log", "w") as log:
                proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
                ended = _wait([proc], deadline, timeline=timeline)
                _kill([proc])
            launches.append(proc.returncode if ended else "time limit")
            if not ended or proc.returncode == 0:
                finished = ended and result.exists()
                break
    wall = time.monotonic() - start
    events = _events(timeline)
    done = [e["step"] for e in events if e["event"] == "step"]
    got = json.loads(result.read_text()) if result.exists() else {}
    struck = _struck(layer, ckpt, fault_log)
    return {"wall_s": wall, "finished": finished, "steps_done": max(done, default=0),
            "steps_lost": len(done) - len(set(done)), "faults_struck": struck,
            "sha256": got.get("sha256"), "launches": launches,
            "single_replica_steps": sum(1 for e in events if e.get("participants") == 1)}


def _struck(layer: str, ckpt: Path, fault_log: Path) -> int:
    if layer.startswith("trainguard"):
        path = ckpt / ".trainguard" / "faults.jsonl"
        return sum(1 for e in _events(path) if e.get("event", "fault") == "fault" or "spec" in e)
    return len(_events(fault_log))


def _torchft(worker, faults, fault_log, env, restarts, result, tmp, deadline, launches) -> bool:
    """Two replica groups under their own torchrun each, and a lighthouse
    (torchft's, in this process). The job is done when replica 0 reached the
    last step (a stopped replica is left behind: nothing would end it)."""
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, quorum_tick_ms=100,
                                  heartbeat_timeout_ms=5000)
    env = dict(env, TORCHFT_LIGHTHOUSE=lighthouse.address())
    procs = []
    try:
        for replica in range(NPROC):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--max-restarts", restarts,
                   "--nproc-per-node", "1", "--monitor-interval", "0.1", *worker, "--mode", "torchft",
                   "--faults", spec(faults), "--fault-log", str(fault_log)]
            log = open(tmp / f"replica-{replica}.log", "w")
            # torchft's Manager meets its replica group on the agent's store (torchrun's default).
            procs.append(subprocess.Popen(cmd, env=dict(env, BENCH_REPLICA=str(replica)),
                                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        ended = _wait(procs, deadline, done=result.exists, timeline=tmp / "timeline")
        if ended and procs[1].poll() is None:
            _wait(procs[1:], min(deadline, time.monotonic() + 30))  # replica 1's last steps
        launches.extend(p.poll() if p.poll() is not None else "left running" for p in procs)
        return ended and result.exists()
    finally:
        _kill(procs)
        lighthouse.shutdown()


def reference(layer: str, steps: int, size: list[str], tmp: Path) -> dict:
    return run_layer(layer, [], steps, size, tmp, limit_s=3600)


def main() -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--intervals", default=None, help="fault intervals in steps (default 10,25,50; quick: 10)")
    p.add_argument("--steps", type=int, default=None, help="steps per job (default 150; quick: 30)")
    p.add_argument("--layers", default=",".join(LAYERS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replace-layers", default=None,
                   help="run only these layers (and a fresh fault-free torchrun reference for their goodput) and "
                        "put their rows into the existing results file in place of its rows of those layers")
    p.add_argument("--work-dir", type=Path, default=None, help="keep every launch's logs here (default: a "
                                                                 "temporary directory, removed)")
    args = p.parse_args()
    intervals = [int(n) for n in (args.intervals or ("10" if args.quick else "10,25,50")).split(",")]
    steps = args.steps or (30 if args.quick else 120)
    layers = args.layers.split(",")
    left_out = {}
    if "torchft" in layers:
        try:
            import torchft  # noqa: F401
        except ImportError as e:
            left_out["torchft"] = f"cannot run: {e} (pip install -c constraints-cpu.txt -e '.[bench]')"
            print(f"torchft {left_out['torchft']}; its rows are left out", file=sys.stderr)
            layers.remove("torchft")
    out_path = args.out or common.RESULTS / f"goodput{'-quick' if args.quick else ''}.json"
    kept, earlier = [], {}
    if args.replace_layers:
        layers = args.replace_layers.split(",")
        earlier = json.loads(out_path.read_text())
        kept = [r for r in earlier["rows"] if r["layer"] not in layers]
    size = ["--width", "256", "--layers", "4", "--batch-size", "20"]  # steps of ~0.35 s on 2 CPU cores
    rows = []
    with tempfile.TemporaryDirectory(prefix="goodput-") as tmp:
        tmp = Path(args.work_dir or tmp)
        # The fault-free time every layer is held to: plain torchrun, no checkpoints.
        base = reference("torchrun", steps, ["--save-every", "0", *size], tmp / "ref-plain")
        plain_s = base["wall_s"]
        print(f"fault-free torchrun, {steps} steps: {plain_s:.1f} s", file=sys.stderr)
        refs = {}
        for layer in layers:
            refs[layer] = reference(layer, steps, size, tmp / f"ref-{layer}")
            print(f"fault-free {layer}: {refs[layer]['wall_s']:.1f} s", file=sys.stderr)
        for interval in intervals:
            faults = schedule(steps, interval, args.seed)
            for layer in layers:
                got = run_layer(layer, faults, steps, size, tmp / f"{layer}-{interval}", limit_s=6 * plain_s + 120)
                row = {"layer": layer, "interval": interval, "faults": len(faults),
                       "faults_survived": got["faults_struck"] if got["finished"] else 0,
                       "goodput": round(plain_s * got["steps_done"] / steps / got["wall_s"], 3),
                       "wall_s": round(got["wall_s"], 1), "fault_free_s": round(refs[layer]["wall_s"], 1),
                       "steps_done": got["steps_done"], "steps_lost": got["steps_lost"],
                       "identical": got["sha256"] is not None and got["sha256"] == refs[layer]["sha256"],
                       "launches": got["launches"]}
                if layer == "torchft":
                    row["single_replica_steps"] = got["single_replica_steps"]
                rows.append(row)
                print(row, file=sys.stderr)
        plain_end = reference("torchrun", steps, ["--save-every", "0", *size], tmp / "ref-plain-end")
    extra = {}
    if args.replace_layers:
        extra["rows_replaced"] = {"layers": layers, "by_run_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                  "fault_free_torchrun_s_of_that_run": [round(plain_s, 1),
                                                                        round(plain_end["wall_s"], 1)],
                                  "earlier_run": earlier.get("when"),
                                  "fault_free_torchrun_s_of_the_earlier_run": earlier.get("fault_free_torchrun_s")}
        rows = sorted(kept + rows, key=lambda r: (r["interval"], LAYERS.index(r["layer"])))
    goals = _goals(rows, intervals)
    result = common.report(
        "goodput", rows, ["layer", "interval", "faults", "faults_survived", "goodput", "wall_s", "fault_free_s",
                          "steps_done", "steps_lost", "identical", "launches"], goals, quick=args.quick,
        out=args.out,
        extra={"steps": steps, "nproc": NPROC, "model": size, "torchrun_checkpoint_every": SAVE_EVERY,
               "fault_free_torchrun_s": [round(plain_s, 1), round(plain_end["wall_s"], 1)],
               "schedules": {n: schedule(steps, n, args.seed) for n in intervals},
               "load_average": os.getloadavg(), "layers_left_out": left_out, **extra})
    _plot(result, args.out)


def _goals(rows: list[dict], intervals: list[int]) -> list[common.Goal]:
    by = {(r["layer"], r["interval"]): r for r in rows}
    goals = []
    for interval, target in ((50, 0.95), (10, 0.80)):
        row = by.get(("trainguard-defaults", interval))
        if row:
            goals.append(common.Goal(f"trainguard defaults' goodput at one fault per {interval} steps",
                                     row["goodput"], target, "", higher_is_better=True))
    ahead = [by[("trainguard-defaults", n)]["goodput"] - max(by[(p, n)]["goodput"] for p in ("torchrun", "torchft")
                                                               if (p, n) in by)
             for n in intervals if ("trainguard-defaults", n) in by and any((p, n) in by for p in ("torchrun", "torchft"))]
    if ahead:
        goals.append(common.Goal("trainguard defaults' lead over the better peer, smallest over the intervals",
                                 round(min(ahead), 3), 0.0, "goodput", higher_is_better=True))
    ours = [r for r in rows if r["layer"].startswith("trainguard")]
    if ours:
        goals.append(common.Goal("trainguard runs whose final state is not bit-identical to the fault-free run's",
                                 sum(1 for r in ours if not r["identical"]), 0, "runs"))
    return goals


def _plot(result: dict, out: Path | None) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for layer in LAYERS:
        rows = sorted((r for r in result["rows"] if r["layer"] == layer), key=lambda r: r["interval"])
        if rows:
            ax.plot([r["interval"] for r in rows], [r["goodput"] for r in rows], marker="o", label=layer)
    ax.set_xlabel("steps between faults")
    ax.set_ylabel("goodput (fault-free time / wall time)")
    ax.set_ylim(0, max(1.05, *(r["goodput"] + 0.05 for r in result["rows"])))  # above 1: load fell mid-run
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"{result['steps']} steps, 2 ranks, CPU{' (quick)' if result['quick'] else ''}")
    path = (out or common.RESULTS / f"goodput{'-quick' if result['quick'] else ''}.json").with_suffix(".png")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
