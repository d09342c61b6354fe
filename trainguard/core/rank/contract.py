"""What an adapter supplies to the rank runtime, and what a Guard offers.

A framework's ``Guard`` is a :class:`~.runtime.RankRuntime`. The runtime
writes the loop once (:mod:`.runtime`); an adapter supplies the rest:

**Its abstract methods** (each documented on :class:`~.runtime.RankRuntime`):
``_begin`` and ``_commit`` (a step's body starts; it ended cleanly: finish
the update, count the step, then ``_after_commit``), ``_handle`` (the body
raised: report it, release the peers where the framework needs it, then
``_recover``), ``_reset_step``, ``_state_sha256`` and ``_connect_details``;
for the load at start (``_load``), ``_gather_steps`` and ``_gather_outcomes``
(its collectives), ``_load_memory`` and ``_load_stored`` (its state I/O).
Overridable with defaults: ``_fingerprints``, ``_final_extras``,
``_report_extras``, ``_snapshot_after_step``, ``_detach``,
``_close_snapshots`` and ``_exit``.

**Its collaborators**, set in its ``__init__`` before the first step:

===================  ==========================================================
``rank``,            this process's place in the job
``world_size``
``settings``         what the environment says, read once at the start
                     (:class:`~trainguard.core.config.RankConfig`)
``groups``           its replica groups (:class:`~trainguard.core.ReplicaGroup`)
``state``            the framework's state, with ``commit(step)``: what a
                     replica serves and a rollback returns to
``processor``        the rank's :class:`~trainguard.core.Processor` (from
                     ``_connect``)
``injector``         the :class:`~trainguard.core.FaultInjector`
``_handlers``        the framework's :class:`~trainguard.core.Handlers`: its
                     collectives on the abortable group, its state I/O
                     (repair, rollback, save, finalise)
``store``,           where checkpoints go and how often (``None``/0: none);
``save_every``       ``save()`` writes one
``snapshot_every``,  in-memory snapshots, every that many steps, in a ring
``snapshots``        (:class:`~trainguard.core.snapshot.SnapshotRing`;
                     ``None``: none), with ``take_snapshot(step)``
``sharing``          whose snapshots hold each replica's state
                     (:class:`~trainguard.core.snapshot.shared.Sharing`),
                     with ``snapshot_holder()`` naming this rank's holder
``resumed_from``     where ``_load`` found the state (``None``: nowhere)
``rehearsal``        a ``trainguard rehearse`` run's recorder, or ``None``
``compile_cache``    the framework's compile cache (``after_step``,
                     ``report``, ``close``)
``recorder``,        profiling (``None`` when off)
``_markers``
``_step``,           completed steps; whether the body ran inside
``_entered``,        ``protect``; when the step began; hooks that ``close``
``_step_started``,   removes (each with ``remove()``)
``_hooks``
``history``,         the job's history (:class:`~.history.JobHistory`)
``records``,
``pids``
===================  ==========================================================

:class:`Guard` is what every adapter's Guard offers a training script; the
contract tests (``tests/test_rank_contract.py``) run one suite against each.
Megatron driven through MindIO's TTP API has no loop object: its flow
(:mod:`trainguard.adapters.megatron.runtime`) uses the same processor,
recovery and history, and the contract's two-rank job tier holds it to the
same outcomes (a retry, a dump and its relaunch, bit-identical).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Iterable, Iterator, Protocol, runtime_checkable

__all__ = ["Guard", "StepBody"]


class StepBody(Protocol):
    """The step API: what ``with guard.protect():`` calls
    (:class:`~.history.Protected`), and what a loop trainguard does not own
    calls itself (see :class:`Guard`)."""

    def begin_step(self) -> int: ...

    def end_step(self) -> bool: ...

    def fail_step(self, error: BaseException) -> None: ...


@runtime_checkable
class Guard(Protocol):
    """A training loop under trainguard, whatever the framework::

        for step in guard.steps(total):
            with guard.protect():
                ...                      # one step: forward, backward, update
        guard.close()

    A loop trainguard does not drive (a framework's trainer) makes the same
    calls itself, which is all ``steps`` and ``protect`` do::

        while guard.step < total:
            guard.begin_step()           # carries out a stop asked for at the boundary
            try:
                ...                      # one step: batch, forward, backward, update
            except Exception as e:
                guard.fail_step(e)       # returns: run guard.step again; else raises
                continue
            guard.end_step()             # False: the commit failed and was recovered
    """

    rank: int
    world_size: int

    @property
    def step(self) -> int:
        """Completed steps."""

    def steps(self, total: int) -> Iterator[int]:
        """The completed steps, until ``total``; a recovered step comes again."""

    def protect(self) -> AbstractContextManager:
        """Around one step's body: a fault in it is recovered, not raised."""

    def begin_step(self) -> int:
        """Begin a step (a pending stop is carried out first); the step to run."""

    def end_step(self) -> bool:
        """Commit the step; ``False``: the commit failed, was recovered, run the step again."""

    def fail_step(self, error: BaseException) -> None:
        """Recover the step ``error`` left: returns to run :attr:`step` again, or raises."""

    def section(self, name: str) -> AbstractContextManager:
        """A stretch the hang checks do not count (evaluation, a save)."""

    def loader(self, iterable: Iterable) -> Iterator:
        """``iterable``, its fetches timed when profiling is on."""

    def loading(self) -> AbstractContextManager:
        """A fetch made by a function of the step, timed likewise."""

    def save(self) -> None:
        """Write a checkpoint of the current step."""

    def report(self) -> dict:
        """Steps, lost steps, PIDs per rank, recoveries, the state's hash."""

    def close(self, *, finished: bool = True) -> None:
        """Say goodbye to the controller and remove trainguard's hooks."""
