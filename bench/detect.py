"""Fault detection latency, and what the watchdog costs, vs plain torchrun.

Side by side in one run, on a small DDP MLP (``bench/_detect_worker.py``,
2 CPU ranks, gloo) whose steps are stretched to ~0.2 s by a sleep:

1. **trainguard** (``trainguard run --monitor-interval 0.1``, default
   settings, faults injected with ``TRAINGUARD_FAULT`` on rank 1 at step 4):

   * ``kill``: the rank SIGKILLs itself (``crash``); goal: found within 1 s;
   * ``stop``: the rank SIGSTOPs itself (a frozen host or container);
   * ``hang``: the rank's loop sleeps forever in Python;
   * ``stall``: the rank's collective is never sent: both ranks wait in the
     all-reduce, alive and heartbeating.

   Latency = the controller's ``detected_at`` in the job's recovery record
   (the dying-gasp checkpoint's manifest after a dump, the report after an
   in-place retry) minus the strike's time in the fault log
   (``<checkpoint_dir>/.trainguard/faults.jsonl``); both are wall clock on
   this one host. The bound for ``stop`` and ``hang`` is the watchdog's
   ``max(3 x median step, 2 s) + 0.25 s`` poll, with the median step time
   measured from rank 0's timeline before the fault. A collective that never
   completes is reported only past ``max(6 x median step, 2 s) + 0.25 s``
   (a peer may be in a benign pause of up to 5 steps, and a culprit that can
   still speak gets a poll's head start to name itself), checked every
   0.25 s, so ``stall`` is judged against ``max(6 x median step, 2 s) +
   0.5 s``. The bounds count from the last completed step; latency counts
   from the strike, a little later in the step. The full run repeats
   ``hang`` and ``stall`` with 1 s steps, where the learned limit
   (3 or 6 x the median step) rather than the 2 s floor sets the bound.
2. **torchrun**, what a user has without trainguard (``python -m
   torch.distributed.run --monitor-interval 0.1``, no trainguard imported;
   rank 1 strikes at the start of step 3 or 4 after writing the time):

   * ``kill``: torchrun's agent polls its workers every monitor interval and,
     seeing one dead, sends SIGTERM to the others. Latency = when the
     surviving rank's SIGTERM handler ran. Steps here sleep 1 s so that the
     survivor is asleep, not inside a collective, when the agent acts (in a
     collective it would fail on its own at once from the reset connection,
     which says nothing about the agent);
   * ``stop`` with ``init_process_group(timeout=T)`` for a short ``T``:
     nothing notices a frozen rank except the survivor's collective timing
     out. Latency = when the survivor's collective raised (the agent follows
     within its monitor interval); it comes out at ``T`` plus the survivor's
     step, which shows the mechanism. A hang in Python and a stuck
     collective wait on the same timeout. The benchmark then SIGKILLs the
     stopped rank itself (torchrun would wait 30 s more for its SIGTERM).
   * the **headline**: the backend's *default* timeouts -- gloo 1800 s, NCCL
     600 s -- are not waited for; the ``x_vs_gloo_1800s`` and
     ``x_vs_nccl_600s`` columns divide them by trainguard's measured
     latency for each hang case (``x_vs_torchrun`` divides torchrun's
     *measured* latency in this run, at the short ``T`` for hangs).
3. **watchdog cost**: launches with the watchdog on and off
   (``TRAINGUARD_WATCHDOG=off``), alternating, default heartbeat interval
   (1 s). Each rank reads the CPU time of every one of its threads
   (``/proc/self/task/TID/schedstat``) over a window of steady training
   (mostly the step's sleep, so the background threads are not hidden by
   contention) and reports it as a percentage of one core. trainguard's
   background threads are the Python ones (its processor thread and the two
   gRPC threads of its session, one of which runs the request loop that polls
   the watchdog every 0.25 s and sends the heartbeats) and gRPC's native
   ones; the goal is judged on all of them with the watchdog on (so it
   bounds the watchdog's own cost from above), on the worst rank. The
   watchdog's per-step work on the training thread (a GC callback, a clock
   read per step) is part of ``bench/overhead.py``'s per-step measure.

``--monitor-interval 0.1`` on both sides, as in ``bench/recovery.py`` and the
tests (it is also torchrun's default). The box is a shared 2-core machine:
latencies include scheduling noise.

usage: python bench/detect.py [--quick]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from _detect_launches import (CASES, FAULT_STEP, KILL_TARGET_S, NPROC, STEP_SLEEP,  # noqa: E402
                              LaunchFailed, cost_run, guard_case, torchrun_case)

COST_TARGET_PCT = 1.0
DEFAULT_TIMEOUT_S = {"gloo": 1800.0, "nccl": 600.0}
LABELS = {"kill": "kill (SIGKILL)", "stop": "stop (SIGSTOP)", "hang": "hang in Python",
          "stall": "stall (collective never completes)"}
HANG_CASES = ("stop", "hang", "stall")
#: The full run repeats hang and stall with steps this long, where the learned
#: limit (3 or 6 x the median step) rather than the 2 s floor sets the bound.
LONG_STEP_S = 1.0


def _retry(what: str, fn, failures: dict):
    for _ in range(3):  # a launch that fails outright is retried, and counted with its first line
        try:
            return fn()
        except LaunchFailed as e:
            text = str(e)
            failures.setdefault(what, []).append(text.splitlines()[0][:300])
            print(f"launch failed, retrying: {text[:300]}\n...\n{text[-1200:]}", file=sys.stderr)
    raise RuntimeError(f"{what} failed three times")


def _summary(runs: list[dict]) -> dict:
    d = [r["detect_s"] for r in runs]
    return {"runs": len(d), "median": statistics.median(d), "max": max(d),
            "step_s": statistics.median(r["step_s"] for r in runs),
            "bound": max(r.get("bound_s", 0.0) for r in runs)}


def main() -> dict:
    args = common.parser(__doc__.splitlines()[0]).parse_args()
    reps, base_reps, stop_reps, long_reps = (1, 1, 1, 0) if args.quick else (5, 5, 3, 3)
    short_timeout = 10.0 if args.quick else 15.0
    window_s, cost_pairs = (8.0, 1) if args.quick else (20.0, 2)
    variants = [(case, STEP_SLEEP, reps) for case in CASES] + [(c, LONG_STEP_S, long_reps) for c in ("hang", "stall")]
    runs: list[dict] = []
    cost: list[dict] = []
    failures: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        n = 0

        def fresh(name: str) -> Path:
            nonlocal n
            n += 1
            return Path(tmp) / f"{n:03d}-{name}"

        for rep in range(max(reps, base_reps, stop_reps, long_reps)):  # interleaved: each rep sees the same box
            for case, sleep, want in variants:
                if rep < want:
                    runs.append(_retry(f"trainguard {case}", lambda: guard_case(case, sleep, fresh(case)), failures))
                    print(runs[-1], file=sys.stderr)
            if rep < base_reps:
                runs.append(_retry("torchrun kill", lambda: torchrun_case("kill", fresh("tr-kill"), None), failures))
                print(runs[-1], file=sys.stderr)
            if rep < stop_reps:
                runs.append(_retry("torchrun stop", lambda: torchrun_case("stop", fresh("tr-stop"), short_timeout),
                                   failures))
                print(runs[-1], file=sys.stderr)
        for pair in range(cost_pairs):
            for watchdog in ((True, False) if pair % 2 == 0 else (False, True)):
                got = _retry("cost", lambda: cost_run(watchdog, window_s, fresh(f"cost-{watchdog}")), failures)
                cost.extend(got)
                print([{k: v for k, v in r.items() if k != "threads"} for r in got], file=sys.stderr)

    def pick(side: str, case: str, sleep: float | None = None) -> dict:
        return _summary([r for r in runs if r["side"] == side and r["case"] == case
                         and (sleep is None or r["step_sleep"] == sleep)])

    theirs = {c: pick("torchrun", c) for c in ("kill", "stop")}
    ours = {}
    rows = []
    for case, sleep, want in variants:
        if not want:
            continue
        s = ours[(case, sleep)] = pick("trainguard", case, sleep)
        label = LABELS[case] + ("" if sleep == STEP_SLEEP else f", {sleep:g} s steps")
        row = {"side": "trainguard", "case": label, "how": CASES[case][1], "runs": s["runs"], "step_s": s["step_s"],
               "median": s["median"], "max": s["max"], "unit": "s", "bound": s["bound"]}
        if case == "kill":
            row["x_vs_torchrun"] = theirs["kill"]["median"] / s["median"]
        else:
            row["x_vs_torchrun"] = theirs["stop"]["median"] / s["median"]
            row["x_vs_gloo_1800s"] = DEFAULT_TIMEOUT_S["gloo"] / s["median"]
            row["x_vs_nccl_600s"] = DEFAULT_TIMEOUT_S["nccl"] / s["median"]
        rows.append(row)
    rows.append({"side": "torchrun", "case": LABELS["kill"], "how": "its agent's monitor sees the exit",
                 "runs": theirs["kill"]["runs"], "step_s": theirs["kill"]["step_s"],
                 "median": theirs["kill"]["median"], "max": theirs["kill"]["max"], "unit": "s"})
    rows.append({"side": "torchrun", "case": f"stop, pg timeout={short_timeout:g} s",
                 "how": "the survivor's collective timing out", "runs": theirs["stop"]["runs"],
                 "step_s": theirs["stop"]["step_s"], "median": theirs["stop"]["median"], "max": theirs["stop"]["max"],
                 "unit": "s", "bound": short_timeout})
    for backend, timeout in DEFAULT_TIMEOUT_S.items():
        rows.append({"side": "torchrun", "case": f"any hang, {backend} default timeout",
                     "how": "collective timeout (not waited for)", "runs": 0, "median": timeout,
                     "max": timeout, "unit": "s"})

    def cost_stat(key: str, watchdog: bool) -> tuple[float, float]:
        v = [r[key] for r in cost if r["watchdog"] is watchdog]
        return statistics.median(v), max(v)

    n_cost = sum(1 for r in cost if r["watchdog"])
    for key, what in (("processor_pct", "processor Python threads"), ("grpc_pct", "gRPC native threads"),
                      ("trainguard_pct", "all trainguard background threads")):
        for watchdog in (True, False):
            med, worst = cost_stat(key, watchdog)
            rows.append({"side": "trainguard", "case": f"cost: {what}, watchdog {'on' if watchdog else 'off'}",
                         "how": "CPU per rank, steady training", "runs": n_cost, "median": med, "max": worst,
                         "unit": "% core", **({"bound": COST_TARGET_PCT} if key == "trainguard_pct" and watchdog
                                             else {})})
    on, off = cost_stat("trainguard_pct", True)[0], cost_stat("trainguard_pct", False)[0]
    rows.append({"side": "trainguard", "case": "cost: the watchdog alone (on - off, medians)",
                 "how": "difference of the two rows above", "runs": n_cost, "median": on - off, "unit": "% core"})

    hang = [s for (case, _), s in ours.items() if case in HANG_CASES]
    slowest = max(s["median"] for s in hang)
    worst = max(s["max"] for s in hang)
    headline = {
        "note": "backend default collective timeouts (not measured: the mechanism is shown by the torchrun "
                f"stop rows at timeout={short_timeout:g} s) divided by trainguard's measured hang detection "
                "(stop, hang, stall; every step length run)",
        "default_timeout_s": DEFAULT_TIMEOUT_S,
        "trainguard_hang_detect_s": {"slowest_case_median": slowest, "worst_run": worst},
        "ratio_vs_gloo_default": {"slowest_case_median": DEFAULT_TIMEOUT_S["gloo"] / slowest,
                                  "worst_run": DEFAULT_TIMEOUT_S["gloo"] / worst},
        "ratio_vs_nccl_default": {"slowest_case_median": DEFAULT_TIMEOUT_S["nccl"] / slowest,
                                  "worst_run": DEFAULT_TIMEOUT_S["nccl"] / worst},
        "torchrun_short_timeout_demo": {"timeout_s": short_timeout, "median_detect_s": theirs["stop"]["median"],
                                        "detect_over_timeout": theirs["stop"]["median"] / short_timeout},
        "kill_vs_torchrun_measured": theirs["kill"]["median"] / ours[("kill", STEP_SLEEP)]["median"],
    }
    goals = [common.Goal("kill: detection latency, worst run", round(ours[("kill", STEP_SLEEP)]["max"], 3),
                         KILL_TARGET_S, "s")]
    for (case, sleep), s in ours.items():
        if case in HANG_CASES:
            goals.append(common.Goal(f"{case}, {sleep:g} s steps: detection latency, worst run (target: the bound)",
                                     round(s["max"], 3),
                                     round(s["bound"], 3), "s"))
    goals.append(common.Goal("watchdog cost: trainguard background threads, watchdog on, worst rank",
                             round(cost_stat("trainguard_pct", True)[1], 3), COST_TARGET_PCT, "% of one core"))
    result = common.report(
        "detect", rows, ["side", "case", "how", "runs", "step_s", "median", "max", "unit", "bound", "x_vs_torchrun",
                         "x_vs_gloo_1800s", "x_vs_nccl_600s"], goals, quick=args.quick, out=args.out,
        extra={"nproc": NPROC, "step_sleep_s": STEP_SLEEP, "fault_step": FAULT_STEP, "monitor_interval_s": 0.1,
               "headline_vs_default_timeout": headline, "runs": runs, "watchdog_cost": cost,
               "cost_window_s": window_s, "launches_failed_and_retried": failures})
    print(f"\nheadline: trainguard found a hang within {slowest:.2f} s (slowest case, median; worst run "
          f"{worst:.2f} s): {DEFAULT_TIMEOUT_S['gloo'] / slowest:.0f}x sooner than gloo's default 1800 s "
          f"collective timeout, {DEFAULT_TIMEOUT_S['nccl'] / slowest:.0f}x sooner than NCCL's 600 s (plain "
          f"torchrun with timeout={short_timeout:g} s found it after {theirs['stop']['median']:.1f} s)")
    return result


if __name__ == "__main__":
    main()
