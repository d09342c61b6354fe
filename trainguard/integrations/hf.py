"""trainguard for HF ``transformers.Trainer``.

::

    from trainguard.integrations.hf import GuardedTrainer

    trainer = GuardedTrainer(model=model, args=args, train_dataset=dataset,
                             guard_options={"save_every": 100})   # the Guard's keyword arguments
    trainer.train()

:class:`GuardedTrainer` is a ``Trainer`` whose training loop runs each
optimizer step as a Guard step (the DLRover pattern: a subclass, everything
else the Trainer's own). The step begins where the Trainer fetches its
batches (``get_batch_samples``) and is committed at ``on_step_end``, after
the scheduler stepped and ``global_step`` counted it; a fault anywhere in
between (the token count's ``all_gather``, forward, backward, clipping, the
update) goes to the Guard. When the Guard retries, the epoch is entered
again at the failed step the way the Trainer resumes from a checkpoint
(``skip_first_batches``: the batches before are not loaded), with the
sampler's and loader's generators back at the epoch's start; when it resumes
from a dying gasp, ``TrainerState.global_step`` and the epoch are the
Guard's step. The Trainer's own checkpoints (``save_strategy``) are written
as before. The data position is a function of the step, as the Trainer's:
one step is ``gradient_accumulation_steps`` batches.

Tied to the Trainer's loop methods (``_prepare_for_training``,
``_run_epoch``, ``get_batch_samples``, ``_load_rng_state``) of transformers
5.x; the ``[hf]`` extra pins the tested range.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from transformers import Trainer, TrainerCallback

from trainguard.core import ConfigError

from .accelerate import generator_states, guard_prepared, set_generator_states

__all__ = ["GuardedTrainer"]

log = logging.getLogger("trainguard.integrations")

#: What ``_run_epoch`` is given as its checkpoint when the Guard, not a
#: checkpoint directory, put the state back (``_load_rng_state`` then loads nothing).
_GUARD = "<trainguard>"


class _Retry(Exception):
    """The step's commit failed and the Guard recovered it: enter the epoch again."""


class _EpochStart:
    """The data position the Guard keeps: the epoch, the states of the
    generators its iterator drew from at its start, and their states now
    (at an epoch's end, the next epoch's start). The batches taken follow
    from the step."""

    def __init__(self) -> None:
        self.epoch: int | None = None
        self.states: dict | None = None
        self.loader: Any = None
        self.loaded = False  # set by the Guard (a resume, a rollback); the next entry follows it

    def mark(self, epoch: int, loader: Any) -> None:
        self.epoch, self.loader = epoch, loader
        self.states = generator_states(loader)

    def state_dict(self) -> dict:
        now = None if self.loader is None else generator_states(self.loader)
        return {"epoch": self.epoch, "generators": self.states, "now": now}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.states, self.now = state["epoch"], state["generators"], state.get("now")
        self.loaded = True


class _Commit(TrainerCallback):
    def __init__(self, trainer: "GuardedTrainer") -> None:
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer._end_step()


