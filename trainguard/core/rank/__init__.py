"""The rank side of trainguard, framework-free: the loop every adapter's
Guard runs (:mod:`.runtime`), what an adapter supplies to it
(:mod:`.contract`), the job's history as a rank knows it (:mod:`.history`)
and the agreement on where a starting job resumes (:mod:`.resume`)."""

from .contract import Guard, StepBody
from .history import JobHistory, Protected
from .runtime import RankRuntime

__all__ = ["Guard", "JobHistory", "Protected", "RankRuntime", "StepBody"]
