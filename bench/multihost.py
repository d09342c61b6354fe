"""Host faults on three real hosts, trainguard beside plain torchrun.

Three hosts built from network namespaces on this machine
(``tests/netns.py``: a veth pair on a bridge and an address each; needs
root), one node agent per host, one rank per host, c10d rendezvous on host
0, gloo between the hosts' addresses. The same small DDP job (an MLP, Adam,
batches a function of (step, rank), each step 0.2 s longer) runs under

* **trainguard**: ``trainguard run`` with the job's Guard; the strategy per
  fault is in the table;
* **baseline**: plain ``torchrun --max-restarts 3``; rank 0 saves model and
  optimizer with ``torch.save`` every ``SAVE_EVERY`` steps and every rank
  loads the newest save when it starts.

Faults, 3 s after the first step (about step 15: half-way between two of
the baseline's saves) (the host struck is neither host
0, which serves the rendezvous store, nor the controller's):

* **host lost**: every process of the host SIGKILLed. trainguard: ``recover``
  with one spare slot per host (the lost rank starts on another host).
  Baseline: a replacement agent is started on the lost host's address at
  once (as a scheduler would), and torch restarts the group;
* **frozen host**: every process of the host SIGSTOPped; 15 s later the
  operator replaces the host (kills them, starts a new agent there).
  trainguard: ``dump`` then torch's restart of the group; baseline: gloo
  waits (its timeout is 30 min) until the host is replaced;
* **frozen host, recover**: the same fault, trainguard with ``recover`` and
  one spare slot per host: the frozen rank starts on another host and the
  frozen host is never replaced (its baseline is the frozen host's);
* **partition 10 s**: the host's link down for 10 s, then up. trainguard:
  ``dump``, and the group restarts when the host is back; baseline: gloo
  waits.
* **slow link**: the host's link limited to 2 Mbit/s both ways (``tc tbf``;
  this VM's kernel has no netem) for 20 s, once 40 of 120 steps are done,
  every profiling marker on (trainguard). *detected*: trainguard's log names
  the slowed host's rank (``slow node: ranks [...]``); the baseline names
  nothing. *regained*: the first step after the link is freed; final state
  against a fault-free 120-step run.

Measured from every rank's own log of completed steps: *detected*: the
fault's record (trainguard), or the first new worker process after the
fault (baseline: torchrun notices nothing else); *regained*: the first step
past the newest step done before the fault; *lost steps*: steps done before
the fault that were done again; *final ok*: the final model + optimizer
state equals a fault-free run of the same launcher.

usage: python bench/multihost.py [--quick] [--only FAULT] [--keep DIR]
(--quick: the host-lost fault only)
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
STEPS = 40
SAVE_EVERY = 10
STEP_SLEEP = 0.2
REPLACE_FROZEN_AFTER_S = 15.0
SLOW_STEPS, SLOW_AFTER_STEP, SLOW_FOR_S, SLOW_RATE = 120, 40, 20.0, "2mbit"
ALL_ON = '{"CommunicationOperator":"on","Step":"on","SaveCheckpoint":"on","FP":"on","DataLoader":"on"}'
STRIKE_AFTER_S = 3.0  # after the first step: ~step 15, half-way between two of the baseline's saves
LIMIT_S = 240.0


# ------------------------------------------------------------------ the worker
def batch(step: int, rank: int):
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 32, generator=g)
    return x, (x.sum(dim=1, keepdim=True) > 0).float()


def state_sha256(model, opt) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().numpy().tobytes())
    for i, s in sorted(opt.state_dict()["state"].items()):
        for k, v in sorted(s.items()):
            h.update(f"{i}.{k}".encode())
            h.update(v.detach().contiguous().numpy().tobytes() if hasattr(v, "numpy") else repr(v).encode())
    return h.hexdigest()


def worker(out: Path, mode: str) -> None:
    """One rank: logs ``{"t", "step", "pid"}`` per completed step (step -1: started)."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    steps = int(os.environ.get("BENCH_STEPS", STEPS))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    progress = open(out / f"progress.r{rank}.jsonl", "a", buffering=1)

    def note(step: int) -> None:
        progress.write(json.dumps({"t": time.time(), "step": step, "pid": os.getpid()}) + "\n")

    note(-1)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    model = DDP(net, bucket_cap_mb=0.01)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)

    def train(step: int, optimizer) -> None:
        time.sleep(STEP_SLEEP)
        x, y = batch(step, rank)
        loss = F.binary_cross_entropy_with_logits(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    if mode == "trainguard":
        from trainguard.torch import Guard

        guard = Guard(model, opt, checkpoint_dir=str(out / "ckpt"))
        for step in guard.steps(steps):
            with guard.protect():
                train(step, guard.optimizer)
            note(step + 1)
        report = guard.report()
        final, records = report["final_state_sha256"], report["recoveries"]
        guard.close()
    else:
        start, ckpt = 0, out / "ckpt.pt"
        if ckpt.exists():
            saved = torch.load(ckpt, weights_only=True)
            net.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            start = saved["step"]
        for step in range(start, steps):
            train(step, opt)
            note(step + 1)
            if (step + 1) % SAVE_EVERY == 0 and rank == 0:
                torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "step": step + 1}, out / "ckpt.tmp")
                os.replace(out / "ckpt.tmp", ckpt)
        final, records = state_sha256(net, opt), []
    if rank == 0:
        (out / "final.json").write_text(json.dumps({"final_state_sha256": final, "recoveries": records}))
    dist.destroy_process_group()


