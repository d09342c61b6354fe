"""``Guard``: protect a MindSpore training loop (PyNative mode; graph mode under ``Model.train``).

::

    init()                                        # mindspore.communication, launched by msrun
    guard = Guard(net, nn.Momentum(net.trainable_params(), 0.1, 0.9), checkpoint_dir="ckpt")
    grad_fn = ms.value_and_grad(nn.WithLossCell(net, loss_fn), None, guard.optimizer.parameters)
    for step in guard.steps(1000):                # resumes where the checkpoint left off
        with guard.protect():                     # a fault here is recovered, not raised
            loss, grads = grad_fn(*batch(step))
            guard.optimizer(grads)                # reduce gradients, check replicas, update
    guard.close()

The update is collective: every replica all-reduces a health flag before
it (see :mod:`.optimizer`), and all of them apply it or none does. In
PyNative mode the vote comes before the gradient all-reduce, so a rank that
fails in its forward or backward pass releases its peers with a vote of 0
alone ("drain"), and every replica leaves the step with its state at the
last completed step; the controller then repairs the failed rank from a
replica (``retry``) or has a healthy replica save it (``dump``). Once the
vote passed, the gradient all-reduce carries every replica's health flag
again, and the host reads it before it queues the update: a rank that fails
after the vote joins the all-reduce with a flag of 0, and again no replica
updates. A rank lost there leaves its peers to MindSpore's collective
timeout; their update was never queued, so they can save the step.
Launched with ``msrun`` after ``adapters-patch msrun`` or with ``trainguard
run --framework mindspore`` the guard reaches the job's controller;
otherwise it still checkpoints and resumes.

Graph mode (only for ``Model.train`` with ``TrainFaultTolerance``, which
passes ``compiled_step``): the train step is one compiled graph, with the
vote compiled into the wrapper (:meth:`OptTFTWrapper.compile_vote`). The
callback sets the health flag at the step's start and the Guard reads the
vote's outcome at its end; the update window is reported to the controller
only then (``start_update`` just before ``end_update``), since a running
graph cannot call Python. The drain replays the whole compiled step with a
health flag of 0 on the inputs of the step that failed. A fault can be
injected only where Python runs: ``forward`` at the step's start,
``optimizer`` at its end after an update; ``backward`` is refused.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Callable, Sequence

import mindspore as ms
from mindspore import nn, ops

from trainguard.core import (
    MINDSPORE,
    CheckpointStore,
    Classifier,
    ConfigError,
    FaultInjector,
    ForceStop,
    Processor,
    RankConfig,
    ReplicaGroup,
)
from trainguard.core import logs
from trainguard.core.compile_cache import resolve_root
from trainguard.core.rank import RankRuntime
from trainguard.core.preflight import check_checkpoint_dir
from trainguard.core.rehearsal import Rehearsal
from trainguard.core.profiling import recorder_from_env

from . import context
from .checkpoints import Checkpoints
from .collectives import (_COMPUTE, _IN_GRAPH, _REDUCING, _SETTLED, _UPDATING, STOP_WAIT_S, Collectives,
                          HealthCheckedReducer)
from .compile_cache import MindSporeCompileCache, key_parts
from .handlers import MindSporeHandlers
from .markers import MindSporeMarkers
from .optimizer import OptTFTWrapper
from .random_ops import kernel_random_ops
from .state import ModelState, stream_fingerprints
from .user_saves import StreamFiles

__all__ = ["Guard"]

log = logging.getLogger("trainguard.mindspore")

class Guard(Collectives, Checkpoints, RankRuntime):
    """Fault tolerance for one MindSpore training loop.

    Args:
        network: the model (an ``nn.Cell``).
        optimizer: an ``nn.Optimizer`` or an :class:`OptTFTWrapper` of one;
            use :attr:`optimizer` (the wrapper) in the loop.
        checkpoint_dir: where periodic and dying-gasp checkpoints go
            (MindSpore TFT's layout); the newest complete one is loaded at start.
        save_every: periodic checkpoint interval in steps (0: none).
        keep: complete checkpoints kept (0: all).
        snapshot_every: copy every parameter into shared memory every this
            many steps (0: never); saves then only wait for that copy (see
            :mod:`.checkpoints`).
        snapshots_in_memory: snapshot slots per rank.
        snapshot_shared: the data-parallel replicas on a machine share one
            snapshot of the parameters: the lowest copies them, the others
            only a header naming it (memory and copying per machine).
        steps_per_epoch: for ``epoch_num`` inside checkpoints (0: one epoch).
        reduce_gradients: all-reduce (mean) the gradients across the replicas
            in the wrapper, each replica's health flag with them; ``False``
            when something else does (the loop, before the wrapper): pass
            its reducer as ``reducer``, which a drain replays.
        reducer: the ``DistributedGradReducer`` whose mean and degree the
            Guard's own all-reduce follows (``Model``'s ``TrainOneStepCell``'s
            ``grad_reducer``); with ``reduce_gradients=False``, the loop's.
        replicas: this rank's replica groups (default: pure data parallel).
        processor, injector, classifier: collaborators, from the environment
            when omitted.
        compiled_step: graph mode only (given by ``TrainFaultTolerance``):
            ``compiled_step(inputs)`` runs the compiled train step on a
            batch, which the drain replays.
        profiling_dir: where profiling markers go (default
            ``TRAINGUARD_PROFILING_DIR``; unset: none); see the torch Guard.
        save_fn: writes the dying-gasp checkpoint instead of trainguard
            (``TrainFaultTolerance``'s ``ckpt_save_fn``): called with the
            step on the rank that saves, with the state at that step; its
            files are the user's to verify and resume from (nothing is
            renamed, as in MindSpore). Every rank's random streams go
            beside them into ``checkpoint_dir`` (:mod:`.user_saves`); without
            one the Guard warns that they cannot.
        save_fn_offset: steps trained before this Guard's step 0
            (``TrainFaultTolerance``'s starting position): the streams
            beside a ``save_fn``'s files are filed under this plus the step.
        compile_cache, compile_cache_key: where compiled graphs are kept
            for restarts (``MS_COMPILER_CACHE_PATH`` is set per rank; see
            the torch Guard and :mod:`.compile_cache`).

    Raises:
        ConfigError: graph mode without ``compiled_step`` (a hand-written
            loop), a ``backward`` fault to inject in graph mode (any rank's),
            a ``stall`` fault, a ``checkpoint_dir`` that cannot be written,
            or a ``reducer`` that is not a ``DistributedGradReducer`` for the
            Guard to reduce like.
    """

    def __init__(
        self,
        network: nn.Cell,
        optimizer: nn.Optimizer | OptTFTWrapper,
        *,
        checkpoint_dir: str | os.PathLike | None = None,
        save_every: int = 0,
        keep: int = 2,
        snapshot_every: int = 0,
        snapshots_in_memory: int = 2,
        snapshot_shared: bool = False,
        steps_per_epoch: int = 0,
        reduce_gradients: bool = True,
        reducer: nn.Cell | None = None,
        replicas: Sequence[ReplicaGroup] | None = None,
        processor: Processor | None = None,
        injector: FaultInjector | None = None,
        classifier: Classifier | None = None,
        compiled_step: Callable[[tuple], object] | None = None,
        save_fn: Callable[[int], None] | None = None,
        save_fn_offset: int = 0,
        profiling_dir: str | os.PathLike | None = None,
        compile_cache: str | os.PathLike | bool | None = None,
        compile_cache_key: dict | None = None,
    ) -> None:
        self._graph = ms.get_context("mode") != ms.PYNATIVE_MODE
        if self._graph and compiled_step is None:
            raise ConfigError("trainguard's MindSpore Guard needs PyNative mode (ms.set_context(mode="
                              "ms.PYNATIVE_MODE)) in a hand-written loop; in graph mode it protects Model.train "
                              "with TrainFaultTolerance")
        if save_every < 0 or (save_every and checkpoint_dir is None):
            raise ConfigError("save_every needs a checkpoint_dir and must be >= 0")
        self.rank, self.world_size = context.rank_and_size()
        logs.setup(f"rank {self.rank}")
        self.settings = RankConfig.from_env()
        self.rehearsal = Rehearsal.from_env(self.rank)
        if self.rehearsal is not None and checkpoint_dir is not None:
            checkpoint_dir = self.rehearsal.checkpoint_dir(checkpoint_dir)
        self.optimizer = optimizer if isinstance(optimizer, OptTFTWrapper) else OptTFTWrapper(optimizer)
        if self.optimizer.guard is not None:
            raise ConfigError("this optimizer wrapper already belongs to another Guard")
        self.network = network
        self.state = ModelState(network, self.optimizer.opt)
        self.kernel_random_ops = kernel_random_ops(network, graph=self._graph)
        if self.kernel_random_ops and self.rank == 0:
            log.warning("%s keep their random state inside MindSpore's kernels, which trainguard cannot save or set: "
                        "steps redone or resumed after a fault draw other numbers there than a run without the fault "
                        "would (the functional operators, ops.dropout, ops.randn..., draw from op seeds trainguard "
                        "keeps)", ", ".join(self.kernel_random_ops[:8]))
        cache_root = resolve_root(compile_cache, checkpoint_dir)  # before the first graph is compiled
        self.compile_cache = MindSporeCompileCache(cache_root, key_parts(
            network, network.get_parameters(), rank=self.rank, world_size=self.world_size, extra=compile_cache_key)
            if cache_root else {}, warn=self.rank == 0, owner=f"rank {self.rank}")
        self.groups = tuple(replicas) if replicas else (context.data_parallel_group(self.world_size),)
        # Checked alike on every rank before its first collective: none waits for a rank that refused.
        log_path = Path(checkpoint_dir) / ".trainguard" / "faults.jsonl" if checkpoint_dir is not None else \
            self.rehearsal.fault_log() if self.rehearsal is not None else None  # a fault strikes once per job
        self.injector = injector or FaultInjector(self.settings.faults, self.rank, world_size=self.world_size,
                                                  log_path=log_path)
        if self._graph:
            self.injector.refuse("a backward or reduce fault cannot be injected in graph mode: forward, backward and "
                                 "the update are one compiled graph (inject phase=forward or phase=optimizer)",
                                 phases=("backward", "reduce"))
        self.injector.refuse("the MindSpore Guard cannot black-hole a rank's collectives (inject hang or stop)",
                             kinds=("stall",))
        if checkpoint_dir is not None:
            check_checkpoint_dir(checkpoint_dir)
        self.store = CheckpointStore(checkpoint_dir, MINDSPORE, keep=keep) if checkpoint_dir is not None else None
        self.save_every, self.steps_per_epoch = save_every, steps_per_epoch
        self.classifier = classifier or context.classifier()
        self._allreduce = ops.AllReduce() if self.world_size > 1 else None
        self.reducer = reducer
        self._reduce = reduce_gradients and self.world_size > 1  # one process: its mean is its own
        #: The gradient all-reduce, carrying each replica's health flag (see :meth:`reduce`).
        self._checked = HealthCheckedReducer(self.optimizer.parameters, reducer, self.world_size) \
            if self._reduce else None
        self.records: list[dict] = []
        self.history: dict = {"records": [], "pids": {}}
        self._handlers = MindSporeHandlers(self)
        self._run_compiled = compiled_step
        self.save_fn, self.save_fn_offset = save_fn, save_fn_offset
        self.stream_files = StreamFiles(checkpoint_dir) if save_fn is not None and checkpoint_dir is not None \
            else None
        if save_fn is not None and checkpoint_dir is None and self.rank == 0:
            log.warning("ckpt_save_fn without ckpt_save_path: your function saves the parameters, but trainguard "
                        "has nowhere to write each rank's random streams, so a relaunch from your files goes on "
                        "from each process's seed, not bit-identical to a run without the fault (pass "
                        "ckpt_save_path too: the streams go to <ckpt_save_path>/.trainguard/streams/)")
        self._inputs: tuple = ()  # graph mode: the running step's batch, replayed by the drain
        self._step = 0
        self._phase = _COMPUTE
        self._updated = self._skipped = self._entered = False
        self.comm_broken = ""  # why this process must not run collectives any more
        self._in_collective = False  # for the hang watchdog: waiting on peers is not a hang of ours
        self._step_started = 0.0

        self._markers = None  # profiling, set up once the ranks agree on a start time
        ids = self.all_gather_ints([os.getpid(), context.host_id(), int(time.time())])
        self.pids = {r: ids[3 * r] for r in range(self.world_size)}
        #: Which ranks share a machine (a repair between them goes through shared memory).
        self.hosts = {r: ids[3 * r + 1] for r in range(self.world_size)}
        self.recorder = recorder_from_env(rank=self.rank, started_at=ids[2], directory=profiling_dir)
        self._markers = MindSporeMarkers(self.recorder, None if self._graph else network, lambda: self._step,
                                         context.world_group(), list(range(self.world_size))) if self.recorder else None
        self.setup_snapshots(snapshot_every, snapshots_in_memory, snapshot_shared)
        self.setup_own_records()
        self._step = self._load()
        self.state.commit(self._step)
        self.processor = processor or self._connect()
        # Graph mode: the compiled step holds the collectives; waiting in it for a peer is not a hang of ours.
        self.processor.watchdog.in_collective = lambda: self._in_collective or self._phase == _IN_GRAPH
        self._hooks = []
        if self._graph:
            self.optimizer.compile_vote(self.world_size)
        elif self.injector.wants("forward"):
            self._hooks.append(network.register_forward_pre_hook(
                lambda cell, inputs: self.injector.strike("forward", self._step)))
        self.optimizer.guard = self

    stops_at_step_boundary = False  # a stop is voted on inside the next update: every replica leaves one step
    launch_hint = ("launch with `trainguard run --framework mindspore`, or with msrun after `adapters-patch msrun` "
                   "and MS_ENABLE_TFT turning on TTP, UCE or ARF (e.g. MS_ENABLE_TFT='{TTP:1,UCE:1}'; without it a "
                   "patched msrun runs as before)")

    def _connect_details(self) -> dict:
        return {"device": ms.get_context("device_target").lower(), "device_repairable": True}

    # ----------------------------------------------------------- the loop
    def _begin(self) -> None:
        self._entered = True
        self._updated = self._skipped = False
        self._phase = _COMPUTE
        self._step_started = time.perf_counter()
        if self._markers is not None:
            self._markers.step_started()  # Model.train's callback: no iteration top of ours
        self.injector.strike("gc", self._step)  # a pause only: nothing raised in __enter__

    def _begin_compiled(self, inputs: tuple) -> None:
        """Graph mode, before the compiled step runs on ``inputs``: strike a
        ``forward`` fault, then set this rank's vote."""
        self._begin()
        self._inputs = inputs
        self.injector.strike("forward", self._step)
        self.optimizer.set_health(not self.processor.stop_event.is_set())
        self._phase = _IN_GRAPH

    def _end_compiled(self) -> None:
        """Graph mode, after the compiled step: take the vote's outcome,
        which :meth:`_commit` then commits (or skips)."""
        self._phase = _SETTLED
        if not self.optimizer.did_update():
            self._skipped = True
            return
        self._phase = _UPDATING
        self.updating(self._step + 1)
        self.processor.start_update()
        self.injector.strike("optimizer", self._step)
        self._updated = True

    def reduce(self, gradients):
        """Vote, then all-reduce ``gradients`` (when this Guard reduces) if
        every replica will update. Called by :meth:`update`, or first by
        ``Model.train``'s ``TrainOneStepCell`` in PyNative mode (the callback
        puts it in the cell's ``grad_reducer`` slot).

        The vote's host wait is for this rank's own backward pass. (Voting
        in a collective of its own after the all-reduce, as MindSpore's
        compiled wrapper does, made a PyNative step 14-60% slower on 2 CPU
        cores.) The gradient all-reduce carries each replica's health flag
        once more, one float in the same compiled all-reduce: a replica that
        fails between the vote and its all-reduce joins it with zeros and a
        flag of 0 (see :meth:`_drain`), and every replica skips the update.
        The host waits for the all-reduce before it queues the update, as
        queuing the update waited for it before."""
        self.injector.strike("backward", self._step)
        # The step drew its random numbers. Kept now: reading them waits for
        # the queued kernels, which must not include the gradient all-reduce
        # (a lost peer would hold this rank there, outside the collective's
        # care); the vote waits for this rank's backward pass anyway.
        self.updating(self._step + 1)
        if not self._vote(not self.processor.stop_event.is_set()):
            self._phase = _SETTLED
            self._skipped = True
            return gradients
        self._phase = _REDUCING
        self.injector.strike("reduce", self._step)
        if self._checked is not None:
            gradients, every = self._collective(lambda: self._checked(gradients, True), "gradient allreduce")
            if not every:  # a replica failed after the vote: no replica updates
                self._phase = _SETTLED
                self._skipped = True
        return gradients

    def update(self, gradients):
        """The wrapper's body: vote and reduce unless done, then update
        (called by :class:`OptTFTWrapper`)."""
        if self._phase == _COMPUTE:
            gradients = self.reduce(gradients)
        if self._skipped:
            return False
        self.processor.start_update()
        self._phase = _UPDATING
        result = self.optimizer.opt(gradients)
        self.injector.strike("optimizer", self._step)
        self._updated = True
        return result

    def _commit(self) -> None:
        if self._skipped:
            # A peer failed or was stopped: the controller's STOP follows its report.
            self.processor.stop_event.wait(STOP_WAIT_S)
            raise ForceStop("a replica could not finish this step")
        if not self._updated:
            raise ConfigError("the step ended without calling guard.optimizer(grads)")
        self.processor.end_update(self._step + 1)
        self._step += 1
        self._phase = _COMPUTE
        self.state.commit(self._step)
        if self.rehearsal is not None:  # each rank's own part (streams, BatchNorm statistics) is traced apart
            self.rehearsal.step(self._step, {"model": self.state.sha256(), "buffers": self.state.buffers_sha256(),
                                             **stream_fingerprints()})
        self._after_commit()

    def _reset_step(self) -> None:
        self._updated = self._skipped = False
        self._phase = _COMPUTE

    def _state_sha256(self) -> str:
        return self.state.sha256()

    def _report_extras(self) -> dict:
        return {"kernel_random_ops": list(self.kernel_random_ops)}  # streams no recovery sets back

    def _detach(self) -> None:
        if self._graph:
            self.optimizer.set_health(True)  # the vote stays compiled in: without a Guard every step updates
        self.optimizer.guard = None
        if self.own_records is not None:
            self.own_records.close()
            self.own_records = None

    def _exit(self, code: int) -> None:
        logs.exit_now(code)  # MindSpore's communicator may hold a peer's half collective
