"""The MindSpore Guard's collectives, and how a rank leaves a step that failed.

A mix-in of :class:`~trainguard.adapters.mindspore.guard.Guard` (it uses the
Guard's state): every collective of the Guard goes through
:meth:`Collectives._collective`, which marks the communicator unusable once
one failed (MindSpore cannot abort a collective cleanly); a rank that fails
in a step reports it, replays the collectives its peers wait in with a vote
of 0 (:meth:`Collectives._drain`), then carries out the controller's
recovery (:meth:`Collectives._handle`).
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from trainguard.core import ConfigError, DataStatus, report_left_step

from . import context

__all__ = ["CommunicationBroken", "Collectives", "HealthCheckedReducer"]

log = logging.getLogger("trainguard.mindspore")

# Where a rank is in its step, for the drain: which collectives its peers may wait in.
#: before the vote (peers may wait in it); after it, none left to replay;
#: the vote passed and the replicas reduce gradients; the update is queued.
_COMPUTE, _SETTLED, _REDUCING, _UPDATING = "compute", "settled", "reducing", "updating"
#: Graph mode: the compiled step runs; a failure there may have left any of its collectives half done.
_IN_GRAPH = "in graph"
#: How long a replica that skipped an update waits for the controller's STOP
#: before it reports the skip as a communication fault of its own.
STOP_WAIT_S = 30.0


def close_autograd() -> bool:
    """Close the gradient recording a PyNative step left open; True when
    one was open.

    An exception out of a forward pass under ``value_and_grad`` (or
    ``TrainOneStepCell``'s ``grad``) skips MindSpore's ``end_graph``: the
    executor's grad flag stays on, and every later operation of the process
    is recorded for a backward pass that never comes. The jit-compiled
    ``DistributedGradReducer`` is then built for a backward pass too
    (``grad_jit``): in the ResNet-50 example that held the GIL (and with it
    the heartbeats) for tens of seconds after a retry, while the peer's
    gradient all-reduce timed out. ``clear_res`` is how MindSpore itself
    recovers from an exception in a jit compile (``mindspore/graph/api.py``);
    it waits for the queued kernels first, which hold no collective a peer
    is not also running.
    """
    from mindspore.graph.api import _pynative_executor

    if not _pynative_executor.grad_flag():
        return False
    _pynative_executor.clear_res()
    return True


class HealthCheckedReducer:
    """The gradient all-reduce with each replica's health flag as one more
    tensor: a ``DistributedGradReducer`` over ``parameters`` and the flag,
    averaging (or summing) as ``like`` does (the reducer of ``Model``'s
    ``TrainOneStepCell``; default: the mean over ``world_size`` replicas).

    MindSpore's CPU all-reduce reduces each tensor of the tuple on its own
    (one ring per tensor), so the gradients are reduced exactly as without
    the flag.

    Raises:
        ConfigError: ``like`` is not a ``DistributedGradReducer``.
    """

    def __init__(self, parameters, like, world_size: int) -> None:
        if like is not None and not isinstance(like, nn.DistributedGradReducer):
            raise ConfigError(f"the Guard all-reduces gradients with a DistributedGradReducer that carries each "
                              f"replica's health; got a {type(like).__name__} (pass reduce_gradients=False and "
                              f"reduce in the loop, before guard.optimizer)")
        mean = True if like is None else bool(like.mean)
        scale = 1.0 / world_size if like is None else float(like.degree.asnumpy())  # the reducer's 1/degree
        flag = Parameter(Tensor(np.ones(1, np.float32)), name="trainguard_health_flag", requires_grad=False)
        self.cell = nn.DistributedGradReducer(list(parameters) + [flag], mean=mean,
                                              degree=round(1 / scale) if mean else world_size)
        # Every replica's 1 reduces to world_size x scale; one 0 to at most (world_size - 1) x scale.
        self.healthy_above = (world_size - 0.5) * (scale if mean else 1.0)

    def __call__(self, gradients, healthy: bool) -> tuple[tuple, bool]:
        """The reduced ``gradients``, and whether every replica was healthy
        (waits for the all-reduce)."""
        flag = Tensor(np.array([1.0 if healthy else 0.0], np.float32))
        out = self.cell(tuple(gradients) + (flag,))
        return tuple(out[:-1]), float(out[-1].asnumpy()[0]) > self.healthy_above


class CommunicationBroken(RuntimeError):
    """A collective failed or timed out: MindSpore's communicator may hold
    half a collective, so this process must not run another one."""


class Collectives:
    """The Guard's collectives and its way out of a failed step (a mix-in)."""

    def all_gather_ints(self, values: Sequence[int]) -> list[int]:
        """Every rank's ``values``, concatenated in rank order.

        Raises:
            ValueError: a value outside 32 bits: MindSpore 2.10's AllGather
                on CPU keeps only the low 32 bits of an int64 (seen here:
                2**62 + 12345 arrives as 12345), so a wider value would
                arrive wrong on every rank.
        """
        if any(not -2**31 <= v < 2**31 for v in values):
            raise ValueError(f"all_gather_ints carries 32-bit values: {[v for v in values if abs(v) >= 2**31][:4]}")
        mine = Tensor(np.asarray(values, np.int64))
        if self.world_size == 1:
            return [int(v) for v in values]
        return [int(v) for v in self._collective(lambda: ops.AllGather()(mine).asnumpy(), "allgather")]

    def _collective(self, fn, op: str = "collective"):
        """Run a collective; a failure means the communicator is no longer
        usable by this process (MindSpore cannot abort one cleanly)."""
        if self.comm_broken:
            raise CommunicationBroken(f"rank {self.rank}: {self.comm_broken}")
        self._in_collective = True
        try:
            if self._markers is not None:
                with self._markers.collective(op):
                    return fn()
            return fn()
        except RuntimeError as e:
            self.comm_broken = f"a collective failed ({context.brief(e)})"
            raise CommunicationBroken(f"rank {self.rank}: {self.comm_broken}") from e
        finally:
            self._in_collective = False

    def barrier(self) -> None:
        """Every rank reaches this point (one small all-reduce)."""
        self._vote(True)

    def _vote(self, healthy: bool) -> bool:
        """All-reduce the health flag: True when every replica may update."""
        if self.world_size == 1:
            return healthy
        flag = Tensor(np.array([1.0 if healthy else 0.0], np.float32))  # CPU AllReduce takes floats only
        total = self._collective(lambda: int(self._allreduce(flag).asnumpy()[0]), "vote")
        return total == self.world_size

    def _drain(self) -> None:
        """Release the peers of a rank that failed in a step: replay the
        collectives they wait in, with a flag of 0, so they skip the update."""
        if self.world_size == 1 or self.comm_broken:
            return
        phase = self._phase
        if phase == _UPDATING:  # the peers updated and went on into the next step
            phase = _COMPUTE
        if self._graph:
            if phase == _COMPUTE:  # the peers wait in the compiled step: run it, voting 0
                if not self._inputs:
                    raise CommunicationBroken(f"rank {self.rank}: no batch seen yet to replay the compiled step")
                self.optimizer.set_health(False)
                self._collective(lambda: self._run_compiled(self._inputs))
                self._phase = _SETTLED
                log.info("rank %d released its peers from step %d", self.rank, self._step + 1)
            return
        if phase == _REDUCING:
            # The peers agreed to update and wait in the gradient all-reduce:
            # join it with zeros and a health flag of 0, so they skip the
            # update (see Guard.reduce). With no all-reduce of the Guard's,
            # they updated and went on.
            if self._checked is not None:
                zeros = tuple(ops.zeros_like(p) for p in self.optimizer.parameters)
                self._collective(lambda: self._checked(zeros, False), "gradient allreduce")
            self._phase = _SETTLED
            log.info("rank %d released its peers from step %d", self.rank, self._step + 1)
            return
        if phase == _COMPUTE and not self._reduce and self.reducer is not None:
            # The loop reduces before the vote: the peers wait in that all-reduce first.
            zeros = tuple(ops.zeros_like(p) for p in self.optimizer.parameters)
            self._collective(lambda: self.reducer(zeros))
        self._vote(False)
        self._phase = _SETTLED
        log.info("rank %d released its peers from step %d", self.rank, self._step + 1)

    def _handle(self, error: BaseException) -> None:
        """Report why the step was left, release the peers, then carry out
        the controller's recovery."""
        if not self._graph and close_autograd():
            log.debug("rank %d: closed the gradient recording its step left open", self.rank)
        if not self.comm_broken and context.FAILED_COLLECTIVE.search(str(error)):
            self.comm_broken = f"a collective failed ({context.brief(error)[:300]})"
        phase = "optimizer" if self.processor.data is DataStatus.UPDATING else "step"
        if self._phase == _IN_GRAPH and not self.comm_broken:
            # Which of the graph's collectives ran is unknown: run none again (the controller dumps).
            self.comm_broken = f"the compiled step failed ({context.brief(error)[:300]})"
        own = report_left_step(self.processor, error, self.classifier, phase=phase,
                               cause=context.brief(error))  # logs it too
        if own:
            try:
                self._drain()
            except CommunicationBroken as e:
                log.error("rank %d could not release its peers: %s", self.rank, e)
        self._recover(error)
