"""``TrainFaultTolerance``: trainguard for ``Model.train`` (PyNative or graph mode).

::

    model = Model(net, loss_fn, optimizer=OptTFTWrapper(nn.Momentum(net.trainable_params(), 0.1, 0.9)))
    model.train(epochs, dataset, callbacks=[TrainFaultTolerance("ckpt")], dataset_sink_mode=False)

The callback plays the role of MindSpore's class of that name: its step
hooks are the Guard's (``on_train_step_begin`` starts a step,
``on_train_step_end`` commits it), and the :class:`OptTFTWrapper` inside
``Model``'s ``TrainOneStepCell`` runs the collective health vote before the
update. A fault inside ``Model.train`` ends it, so importing this adapter
wraps ``Model.train`` the way MindSpore's own ``_handle_tft`` decorator
wraps ``Model._train``: when a ``TrainFaultTolerance`` is among the
callbacks, the wrapper builds the :class:`~.guard.Guard` before the first
step, starts training where the Guard's checkpoint left off, and on a fault
has the Guard recover, then calls ``Model.train`` again from the recovered
step. Without the callback ``Model.train`` is untouched.

In graph mode ``Model``'s train step (forward, gradients, their all-reduce
and the wrapper's update) is one compiled graph, and the vote is compiled
into it: ``on_train_step_begin`` sets this rank's health flag (and keeps the
batch, which a drain replays the step on), ``on_train_step_end`` reads
whether the step updated. See :mod:`.guard` for what that means for the
update window and fault injection.

Refused (``ConfigError``) before training: ``dataset_sink_mode=True`` with
more than one step a sink (MindSpore's TFT rule), an optimizer not wrapped
in :class:`OptTFTWrapper`, loss scaling that skips overflowing steps, several
processes without data parallelism. ``Model.fit`` is refused in ``on_train_begin``.

Where a step's batch comes from: step ``s`` of the Guard trains the batch at
global position ``initial_step + s`` of the data (epochs of
``dataset.get_dataset_size()`` batches). A resumed call starts at epoch
``position // batches_per_epoch`` with ``dataset.set_init_step(position)``.
MindSpore's ``_calc_cb_initial_step`` passes only the position inside the
epoch, which skips the right batches but replays the first epoch's shuffle
order; the global position makes the dataset replay the resumed epoch's own
order too (checked against an uninterrupted run, shuffled data included).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os

import mindspore as ms
import numpy as np
from mindspore import nn
from mindspore.train import Callback, Model

from trainguard.core import ConfigError

from .context import rank_and_size
from .guard import Guard
from .optimizer import OptTFTWrapper

__all__ = ["TFTRegister", "TrainFaultTolerance", "unwrap_model_train", "wrap_model_train"]

log = logging.getLogger("trainguard.mindspore")

#: Set on the wrapper of ``Model.train``, so wrapping twice is a no-op.
_MARK = "__trainguard_wrapped__"
#: Parameters of trainguard's own, not in a checkpoint a user saved before the Guard existed.
_NOT_SAVED = ("trainguard_", "tft_g_one_flag")


class TrainFaultTolerance(Callback):
    """Protect ``Model.train`` with trainguard (the role of MindSpore's
    ``TrainFaultTolerance``).

    Args:
        ckpt_save_path: where dying-gasp checkpoints go (MindSpore TFT's
            layout) and where training resumes from.
        ckpt_save_fn: your own writer for the dying-gasp checkpoint,
            ``fn(cb_params, append_dict)`` as in MindSpore: called on the
            rank that saves, with ``cb_params`` at the saved step
            (``cur_step_num``, ``cur_epoch_num``; ``train_network`` holds
            the weights and optimizer state of that step) and
            ``append_dict={"__exception_save__": True}``. It takes the place
            of trainguard's files (preferred when both are given); nothing
            is renamed, and resuming is yours (``ckpt_load_fn`` or
            ``initial_step``).
        ckpt_load_fn: your own loader, ``fn() -> (param_dict,
            remove_redundancy)`` as in MindSpore. MindSpore calls it after a
            training-result error (``TRE:1``), which trainguard does not
            detect; trainguard calls it once at the start of each
            ``Model.train`` instead, to resume from your files: an empty
            ``param_dict`` (or ``None``) starts afresh, otherwise it is
            loaded into the train network as MindSpore does
            (``load_param_into_net(train_network, param_dict, True,
            remove_redundancy)``; ``remove_redundancy=None``: your function
            loaded it) and its ``step_num`` (steps trained) is where
            training continues. Needs ``ckpt_save_fn``: with only
            ``ckpt_save_path`` trainguard resumes from its own files.
        initial_step: steps trained before this run, when you resumed the
            weights yourself: step numbers and the data position count on
            from it (instead of ``Model.train``'s ``initial_epoch``).

    MindSpore 2.10's signature is ``TrainFaultTolerance(ckpt_save_path=None,
    **kwargs)`` and it reads ``ckpt_save_fn``, ``ckpt_load_fn`` and
    ``initial_step`` from ``kwargs``; so does this class, and it refuses any
    other keyword (MindSpore ignores them silently).

    Raises:
        ConfigError (a ``ValueError``, as MindSpore's refusals): neither
            ``ckpt_save_path`` nor ``ckpt_save_fn`` (MindSpore refuses that
            too), a keyword MindSpore does not read, ``ckpt_save_fn`` or
            ``ckpt_load_fn`` not callable, ``ckpt_load_fn`` without
            ``ckpt_save_fn`` or with ``initial_step``, or ``initial_step``
            negative.
    """

    #: The keywords MindSpore 2.10's ``TrainFaultTolerance`` reads from ``**kwargs``.
    KEYWORDS = ("ckpt_save_fn", "ckpt_load_fn", "initial_step")

    def __init__(self, ckpt_save_path: str | os.PathLike | None = None, **kwargs) -> None:
        super().__init__()
        unknown = sorted(set(kwargs) - set(self.KEYWORDS))
        if unknown:
            raise ConfigError(f"TrainFaultTolerance got {', '.join(map(repr, unknown))}: MindSpore's "
                              f"TrainFaultTolerance(ckpt_save_path=None, **kwargs) reads only "
                              f"{', '.join(self.KEYWORDS)} from kwargs (and ignores the rest, which trainguard "
                              f"refuses rather than drop silently)")
        ckpt_save_fn = kwargs.get("ckpt_save_fn")
        ckpt_load_fn = kwargs.get("ckpt_load_fn")
        initial_step = kwargs.get("initial_step", 0)
        if ckpt_save_fn is None and ckpt_save_path is None:
            # MindSpore: "TrainFaultTolerance construct need to set ckpt_save_fn or ckpt_save_path!"
            raise ConfigError("TrainFaultTolerance needs ckpt_save_path or ckpt_save_fn, as MindSpore's: the "
                              "dying-gasp checkpoint must go somewhere")
        if ckpt_save_fn is not None and not callable(ckpt_save_fn):
            raise ConfigError(f"ckpt_save_fn must be a function fn(cb_params, append_dict), got {ckpt_save_fn!r}")
        if ckpt_load_fn is not None:
            if not callable(ckpt_load_fn):
                raise ConfigError(f"ckpt_load_fn must be a function fn() -> (param_dict, remove_redundancy), "
                                  f"got {ckpt_load_fn!r}")
            if ckpt_save_fn is None:
                raise ConfigError("ckpt_load_fn loads the files of your ckpt_save_fn: with ckpt_save_path alone "
                                  "trainguard resumes from its own dying-gasp checkpoints there (pass ckpt_save_fn "
                                  "too, or drop ckpt_load_fn)")
            if initial_step:
                raise ConfigError("give ckpt_load_fn (its step_num says where training resumes) or initial_step, "
                                  "not both")
        if isinstance(initial_step, bool) or not isinstance(initial_step, int) or initial_step < 0:
            raise ConfigError(f"initial_step must be an int >= 0, got {initial_step!r}")
        self.ckpt_save_path = ckpt_save_path
        self.initial_step = initial_step
        self.ckpt_save_fn = ckpt_save_fn
        self.ckpt_load_fn = ckpt_load_fn
        self._cb_params = None  # the running Model.train's, for ckpt_save_fn
        self._base = 0  # the data position of the Guard's step 0
        self._per_epoch = 1
        #: The Guard of the running (or last) ``Model.train``; its ``report()`` stays valid after training.
        self.guard: Guard | None = None
        self._training = False  # between on_train_begin and on_train_end: a fault there is recovered
        self._resume_at: int | None = None  # the data position a resumed call starts at

    @property
    def save_cb(self):
        """MindSpore's attribute name for ``ckpt_save_fn``."""
        return self.ckpt_save_fn

    @property
    def ckpt_load_func(self):
        """MindSpore's attribute name for ``ckpt_load_fn``."""
        return self.ckpt_load_fn

    def _load_with_user_fn(self, model: Model) -> None:
        """``ckpt_load_fn`` before the first step: load what it returns into
        the train network as MindSpore does, and start at its ``step_num``."""
        loaded = self.ckpt_load_fn()
        if not isinstance(loaded, (tuple, list)) or len(loaded) != 2:
            raise ConfigError(f"ckpt_load_fn must return (param_dict, remove_redundancy), as MindSpore's; got "
                              f"{type(loaded).__name__}")
        param_dict, remove_redundancy = loaded
        if not param_dict:
            self.initial_step = 0
            return
        if "step_num" not in param_dict:
            raise ConfigError("the param_dict of ckpt_load_fn has no 'step_num' (the steps trained, which "
                              "MindSpore's dying gasp appends): trainguard cannot tell where to resume")
        step = param_dict["step_num"]
        step = int(np.asarray(step.asnumpy() if hasattr(step, "asnumpy") else step).reshape(-1)[0])
        if step < 0:
            raise ConfigError(f"ckpt_load_fn returned step_num={step}")
        if remove_redundancy is not None:  # None: the function loaded the parameters itself (MindSpore's rule)
            params = {k: v for k, v in param_dict.items() if isinstance(v, ms.Parameter)}
            not_loaded, _ = ms.load_param_into_net(model._train_network, params, True, remove_redundancy)
            missing = [n for n in not_loaded if not any(tag in n for tag in _NOT_SAVED)]
            if missing:  # MindSpore logs these and goes on; so does trainguard, louder
                log.warning("ckpt_load_fn: %d parameters of the train network are not in its param_dict and keep "
                            "their values (%s%s): the resumed run will not match an uninterrupted one",
                            len(missing), ", ".join(missing[:5]), ", ..." if len(missing) > 5 else "")
        self.initial_step = step
        log.info("ckpt_load_fn: resuming at step %d", step)

    def _save_with_user_fn(self, step: int) -> None:
        """``ckpt_save_fn`` at the Guard's ``step``, with ``cb_params`` set
        back to it as MindSpore's own dying gasp does."""
        cb_params = self._cb_params
        if cb_params is None:
            raise ConfigError("ckpt_save_fn: no Model.train has run yet")
        position = self._base + step  # steps of the data trained
        cb_params.cur_step_num = position
        cb_params.cur_epoch_num = (position - 1) // self._per_epoch + 1 if position else 0
        self.ckpt_save_fn(cb_params, {"__exception_save__": True})

    def _attach(self, model: Model, steps_per_epoch: int) -> Guard:
        """Build the Guard for ``model`` (before the first step)."""
        optimizer = model._optimizer
        if not isinstance(optimizer, OptTFTWrapper):
            raise ConfigError(f"TrainFaultTolerance needs the Model's optimizer wrapped: Model(net, loss_fn, "
                              f"optimizer=OptTFTWrapper(opt)) with OptTFTWrapper from trainguard.mindspore; got "
                              f"{type(optimizer).__name__}")
        train_network = model._train_network
        if isinstance(train_network, nn.TrainOneStepWithLossScaleCell):
            # It all-reduces an overflow flag the drain does not replay, and skips the update on overflow.
            raise ConfigError("TrainFaultTolerance does not support loss scaling that skips overflowing steps "
                              "(Model's TrainOneStepWithLossScaleCell) yet")
        reducer = getattr(train_network, "grad_reducer", None)
        reducer = reducer if isinstance(reducer, nn.DistributedGradReducer) else None
        if reducer is None and rank_and_size()[1] > 1:
            raise ConfigError("TrainFaultTolerance protects data-parallel training: with more than one process, "
                              "set ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL) so "
                              "Model's TrainOneStepCell all-reduces the gradients")
        self._per_epoch = steps_per_epoch
        save_fn = self._save_with_user_fn if self.ckpt_save_fn is not None else None
        if ms.get_context("mode") != ms.PYNATIVE_MODE:
            # The cell reduces and votes in one compiled graph; the drain replays it.
            self.guard = Guard(model._network, optimizer, checkpoint_dir=self.ckpt_save_path,
                               steps_per_epoch=steps_per_epoch, reduce_gradients=False, reducer=reducer,
                               compiled_step=lambda inputs: train_network(*inputs), save_fn=save_fn,
                               save_fn_offset=self._base)
            return self.guard
        # PyNative: the Guard votes before the cell's gradient all-reduce, from its grad_reducer slot.
        self.guard = Guard(model._network, optimizer, checkpoint_dir=self.ckpt_save_path,
                           steps_per_epoch=steps_per_epoch, reduce_gradients=reducer is not None, reducer=reducer,
                           save_fn=save_fn, save_fn_offset=self._base)
        if hasattr(train_network, "grad_reducer"):
            train_network.grad_reducer = _VoteThenReduce(self.guard)
        return self.guard

    # MindSpore's callback hooks.
    def on_train_begin(self, run_context) -> None:
        if self.guard is None:
            raise ConfigError("TrainFaultTolerance protects Model.train (import trainguard.mindspore before "
                              "calling it); Model.fit and other loops are not supported")
        self._training = True
        self._cb_params = run_context.original_args()
        if self._resume_at is not None:
            run_context.original_args().cur_step_num = self._resume_at

    def on_train_step_begin(self, run_context) -> None:
        if self.guard._graph:
            self.guard._begin_compiled(tuple(run_context.original_args().train_dataset_element))
        else:
            self.guard._begin()

    def on_train_step_end(self, run_context) -> None:
        if self.guard._graph:
            self.guard._end_compiled()
        self.guard._commit()

    def on_train_end(self, run_context) -> None:
        self._training = False


class TFTRegister(TrainFaultTolerance):
    """MindSpore's older name for :class:`TrainFaultTolerance`; the
    controller's address is accepted and ignored (trainguard's launcher runs
    the controller)."""

    def __init__(self, ctrl_rank_id: int, ctrl_ip: str, ctrl_port: int,
                 ckpt_save_path: str | os.PathLike | None = None) -> None:
        log.info("TFTRegister: ctrl_rank_id=%s, ctrl_ip=%s, ctrl_port=%s are ignored: trainguard's launcher runs "
                 "the controller", ctrl_rank_id, ctrl_ip, ctrl_port)
        if ckpt_save_path is None:
            raise ConfigError("TFTRegister needs ckpt_save_path: where the dying-gasp checkpoint goes")
        super().__init__(ckpt_save_path)


# ------------------------------------------------------------ Model.train
def wrap_model_train() -> None:
    """Wrap ``mindspore.train.Model.train`` (once; see the module docstring)."""
    if getattr(Model.train, _MARK, False):
        return
    original = Model.train
    signature = inspect.signature(original)

    @functools.wraps(original)
    def train(self, *args, **kwargs):
        arguments = signature.bind(self, *args, **kwargs)
        arguments.apply_defaults()
        callback = _find_callback(arguments.arguments["callbacks"])
        if callback is None:
            return original(self, *args, **kwargs)
        call = dict(arguments.arguments)
        del call["self"]
        return _train_protected(original, self, callback, call)

    setattr(train, _MARK, True)
    Model.train = train


def unwrap_model_train() -> None:
    """Put back the ``Model.train`` that :func:`wrap_model_train` wrapped."""
    if getattr(Model.train, _MARK, False):
        Model.train = Model.train.__wrapped__


def _find_callback(callbacks) -> TrainFaultTolerance | None:
    if callbacks is None:
        return None
    found = [c for c in (callbacks if isinstance(callbacks, (list, tuple)) else [callbacks])
             if isinstance(c, TrainFaultTolerance)]
    if len(found) > 1:
        raise ConfigError("Model.train got more than one TrainFaultTolerance callback")
    return found[0] if found else None


def _train_protected(original, model: Model, callback: TrainFaultTolerance, call: dict) -> None:
    """``original(model, **call)`` under a Guard, called again after each
    recovery from the Guard's step; returns when training finished."""
    dataset = call["train_dataset"]
    batches = dataset.get_dataset_size()
    sink_size = batches if call["sink_size"] == -1 else call["sink_size"]
    if call["dataset_sink_mode"] and sink_size > 1:
        raise ConfigError(f"TrainFaultTolerance protects one step per sink only: dataset_sink_mode=True needs "
                          f"sink_size=1 (got {call['sink_size']}, {sink_size} steps a sink), as MindSpore's TFT; "
                          f"or use dataset_sink_mode=False")
    # Model's steps per epoch: one per sink where it sinks (not on CPU, which falls back to feeding).
    sinks = call["dataset_sink_mode"] and ms.get_context("device_target") != "CPU"
    per_epoch = 1 if sinks else batches
    start = call["initial_epoch"] * per_epoch  # the user's own starting position
    if callback.initial_step and call["initial_epoch"] and callback.initial_step // per_epoch != call["initial_epoch"]:
        raise ConfigError(f"initial_step={callback.initial_step} is in epoch {callback.initial_step // per_epoch} "
                          f"of {per_epoch} steps, but Model.train got initial_epoch={call['initial_epoch']}")
    if callback.ckpt_load_fn is not None:
        callback._load_with_user_fn(model)  # before the Guard: its step numbers count on from the loaded step
    base = callback.initial_step or start
    callback._base = base
    guard = callback._attach(model, per_epoch)
    if callback.ckpt_save_fn is not None and base and guard.step == 0:
        guard.resume_user_streams(base)  # the user's files hold the parameters; trainguard kept the streams
    user_init_step = dataset.get_init_step()
    try:
        while True:
            position = base + guard.step
            callback._training, callback._resume_at = False, None
            if position != start:
                call["initial_epoch"] = position // per_epoch
                if call["initial_epoch"] >= call["epoch"]:
                    log.warning("nothing left to train: step %d is past epoch %d", position, call["epoch"])
                    break
                dataset.set_init_step(position)
                callback._resume_at = position
                if guard.rank == 0:
                    log.info("Model.train starts at epoch %d, batch %d (step %d)", call["initial_epoch"],
                             position % per_epoch, position)
            try:
                original(model, **call)
                break
            except Exception as e:
                if not callback._training:
                    raise
                guard._handle(e)  # returns when training resumes at guard.step; otherwise exits the process
    except BaseException:
        guard.close(finished=False)
        raise
    finally:
        dataset.set_init_step(user_init_step)
    guard.close()


class _VoteThenReduce(nn.Cell):
    """Takes the place of ``TrainOneStepCell.grad_reducer`` in PyNative mode:
    the replicas vote before they all-reduce the gradients."""

    def __init__(self, guard: Guard) -> None:
        super().__init__(auto_prefix=False)
        self.guard = guard

    def construct(self, grads):
        return self.guard.reduce(grads)