class GuardedTrainer(Trainer):
    """A ``Trainer`` protected by trainguard.

    Args:
        guard_options: keyword arguments of :class:`trainguard.torch.Guard`
            (``checkpoint_dir``, default ``<output_dir>/trainguard``;
            ``save_every``, ``snapshot_every``, ...).
        args, kwargs: the Trainer's.

    Attributes:
        guard: the Guard, from the start of ``train()``.
        guard_report: ``guard.report()`` when ``train()`` returned.
    """

    def __init__(self, *args: Any, guard_options: dict | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.guard_options = dict(guard_options or {})
        if "data" in self.guard_options or "scheduler" in self.guard_options:
            raise ConfigError("guard_options: the Trainer's scheduler and data position are the Guard's already")
        self.guard = None
        self.guard_report: dict | None = None
        self._tg_position = _EpochStart()
        self._tg_in_step = False
        self._tg_logs: tuple | None = None
        self.add_callback(_Commit(self))

    # ------------------------------------------------------------ the Guard
    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        if self.guard is not None:
            raise ConfigError("a GuardedTrainer trains once (its Guard belongs to one run of the loop)")
        if resume_from_checkpoint is not None:
            raise ConfigError("a GuardedTrainer resumes from trainguard's checkpoints by itself; "
                              "call train() without resume_from_checkpoint")
        model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        from trainguard.adapters.torch.data import _own_generator  # the one ResumableLoader uses
        _own_generator(getattr(train_dataloader, "base_dataloader", train_dataloader))
        options = {"checkpoint_dir": os.path.join(self.args.output_dir, "trainguard"), **self.guard_options}
        self.guard = guard_prepared(model, self.optimizer, scheduler=self.lr_scheduler, data=self._tg_position,
                                    **options)
        self.state.global_step = self.guard.step  # a resumed run goes on at the Guard's step
        return model, train_dataloader

    def train(self, *args: Any, **kwargs: Any):
        output = super().train(*args, **kwargs)
        self.guard_report = self.guard.report()
        self.guard.close()
        return output

    # ------------------------------------------------------------ the step
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        self.guard.begin_step()
        self._tg_in_step = True
        # What a failed step adds to the Trainer's logs is taken back (the retry adds it again).
        self._tg_logs = (self._tr_loss.detach().clone(), self.current_flos, self.state.num_input_tokens_seen)
        return super().get_batch_samples(epoch_iterator, num_batches, device)

    def _end_step(self) -> None:
        self._tg_in_step = False
        if not self.guard.end_step():
            raise _Retry()

    def _load_rng_state(self, checkpoint):
        if checkpoint == _GUARD:
            return  # the Guard put every random stream back
        super()._load_rng_state(checkpoint)

    def _run_epoch(self, model, epoch, train_dataloader, steps_in_epoch, num_update_steps_per_epoch, trial,
                   ignore_keys_for_eval, start_time, resume_from_checkpoint, epochs_trained,
                   steps_trained_in_current_epoch):
        run = dict(model=model, epoch=epoch, train_dataloader=train_dataloader, steps_in_epoch=steps_in_epoch,
                   num_update_steps_per_epoch=num_update_steps_per_epoch, trial=trial,
                   ignore_keys_for_eval=ignore_keys_for_eval, start_time=start_time,
                   resume_from_checkpoint=resume_from_checkpoint, epochs_trained=epochs_trained,
                   steps_trained_in_current_epoch=steps_trained_in_current_epoch)
        per_epoch = num_update_steps_per_epoch
        if self.guard.step >= (epoch + 1) * per_epoch:
            return  # a resumed run: the Guard's step is past this epoch
        if self._tg_position.loaded:  # a resumed run's first epoch
            self._enter_at_guard_step(run, epoch, train_dataloader, per_epoch)
        else:
            self._tg_position.mark(epoch, train_dataloader)
        while True:
            try:
                return super()._run_epoch(**run)
            except _Retry:
                pass
            except Exception as error:
                between = not self._tg_in_step  # the Trainer's logging, evaluation or save after a commit
                self._tg_in_step = False
                self.guard.fail_step(error)  # returns: run the step again; else it raised
                if between:
                    log.warning("rank %d: the Trainer's logging, evaluation or save after step %d was cut short "
                                "by a fault (%s); training goes on at step %d", self.guard.rank, self.guard.step,
                                type(error).__name__, self.guard.step)
            self._undo_logs()
            self._enter_at_guard_step(run, epoch, train_dataloader, per_epoch)

    def _enter_at_guard_step(self, run: dict, epoch: int, loader: Any, per_epoch: int) -> None:
        """Enter ``epoch`` again at the Guard's step, as a resume from a
        checkpoint does, with its generators at the epoch's start."""
        done = self.guard.step - epoch * per_epoch
        if not 0 <= done < per_epoch:
            raise ConfigError(f"the Guard is at step {self.guard.step}, outside epoch {epoch}")
        position = self._tg_position
        position.loaded = False
        if position.epoch == epoch and position.states is not None:
            set_generator_states(loader, position.states)
        elif position.epoch == epoch - 1 and getattr(position, "now", None) is not None:
            set_generator_states(loader, position.now)  # the last commit ended the epoch before: this one starts here
            position.mark(epoch, loader)
        elif done or epoch:  # no record of this epoch's start: its batches follow the generators as they are
            log.warning("no record of epoch %d's start: its batches after step %d may differ from a fault-free "
                        "run's", epoch, self.guard.step)
            position.mark(epoch, loader)
        else:
            position.mark(epoch, loader)
        position.loader = loader
        self.state.global_step = self.guard.step
        run.update(resume_from_checkpoint=_GUARD, epochs_trained=epoch,
                   steps_trained_in_current_epoch=done * self.args.gradient_accumulation_steps)

    def _undo_logs(self) -> None:
        if self._tg_logs is not None:
            loss, self.current_flos, self.state.num_input_tokens_seen = self._tg_logs
            self._tr_loss = loss

