"""The faults a rehearsal injects, as cases (pure: no processes here).

Each case is one run of the user's script in which one fault strikes (or,
for the last two, a fault and then a second one): device memory and
communication errors in the forward pass, the backward pass and the
update; a crash; a hang; a worker stopped or killed from outside at a
random moment; a fault while a rank resumes; a crash during a periodic
save; a second fault during a recovery. ``--quick`` keeps one case per
kind: the device memory error strikes inside the update (the phase where
state is half-written), the communication error in the backward pass.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

__all__ = ["Case", "plan_cases"]


@dataclass(frozen=True)
class Case:
    """One rehearsal case.

    Attributes:
        name: what strikes, in words ("uce in backward").
        kind: the fault kind the case stands for under ``--quick``.
        fault: ``TRAINGUARD_FAULT`` for its first launch (``None``: none injected).
        outside: a signal sent to a worker at a random moment of training.
        skip: why the case does not apply to this script (it then does not run).
        planned_exits: what a launch but the last may exit with: a dying
            gasp (75), and 1 where the case fails a resume on purpose.
    """

    name: str
    kind: str
    fault: str | None = None
    outside: int | None = None
    skip: str = ""
    planned_exits: tuple[int, ...] = (75,)

    @property
    def slug(self) -> str:
        return "".join(c if c.isalnum() else "-" for c in self.name).strip("-")


def plan_cases(world_size: int, steps: int, saved: list[int], *, quick: bool) -> list[Case]:
    """The cases for a job of ``world_size`` ranks that trains ``steps``
    steps and saves periodic checkpoints at the steps in ``saved``.

    Faults strike about a third of the way in, on the last rank (a rank
    that saves no shard of a data-parallel job: its own part is what a
    dying gasp must carry); a hang strikes rank 0.
    """
    at, rank = max(1, steps // 3), world_size - 1
    later = min(steps - 1, at + max(1, steps // 4))
    cases: list[Case] = []
    for kind, quick_phase in (("uce", "optimizer"), ("comm", "backward")):
        for phase in (quick_phase,) if quick else ("forward", "backward", "optimizer"):
            cases.append(Case(f"{kind} in {phase}", kind, f"{kind}:rank={rank},step={at},phase={phase}"))
    cases.append(Case("crash in forward", "crash", f"crash:rank={rank},step={at},phase=forward"))
    if not quick:
        cases.append(Case("crash in optimizer", "crash", f"crash:rank={rank},step={at},phase=optimizer"))
    cases.append(Case("hang in forward", "hang", f"hang:rank=0,step={at},phase=forward"))
    cases.append(Case("SIGSTOP from outside", "stop", outside=signal.SIGSTOP))
    cases.append(Case("kill -9 from outside", "kill", outside=signal.SIGKILL))
    # The rank struck first fails again while it loads its state: in the relaunch of the dump, or as its
    # replacement joins (a restart in place).
    cases.append(Case("crash while resuming", "resume", f"crash:rank={rank},step={at},phase=forward;"
                                                         f"crash:rank={rank},step={at},phase=resume",
                      planned_exits=(75, 1)))  # the relaunch whose resume fails stops every rank: exit 1
    save = next((s for s in sorted(saved) if 0 < s < steps), None)
    cases.append(Case("crash during a save", "save", f"crash:rank={rank},step={save},phase=save") if save else
                 Case("crash during a save", "save", skip="the script saves no periodic checkpoint before its "
                                                          "last step (Guard save_every)"))
    cases.append(Case("second fault during recovery", "recovery",
                      f"comm:rank={rank},step={later},phase=backward;crash:rank={0 if rank else rank},"
                      f"step={later},phase=recovery") if world_size > 1 else
                 Case("second fault during recovery", "recovery", skip="needs two ranks"))
    return cases