# ------------------------------------------------------------------ the runs
def progress(out: Path) -> list[dict]:
    lines = []
    for p in out.glob("progress.r*.jsonl"):
        rank = int(p.name.split(".")[1][1:])
        lines += [{**json.loads(x), "rank": rank} for x in p.read_text().splitlines() if x.strip()]
    return sorted(lines, key=lambda x: x["t"])


def run(tm, netns, tmp: Path, mode: str, fault: str | None, steps: int = STEPS) -> dict:
    """One job on three fresh hosts; returns its row."""
    name = f"{mode}-{fault or 'none'}-{steps}".replace(" ", "-").replace(",", "")
    out = tmp / name
    out.mkdir(parents=True)
    plain = mode == "baseline"
    recover = fault in ("host lost", "frozen host, recover")
    strategies = "recover,dump" if recover else "dump"
    env = {"OMP_NUM_THREADS": "1", "BENCH_STEPS": str(steps)}
    if fault == "slow link" and not plain:
        (out / "prof").mkdir()
        (out / "prof" / "profilingSwitch").write_text(ALL_ON)
        env["TRAINGUARD_PROFILING_DIR"] = str(out / "prof")
    kw = dict(strategies=strategies, spare=1 if recover else 0, max_restarts=3, plain=plain,
              script=Path(__file__), script_args=["--worker", str(out), "trainguard" if not plain else "plain"],
              env_extra=env)
    row = {"fault": fault or "none", "mode": mode, "strategy": None if plain else strategies}
    with netns.Hosts(3) as hosts:
        job = tm.start_job(hosts, out, name, **kw)
        strike, victim, skip = None, None, ()
        if fault:
            job.wait_for("ranks registered" if not plain else "", timeout=120)
            deadline = time.time() + 120
            first = 1 if fault != "slow link" else SLOW_AFTER_STEP
            while not any(x["step"] >= first for x in progress(out)) and time.time() < deadline:
                time.sleep(0.02)
            if fault != "slow link":
                time.sleep(STRIKE_AFTER_S)
            victim = tm.victim_of(job) if not plain else 2
            strike = time.time()
            if fault == "frozen host, recover":
                hosts.freeze_host(victim)
                skip = (victim,)  # stays frozen until the others are done
            elif fault in ("host lost", "frozen host"):
                if fault == "frozen host":
                    hosts.freeze_host(victim)
                    time.sleep(REPLACE_FROZEN_AFTER_S)
                hosts.kill_host(victim)
                job.agents[victim].wait(timeout=30)
                if plain:
                    # torch 2.13's c10d rendezvous cannot take a replacement node into a later round (it
                    # reads MASTER_ADDR from that round, which node 0 publishes only in its first): the
                    # whole job is relaunched (by its scheduler) and resumes from its last torch.save.
                    for i in range(hosts.n):
                        hosts.kill_host(i)
                        job.agents[i].wait(timeout=30)
                    (out / "agents-before-relaunch.log").write_text(
                        "".join(f"===== host {i} =====\n{job.log(i)}" for i in range(hosts.n)))
                    job = tm.start_job(hosts, out, name, **kw)
                elif fault == "frozen host":  # the host replaced: a new agent in the lost one's place
                    new = tm.start_job(hosts, out, name, only=victim, **kw)
                    job.agents[victim], job.logs[victim] = new.agents[0], new.logs[0]
            elif fault == "partition 10 s":
                hosts.link_down(victim)
                time.sleep(10)
                hosts.link_up(victim)
            elif fault == "slow link":
                hosts.rate_limit(victim, SLOW_RATE)
                until = time.time() + SLOW_FOR_S
                while time.time() < until and "named_at" not in row:
                    if job.seen("slow node: ranks ["):
                        row["named_at"] = time.time()
                    time.sleep(0.05)
                time.sleep(max(0.0, until - time.time()))
                hosts.unlimit(victim)
                row["freed_at"] = time.time()
        try:
            try:
                tm.finish(job, timeout=LIMIT_S, skip=skip)
            finally:
                (out / "agents.log").write_text(
                    "".join(f"===== host {i} =====\n{job.log(i)}" for i in range(hosts.n)))
            row["exit_codes"] = job.codes
        except BaseException as e:  # pytest.fail: a run past its limit
            row["exit_codes"] = f"did not finish within {LIMIT_S:.0f} s ({type(e).__name__})"
        final = out / "final.json"
        result = json.loads(final.read_text()) if final.exists() else {}
        row["final_state_sha256"] = result.get("final_state_sha256")
        lines = progress(out)
        if fault == "slow link":
            named, freed = row.pop("named_at", None), row.pop("freed_at")
            line = next((x for i in range(hosts.n) for x in job.log(i).splitlines() if "slow node: ranks [" in x), "")
            row["detected_s"] = None if named is None else round(named - strike, 2)
            row["how"] = ("named " + line.split("slow node: ")[1].split(":")[0] + f" (host {victim}'s)"
                          if line else "nothing noticed")
            row["regained_s"] = round(min((x["t"] for x in lines if x["t"] >= freed), default=freed) - strike, 2)
            row["step_s_before_during"] = [_median_step(lines, strike - 5, strike), _median_step(lines, strike, freed)]
            row["lost_steps"], row["step_at_fault"], row["victim_host"] = 0, None, victim
            return row
        if strike is not None:
            before = [x for x in lines if x["t"] < strike and x["step"] >= 0]
            after = [x for x in lines if x["t"] >= strike and x["step"] >= 0]
            done = max((x["step"] for x in before), default=0)
            resumed = min((x["step"] for x in after), default=None)
            regained = next((x["t"] for x in after if x["step"] > done), None)
            if plain:
                pids = {x["pid"] for x in lines if x["t"] < strike}
                new = next((x["t"] for x in lines if x["t"] >= strike and x["pid"] not in pids), None)
                row["detected_s"] = None if new is None else round(new - strike, 2)
                row["how"] = ("job relaunched by its scheduler" if fault in ("host lost", "frozen host") else
                              "worker restarted" if new else "nothing noticed")
            else:
                recs = result.get("recoveries") or []  # a run resumed after a dump carries the history
                row["detected_s"] = round(recs[0]["detected_at"] - strike, 2) if recs else None
                row["how"] = f"{recs[0]['fault']} -> {recs[0]['strategy']}" if recs else "nothing noticed"
            row["regained_s"] = None if regained is None else round(regained - strike, 2)
            row["lost_steps"] = None if resumed is None else max(0, done - (resumed - 1))
            row["step_at_fault"] = done
            row["victim_host"] = victim
    return row


