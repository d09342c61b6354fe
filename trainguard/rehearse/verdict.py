"""Judging a rehearsal case against the fault-free run (pure).

A case passes when every launch ended as planned -- each but the last with
a dying gasp (75), or with the failed resume the case injects; no steps
lost; no relaunch that trained steps again from an older save -- and the
run finished with every piece the Guard keeps equal to the fault-free
run's: on every rank the model, the optimizer, the learning rates, the
scheduler, the scaler, each extra, the random streams and the data
position. When not, the reason says what went wrong in words a user can act
on: the launch that ended otherwise and why (its log's first error), or the
first step at which the two runs part and the piece that parted first,
with the likely cause -- a piece given to the Guard that parted is
trainguard's bug to report; a piece the script did not give (a scaler or a
loader the Guard found in use, the learning rate without a scheduler, the
batch without ``data=``) is named with the argument to pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

__all__ = ["Verdict", "diagnose", "judge", "launch_problem"]

#: Fingerprint fields, in the order a cause is named when several part at
#: one step: random draws and the batch change everything after them; the
#: scaler, the schedule and extras change the update; the optimizer's state
#: and the model are what the others act on.
_ORDER = ("rng", "streams", "python", "numpy", "data", "scaler", "scheduler", "lr", "extra:", "buffers", "optimizer",
          "model")
_STREAMS = {"rng": "torch's random streams", "python": "Python's random stream", "numpy": "NumPy's random stream",
            "streams": "MindSpore's random streams (its generator and op seeds)"}
_BUG = "a piece the Guard restores parted: please report it to trainguard with this rehearsal's directory"


@dataclass(frozen=True)
class Verdict:
    identical: bool
    reason: str = ""


def judge(reference: Mapping[int, dict], final: Mapping[int, dict], traces: Mapping[int, Mapping[int, dict]],
          reference_traces: Mapping[int, Mapping[int, dict]], exits: list[int], *,
          launches: Mapping[int, Sequence[dict]] | None = None, planned_exits: Sequence[int] = (75,),
          errors: Sequence[str] = ()) -> Verdict:
    """Compare a case's final reports (by rank) with the fault-free run's.

    Args:
        exits: each launch's exit code.
        launches: per rank, each launch's start and last step
            (:func:`trainguard.core.rehearsal.read_launches`).
        planned_exits: the exit codes a launch but the last may end with.
        errors: each launch's first error line ("" when none), for reasons.
    """
    if not final:
        return Verdict(False, f"the job did not finish (exit codes {exits})")
    if set(final) != set(reference):
        return Verdict(False, f"ranks {sorted(set(reference) - set(final))} did not finish")
    problem = launch_problem(exits, launches or {}, final, planned_exits, errors)
    if problem:
        return Verdict(False, problem + _not_given(reference.get(0) or {}))
    for rank in sorted(reference):
        ref, got = reference[rank], final[rank]
        if ref["steps_completed"] != got["steps_completed"]:
            return Verdict(False, f"rank {rank} trained {got['steps_completed']} steps, not "
                                  f"{ref['steps_completed']}")
    skip = unseeded(reference_traces, traces)
    parted = [r for r in sorted(reference) if reference[r].get("final_state_sha256") !=
              final[r].get("final_state_sha256") or any(reference[r].get(f) != final[r].get(f)
                                                         for f in _fields(reference[r]) if f not in skip)]
    if not parted:
        return Verdict(True)
    return Verdict(False, diagnose(reference_traces, traces, parted, reference[0], skip=skip))


def launch_problem(exits: Sequence[int], launches: Mapping[int, Sequence[dict]], final: Mapping[int, dict],
                   planned_exits: Sequence[int] = (75,), errors: Sequence[str] = ()) -> str:
    """Why the launches did not go as planned ("" when they did): a launch
    but the last that ended otherwise than ``planned_exits``, lost steps,
    or a relaunch that started below where the launch before it got."""
    problems = []
    for i, rc in enumerate(exits[:-1]):
        if rc not in planned_exits:
            why = errors[i] if i < len(errors) and errors[i] else "see its log"
            problems.append(f"launch {i + 1} exited {rc} instead of stopping after a dying gasp (75): {why}")
            break
    redo = _redo(launches)
    if redo:
        problems.append(redo)
    lost = max((sum(max(0, r.get("lost_steps") or 0) for r in f.get("recoveries", [])) for f in final.values()),
               default=0)
    if lost and not redo:
        problems.append(f"{lost} step{'s' if lost != 1 else ''} lost (the recoveries' records say so)")
    return "; ".join(problems)


#: The argument to pass for state the Guard found in use but not given.
_PASS = {"scaler": "Guard(..., scaler=scaler)", "data": "your loader as Guard(..., data=loader)"}


def _not_given(final: Mapping) -> str:
    """State the Guard found in use but not given (the fault-free run's
    final report), as the likely cause of a launch that ended otherwise:
    a scaler not given keeps its per-optimizer stage through a retry."""
    found = final.get("undeclared") or {}
    return "".join(f"; likely cause: {found[k]} -- pass {_PASS[k]}" for k in ("scaler", "data") if k in found)


def _redo(launches: Mapping[int, Sequence[dict]]) -> str:
    """A relaunch that started below the step the launch before it reached."""
    if not launches or not all(launches.values()):
        return ""
    for k in range(1, min(len(v) for v in launches.values())):
        reached = max(v[k - 1]["last"] for v in launches.values())
        start = min(v[k]["start"] for v in launches.values())
        if start < reached:
            return (f"launch {k + 1} resumed from step {start}, but the one before it had reached step {reached}: "
                    f"{reached - start} steps trained again from an older checkpoint")
    return ""


def _fields(final: Mapping) -> list[str]:
    """The fingerprints a final report or a trace entry holds."""
    return [f for f in final if f in _STREAMS or f in ("data", "model", "buffers", "optimizer", "lr", "scheduler",
                                                         "scaler")
            or f.startswith("extra:")]


def unseeded(reference: Mapping[int, Mapping[int, dict]], case: Mapping[int, Mapping[int, dict]]) -> set[str]:
    """Streams that differ between the runs at their first traced step, before
    any fault: the script does not seed them (Python's and NumPy's often),
    so no two runs share them and they say nothing about a recovery."""
    out = set()
    for rank in set(reference) & set(case):
        common = sorted(set(reference[rank]) & set(case[rank]))
        if common:
            first = common[0]
            out |= {f for f in ("python", "numpy") if reference[rank][first].get(f) != case[rank][first].get(f)}
    return out


def _rank_key(field: str) -> int:
    return next(i for i, f in enumerate(_ORDER) if field == f or (f.endswith(":") and field.startswith(f)))


def diagnose(reference: Mapping[int, Mapping[int, dict]], case: Mapping[int, Mapping[int, dict]],
             ranks: list[int], final: Mapping | None = None, *, skip: set[str] | frozenset = frozenset()) -> str:
    """Why the runs parted: the first step, what parted there, the likely cause.

    Args:
        final: the fault-free run's final report of rank 0: what the script
            gave the Guard (``given``, ``data_given``) and what the Guard
            found in use but not given (``undeclared``).
        skip: streams the script does not seed.
    """
    final = final or {}
    first = None  # (step, rank, fields)
    for rank in sorted(set(reference) | set(case)):
        ref, got = reference.get(rank, {}), case.get(rank, {})
        for step in sorted(set(ref) & set(got)):
            fields = [f for f in _fields({**ref[step], **got[step]}) if f not in skip]
            diff = [f for f in fields if ref[step].get(f) != got[step].get(f)]
            if diff:
                if first is None or step < first[0]:
                    first = (step, rank, sorted(diff, key=_rank_key))
                break
    if first is None:
        return f"the final state of ranks {ranks} differs, though every traced step matched"
    step, rank, diff = first
    undeclared = final.get("undeclared") or {}
    given = set(final.get("given") or ())
    data_given = bool(final.get("data_given", "data" in given))
    streams = [f for f in diff if f in _STREAMS]
    at = f"at step {step} on rank {rank}"
    if streams:
        cause = (f"random streams not restored: rank {rank}'s {' and '.join(_STREAMS[f] for f in streams)} "
                 f"differed from step {step} on (dropout and other random draws then differ)")
        if "data" in undeclared:  # a new iterator of a loader not given draws its seed from torch's stream
            cause += f"; likely cause: {undeclared['data']} (a new iterator of it draws from the random stream)"
        return cause
    part = diff[0]
    if part == "data":
        return f"data position not restored: rank {rank}'s differed from step {step} on"
    if part == "scaler":
        if "scaler" in undeclared:
            return f"the GradScaler's state parted first {at}: {undeclared['scaler']} -- pass Guard(..., scaler=scaler)"
        return f"the GradScaler's state (scale, growth tracker, per-optimizer stage) parted first {at}: {_BUG}"
    if part == "scheduler":
        return f"the LR scheduler's state parted first {at}: {_BUG}"
    if part == "lr":
        if "scheduler" not in given:
            return (f"the learning rate parted first {at} with the same random streams and data position: an LR "
                    f"schedule the Guard was not given -- pass your scheduler as Guard(..., scheduler=sched)")
        return f"the learning rate parted first {at}, the scheduler given: {_BUG}"
    if part == "buffers":
        return (f"the buffers (BatchNorm's moving statistics, each rank's own) parted first {at} with the same "
                f"random streams: {_BUG}")
    if part.startswith("extra:"):
        return f"extra {part[6:]!r} parted first {at}: {_BUG}"
    if "data" in undeclared or not data_given:
        what = undeclared.get("data") or "the script gave the Guard no data position"
        return (f"the data position is not restored: the {part} parted {at} with the same random streams, so that "
                f"step read another batch ({what}) -- pass your loader's position to the Guard as data= "
                f"(or make each batch a function of the step)")
    kept = ", ".join(sorted(given)) or "none"
    return (f"the {part} parted {at} with every piece the Guard keeps equal before it (random streams, data "
            f"position; given: {kept}): a non-deterministic kernel, or state of your own the Guard is not given "
            f"(pass it as extra={{name: obj}}, anything with state_dict/load_state_dict)")
