"""Judging a rehearsal case against the fault-free run (pure).

A case passes when its run finished -- after the relaunches a user would
make -- with every rank's model, optimizer, random streams and data
position equal to the fault-free run's. When not, the per-step traces say
why, in words a user can act on: the first step at which the two runs part
is found, and what parted first -- a rank's random streams, its data
position, or the model with both equal (a batch that is not restored: the
script's data position is not given to the Guard).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

__all__ = ["Verdict", "diagnose", "judge"]

_FIELDS = ("model", "rng", "python", "numpy", "data")
_STREAMS = {"rng": "torch's random streams", "python": "Python's random stream", "numpy": "NumPy's random stream"}


@dataclass(frozen=True)
class Verdict:
    identical: bool
    reason: str = ""


def judge(reference: Mapping[int, dict], final: Mapping[int, dict], traces: Mapping[int, Mapping[int, dict]],
          reference_traces: Mapping[int, Mapping[int, dict]], exits: list[int]) -> Verdict:
    """Compare a case's final reports (by rank) with the fault-free run's."""
    if not final:
        return Verdict(False, f"the job did not finish (exit codes {exits})")
    if set(final) != set(reference):
        return Verdict(False, f"ranks {sorted(set(reference) - set(final))} did not finish")
    for rank in sorted(reference):
        ref, got = reference[rank], final[rank]
        if ref["steps_completed"] != got["steps_completed"]:
            return Verdict(False, f"rank {rank} trained {got['steps_completed']} steps, not "
                                  f"{ref['steps_completed']}")
    fields = [f for f in _FIELDS if f not in unseeded(reference_traces, traces)]
    parted = [r for r in sorted(reference) if reference[r].get("final_state_sha256") !=
              final[r].get("final_state_sha256") or any(reference[r].get(f) != final[r].get(f)
                                                         for f in fields if f != "model")]
    if not parted:
        return Verdict(True)
    return Verdict(False, diagnose(reference_traces, traces, parted, bool(reference[0].get("data_given")), fields))


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


def diagnose(reference: Mapping[int, Mapping[int, dict]], case: Mapping[int, Mapping[int, dict]],
             ranks: list[int], data_given: bool, fields: tuple | list = _FIELDS) -> str:
    """Why the runs parted: the first step and what parted there."""
    first = None  # (step, rank, field)
    for rank in sorted(set(reference) | set(case)):
        ref, got = reference.get(rank, {}), case.get(rank, {})
        for step in sorted(set(ref) & set(got)):
            diff = [f for f in fields if ref[step].get(f) != got[step].get(f)]
            if diff:
                if first is None or step < first[0]:
                    first = (step, rank, diff)
                break
    if first is None:
        return f"the final state of ranks {ranks} differs, though every traced step matched"
    step, rank, diff = first
    streams = [f for f in diff if f in _STREAMS]
    if streams:
        return (f"random streams not restored: rank {rank}'s {' and '.join(_STREAMS[f] for f in streams)} "
                f"differed from step {step} on (dropout and other random draws then differ)")
    if "data" in diff:
        return f"data position not restored: rank {rank}'s differed from step {step} on"
    if not data_given:
        return (f"the data position is not restored: the model parted at step {step} with the same random "
                f"streams, so that step read another batch -- pass your loader's position to the Guard as data= "
                f"(or make each batch a function of the step)")
    return (f"the model parted at step {step} on rank {rank} with the same random streams and data position: "
            f"non-deterministic kernels, or state the Guard does not save (pass it as extra=)")