def _median_step(lines: list[dict], t0: float, t1: float) -> float | None:
    """Rank 0's median step time between ``t0`` and ``t1``."""
    ts = [x["t"] for x in lines if x["rank"] == 0 and t0 <= x["t"] <= t1 and x["step"] >= 1]
    gaps = sorted(b - a for a, b in zip(ts, ts[1:]))
    return round(gaps[len(gaps) // 2], 3) if gaps else None


def main() -> int:
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent / "tests"))
    import tempfile

    import common
    import netns
    import multihost_jobs as tm

    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--keep", type=Path, default=None, help="run in this directory and keep the jobs' files")
    p.add_argument("--only", default=None, help="run just this fault (and the fault-free runs)")
    args = p.parse_args()
    reason = netns.why_not()
    if reason:
        print(f"multihost: {reason}", file=sys.stderr)
        return 1
    faults = ["host lost"] if args.quick else ["host lost", "frozen host", "frozen host, recover", "partition 10 s",
                                               "slow link"]
    faults = [args.only] if args.only else faults
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-multihost-") as d:
        tmp = args.keep or Path(d)
        clean = {(m, STEPS): run(tm, netns, tmp, m, None) for m in ("baseline", "trainguard")}
        if "slow link" in faults:
            clean.update({(m, SLOW_STEPS): run(tm, netns, tmp, m, None, SLOW_STEPS) for m in ("baseline", "trainguard")})
        for fault in faults:
            steps = SLOW_STEPS if fault == "slow link" else STEPS
            # The frozen host's baseline under recover is the frozen host's (nothing there differs).
            for mode in ("trainguard",) if fault == "frozen host, recover" else ("baseline", "trainguard"):
                row = run(tm, netns, tmp, mode, fault, steps)
                row["final_ok"] = (row["final_state_sha256"] is not None
                                   and row["final_state_sha256"] == clean[(mode, steps)]["final_state_sha256"])
                rows.append(row)
                print({k: v for k, v in row.items() if k != "final_state_sha256"}, file=sys.stderr, flush=True)
    ours = [r for r in rows if r["mode"] == "trainguard"]
    detected = [r["detected_s"] for r in ours if r.get("detected_s") is not None and r["fault"] != "slow link"]
    named = [r for r in ours if r["fault"] == "slow link" and r["how"].startswith("named ranks [")]
    goals = [
        common.Goal("host faults trainguard detected (of those run)", len(detected),
                    len([r for r in ours if r["fault"] != "slow link"]), "faults", higher_is_better=True),
        *([common.Goal("slow links named by their host", len(named), 1, "links", higher_is_better=True)]
          if "slow link" in faults else []),
        common.Goal("slowest trainguard detection of a host fault", max(detected) if detected else None, 10.0, "s"),
        common.Goal("steps lost by trainguard, all host faults", sum(r.get("lost_steps") or 0 for r in ours)
                    if all(r.get("lost_steps") is not None for r in ours) else None, 0, "steps"),
        common.Goal("trainguard runs ending bit-identical to a fault-free run", sum(bool(r.get("final_ok"))
                    for r in ours), len(ours), "runs", higher_is_better=True),
    ]
    columns = ["fault", "mode", "how", "detected_s", "regained_s", "lost_steps", "final_ok", "exit_codes",
               "step_s_before_during"]
    common.report("multihost", [{k: v for k, v in r.items() if k != "final_state_sha256"} for r in rows], columns,
                  goals, quick=args.quick, out=args.out, extra={
                      "hosts": 3, "ranks_per_host": 1, "steps": STEPS, "baseline_save_every": SAVE_EVERY,
                      "step_sleep_s": STEP_SLEEP, "replace_frozen_after_s": REPLACE_FROZEN_AFTER_S,
                      "strike_after_first_step_s": STRIKE_AFTER_S, "slow_link": {
                          "steps": SLOW_STEPS, "after_step": SLOW_AFTER_STEP, "for_s": SLOW_FOR_S, "rate": SLOW_RATE,
                          "qdisc": "tbf"}})
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]), sys.argv[3])
    else:
        sys.exit(main())
