"""trainguard for Lightning: a DDP strategy that owns the Guard.

::

    from trainguard.integrations.lightning import GuardedDDPStrategy

    trainer = L.Trainer(strategy=GuardedDDPStrategy(guard_options={"save_every": 100}), max_steps=...)
    trainer.fit(model, train_dataloaders=loader)

:class:`GuardedDDPStrategy` is Lightning's ``DDPStrategy`` that builds the
torch :class:`~trainguard.torch.Guard` once the model is wrapped and the
optimizer made, and runs each training batch as a Guard step: it begins at
the top of the batch (before Lightning's per-batch SIGTERM ``broadcast``,
a collective on the default group) and is committed at
``on_train_batch_end``. ``optimizer_step`` hands the optimizer the
closure (forward and backward), which the Guard's wrapper runs before the
update is reported started; a fault in the closure or in the update is
retried right there with the same batch -- ``trainer.fit()`` goes on. A
dying gasp's relaunch sets Lightning's progress (epoch, batch, global step)
to the Guard's step, and the training loader -- wrapped in
:class:`~trainguard.torch.ResumableLoader` -- starts at the batch after it
(Lightning's fetcher prefetches a batch, so the position kept is the
batches Lightning has trained on, not fetched).

No new process joins a running Lightning job (``fit``'s setup runs
collectives of its own the running ranks do not take part in): a lost rank
is dumped, and under ``trainguard run``'s restart budget the launcher
restarts the whole group, which resumes from the dump.

One optimizer, automatic optimization, ``accumulate_grad_batches=1``
(one batch is one step), one training ``DataLoader`` (its position is
kept); other setups are refused before step 0. Tied to
Lightning 2.6's loop internals (the training epoch loop's
``_broadcast_sigterm_tensor`` and progress counters); the ``[lightning]``
extra pins the tested range.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from lightning.pytorch import Callback
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.connectors.data_connector import _parse_num_batches
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from torch.utils.data import DataLoader

from trainguard.core import ConfigError, RecoveryError
from trainguard.torch import Guard, ResumableLoader

__all__ = ["GuardedDDPStrategy"]

log = logging.getLogger("trainguard.integrations")


class _Position:
    """The data position the Guard keeps: the training loader's, with the
    batches Lightning trained on in the epoch (the fetcher is one ahead).
    Loaded at the start (a resume), it waits for the loader; loaded during
    training (a retry, which reuses the batch in hand) it changes nothing."""

    def __init__(self, strategy: "GuardedDDPStrategy") -> None:
        self.strategy = strategy
        self.loader: ResumableLoader | None = None
        self.pending: dict | None = None
        self.training = False

    def state_dict(self) -> dict:
        if self.loader is None:
            return {"loader": None}
        state = self.loader.state_dict()
        trainer = self.strategy.lightning_module.trainer
        # started, not processed: the Guard also records the position inside the update (for a rank lost
        # later), where the batch in hand is started but not yet processed
        done = trainer.fit_loop.epoch_loop.batch_progress.current.started
        if state["started"]:
            state["batches"], state["finished"] = done, done >= len(self.loader)
        return {"loader": state}

    def load_state_dict(self, state: dict) -> None:
        if self.training or state.get("loader") is None:
            return
        self.pending = state["loader"]
        if self.loader is not None:
            self.loader.load_state_dict(self.pending)


class _LightningGuard(Guard):
    """The torch Guard, telling the controller that no process can join (a
    new one would wait for good in ``fit``'s setup collectives: seen hanging
    the job under the defaults), so recover-in-place hands over to the dump."""

    def _connect_details(self) -> dict:
        return {**super()._connect_details(), "join_refused": JOIN_REFUSED}


JOIN_REFUSED = ("a new process cannot join a running Lightning job (fit's setup runs collectives the running "
                "ranks do not take part in)")


class _Commit(Callback):
    def __init__(self, strategy: "GuardedDDPStrategy") -> None:
        self.strategy = strategy

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.strategy._end_step()


class GuardedDDPStrategy(DDPStrategy):
    """Lightning's DDP strategy, protected by trainguard.

    Args:
        guard_options: keyword arguments of :class:`trainguard.torch.Guard`
            (``checkpoint_dir``, default ``<default_root_dir>/trainguard``;
            ``save_every``, ...).
        kwargs: ``DDPStrategy``'s.

    Attributes:
        guard: the Guard, from the start of ``fit``.
        guard_report: ``guard.report()`` when ``fit`` ended.
    """

    strategy_name = "ddp_trainguard"

    def __init__(self, guard_options: dict | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.guard_options = dict(guard_options or {})
        for taken in ("data", "scheduler", "extra"):
            if taken in self.guard_options:
                raise ConfigError(f"guard_options: {taken} is the strategy's (the fit loop's own)")
        self.guard: Guard | None = None
        self.guard_report: dict | None = None
        self._position = _Position(self)
        self._in_step = False
        self._left = False
        self._resume_at = 0
        self._skipping: list[tuple[Any, Any]] = []  # schedulers whose step is skipped (_taken_over)
        self._broadcast: Callable[[], None] | None = None  # Lightning's SIGTERM broadcast

    # ------------------------------------------------------------ setup
    def setup(self, trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        if self.guard is not None:
            raise ConfigError("a GuardedDDPStrategy fits once (its Guard belongs to one run of the loop)")
        module = self.lightning_module
        if not module.automatic_optimization or len(self.optimizers) != 1:
            raise ConfigError("GuardedDDPStrategy protects automatic optimization with one optimizer")
        if trainer.accumulate_grad_batches != 1:
            raise ConfigError("GuardedDDPStrategy: put gradient accumulation inside training_step "
                              "(accumulate_grad_batches=1: one batch is one step)")
        configs = trainer.lr_scheduler_configs
        scheduler = configs[0].scheduler if configs else None
        options = {"checkpoint_dir": f"{trainer.default_root_dir}/trainguard", **self.guard_options}
        self.guard = _LightningGuard(self.model, self.optimizers[0], scheduler=scheduler, data=self._position, **options)
        self.optimizers = [self.guard.optimizer]  # Lightning's optimizer_step now goes through the wrapper
        trainer.callbacks.append(_Commit(self))
        loop = trainer.fit_loop.epoch_loop
        loop._broadcast_sigterm_tensor = self._begin_around(loop._broadcast_sigterm_tensor)
        self._resume_at = self.guard.step  # Lightning's counters are set once the loader is processed

    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        trainer = self.lightning_module.trainer
        if not trainer.training:
            return dataloader
        if not isinstance(dataloader, DataLoader) or self._position.loader is not None:
            # a position the Guard does not keep: a relaunch or a rollback would train on other batches
            raise ConfigError(f"GuardedDDPStrategy keeps the position of one training loader, a torch DataLoader "
                              f"given to fit once (no reload_dataloaders_every_n_epochs); got "
                              f"{'a second one' if self._position.loader is not None else type(dataloader).__name__}")
        if dataloader.generator is None:  # seeded without a draw: a resumed run makes it after its streams are back
            dataloader.generator = torch.Generator().manual_seed(torch.initial_seed() % 2**63)
        self._position.loader = ResumableLoader(dataloader)
        if self._position.pending is not None:
            self._position.loader.load_state_dict(self._position.pending)
        if self._resume_at:
            self._resume_progress(trainer, self._resume_at, len(dataloader))
        return self._position.loader

    def _resume_progress(self, trainer, step: int, length: int) -> None:
        """Lightning's counters at the Guard's ``step``: epoch, batch in it,
        global step. ``length``: the training loader's batches on this rank,
        as Lightning processed it (its ``DistributedSampler`` in place; the
        loader given to ``fit`` counts every rank's); an epoch ends at
        ``limit_train_batches`` as Lightning's does."""
        per_epoch = _parse_num_batches(RunningStage.TRAINING, length, trainer.limit_train_batches)
        if not per_epoch:
            raise ConfigError("GuardedDDPStrategy needs a training loader with batches to resume mid-run")
        epoch, done = divmod(step, int(per_epoch))
        fit = trainer.fit_loop
        fit.epoch_progress.increment_by(epoch)
        loop = fit.epoch_loop
        loop.batch_progress.increment_by(done)
        loop.batch_progress.total.ready = loop.batch_progress.total.started = step
        loop.batch_progress.total.processed = loop.batch_progress.total.completed = step
        loop.automatic_optimization.optim_progress.optimizer.step.increment_by(step)
        loop.automatic_optimization.optim_progress.optimizer.zero_grad.increment_by(step)
        loop._batches_that_stepped = step
        if done:
            loop.restarting = True  # keep the batch counter of the epoch at its start
        log.info("rank %d: Lightning goes on at epoch %d, batch %d (step %d)", self.global_rank, epoch, done, step)

    # ------------------------------------------------------------ the step
    def _begin_around(self, broadcast: Callable[[], None]) -> Callable[[], None]:
        self._broadcast = broadcast

        def begin_then_broadcast() -> None:
            while True:
                self._begin()
                try:
                    return broadcast()
                except Exception as error:  # a STOP released it: nothing of the step was taken yet (Lightning
                    self._fail(error)           # 2.6 ignores the broadcast's errors itself: see _sigterm_broadcast)
        return begin_then_broadcast

    def _begin(self) -> None:
        if not self._in_step:
            self._position.training = True
            self.guard.begin_step()
            self._in_step = True

    def _fail(self, error: BaseException) -> None:
        self._in_step = False
        try:
            self.guard.fail_step(error)  # returns: run again; else it raised
        except BaseException:
            self._left = True  # the Guard said goodbye itself (an exit command) or the error goes on
            raise

    def _end_step(self) -> None:
        self._skipped()
        if not self._in_step:
            return  # a step a replica's state committed (_taken_over)
        self._in_step = False
        if not self.guard.end_step():
            raise RecoveryError("the commit of a Lightning step failed after its hooks ran; it cannot be run "
                                "again in place (the job's log says why)")

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self._begin()  # one process: no SIGTERM broadcast began it

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        step, again = self.guard.step, False
        while True:
            try:
                if again:
                    self._sigterm_broadcast()
                return super().optimizer_step(optimizer, closure, model, **kwargs)
            except Exception as error:
                self._fail(error)
            if self.guard.step > step:
                # Struck inside its update after the others committed: it took the replica's state of the
                # step this batch makes, which is done; only Lightning's scheduler step is still to come.
                self._taken_over()
                return None
            self._begin()  # the same batch again: the closure is bound to it
            again = True

    def _sigterm_broadcast(self) -> None:
        """Lightning's SIGTERM ``broadcast`` again, before a retried batch's
        closure: every rank's collectives after a recovery begin with it. A
        rank whose state was taken over (above) begins its next batch with
        it; a rank stopped in its own (Lightning ignores the error and goes
        on to the batch: the fault shows in the closure) and retrying here
        had it only before the fault: without it, it sent the backward
        pass's gradients while the other waited in the broadcast, until the
        watchdog took it for a second fault."""
        if self._broadcast is not None and self.lightning_module.trainer.world_size > 1:
            self._broadcast()

    def _taken_over(self) -> None:
        """Lightning's scheduler steps for the rest of this batch are
        skipped: the replica's scheduler state counts them already. Undone at
        the batch's end (:meth:`_end_step`), so nothing is left on the
        scheduler (its ``state_dict`` is its attributes)."""
        for config in self.lightning_module.trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            self._skipping.append((scheduler, vars(scheduler).get("step")))
            scheduler.step = _skip

    def _skipped(self) -> None:
        for scheduler, own in self._skipping:
            if own is None:
                vars(scheduler).pop("step", None)
            else:
                scheduler.step = own
        self._skipping.clear()

    # ------------------------------------------------------------ the end
    def on_exception(self, exception: BaseException) -> None:
        self._left = True
        super().on_exception(exception)

    def teardown(self) -> None:
        if self.guard is not None and self.guard_report is None and not self._left:
            self.guard_report = self.guard.report()
            self.guard.close()
        super().teardown()


def _skip(*args: Any, **kwargs: Any) -> None:
    """A scheduler step the replica's state counts already (see ``_taken_over``)."""
