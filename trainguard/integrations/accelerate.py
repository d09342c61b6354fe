"""trainguard for a training loop written with HF accelerate.

::

    accelerator = Accelerator()
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    loader = ResumableShard(loader)                 # iterate this one
    guard = protect(accelerator, model, optimizer, scheduler=scheduler, data=loader,
                    checkpoint_dir="ckpt", save_every=100)
    batches = iter(loader)
    for step in guard.steps(total):
        with guard.protect():
            batch = next(batches, None)
            if batch is None:                       # the epoch is over
                batches = iter(loader)
                batch = next(batches)
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()                        # the prepared optimizer: reports its update
            scheduler.step()
            optimizer.zero_grad()
    guard.close()

:func:`protect` builds the torch :class:`~trainguard.torch.Guard` from the
prepared objects and puts the Guard's optimizer wrapper inside accelerate's
``AcceleratedOptimizer``, so the loop keeps calling the prepared optimizer.
:class:`ResumableShard` is the data position of accelerate's prepared
``DataLoaderShard``: it prefetches one batch, so its position is counted at
the batches the loop took, and restored by accelerate's own
``skip_first_batches`` (no skipped sample is loaded).

``accelerate launch`` reaches a controller once ``adapters-patch torchrun``
is applied (it covers ``torch.distributed.run.run``, which accelerate
calls); ``trainguard run`` launches the same script too.
"""

from __future__ import annotations

import logging
from contextlib import suppress
from typing import Any, Iterator

import torch

from trainguard.core import ConfigError
from trainguard.torch import Guard
from trainguard.adapters.torch.data import EpochBatches
from trainguard.adapters.torch.data import _own_generator as own_generator  # the one ResumableLoader uses

__all__ = ["ResumableShard", "generator_states", "generators", "guard_prepared", "protect", "set_generator_states"]

log = logging.getLogger("trainguard.integrations")


def protect(accelerator: Any, model: Any, optimizer: Any, *, scheduler: Any = None, data: Any = None,
            **options: Any) -> Guard:
    """A Guard over objects ``accelerator.prepare`` returned.

    Args:
        accelerator: the ``Accelerator``.
        model: the prepared model (DDP under several processes).
        optimizer: the prepared ``AcceleratedOptimizer``; keep calling it.
        scheduler: the prepared scheduler (optional).
        data: a :class:`ResumableShard` over the prepared loader (optional;
            without it the data position is not restored: batches must be a
            function of the step).
        options: the Guard's other keyword arguments (``checkpoint_dir``,
            ``save_every``, ``snapshot_every``, ...).

    Raises:
        ConfigError: ``optimizer`` is not accelerate's prepared one, or
            ``data`` is a prepared loader given bare.
    """
    from accelerate.optimizer import AcceleratedOptimizer

    if not isinstance(optimizer, AcceleratedOptimizer):
        raise ConfigError("protect() takes the optimizer accelerator.prepare() returned")
    if data is not None and not isinstance(data, ResumableShard) and _is_shard(data):
        raise ConfigError("data: wrap the prepared loader in trainguard.integrations.accelerate.ResumableShard("
                          "loader), give the wrapper as data= and iterate the wrapper (the loader prefetches a "
                          "batch, so its own position is one ahead of the loop's)")
    given = data.loader if isinstance(data, ResumableShard) else data
    others = [d for d in getattr(accelerator, "_dataloaders", []) if d is not given]
    if others:
        log.warning("%d prepared DataLoader(s) not given to trainguard as data=: after a fault their position is "
                    "not restored, so a resumed job reads other batches than a fault-free one unless its batches "
                    "are a function of the step (wrap the training loader in ResumableShard and pass it as "
                    "data=)", len(others))
    return guard_prepared(model, optimizer, scheduler=scheduler, data=data, **options)


def guard_prepared(model: Any, optimizer: Any, **options: Any) -> Guard:
    """The Guard over a prepared model and ``AcceleratedOptimizer``, whose
    step then goes through the Guard's wrapper (also for HF Trainer)."""
    from accelerate.optimizer import patch_optimizer_step

    guard = Guard(model, optimizer.optimizer, **options)
    optimizer.optimizer = guard.optimizer  # the prepared optimizer's step() now reports its update
    if optimizer.scaler is not None:  # fp16: accelerate's patched step must call the wrapper's
        optimizer._optimizer_original_step_method = guard.optimizer.step
        optimizer._optimizer_patched_step_method = patch_optimizer_step(optimizer, guard.optimizer.step)
    return guard


def _is_shard(loader: Any) -> bool:
    from accelerate.data_loader import DataLoaderDispatcher, DataLoaderShard

    return isinstance(loader, (DataLoaderShard, DataLoaderDispatcher))


class ResumableShard:
    """The data position of accelerate's prepared ``DataLoaderShard`` (or
    ``DataLoaderDispatcher``): give it to the Guard as ``data=`` and iterate
    it, one ``iter`` per epoch, as the loader.

    The position is the epoch (the loader's ``iteration``, which sets its
    sampler's epoch), the batches the loop took in it, and the states of the
    generators a new iterator draws from (the loader's, its sampler's, the
    one accelerate synchronises) when the epoch's iterator was made. The loader gets a
    generator of its own when it has none, so that a new iterator draws its
    seed from it and not from the training's random streams. Loading a
    position moves the iterator the loop holds: its next batch is the one
    after the position, made by ``skip_first_batches`` at the next ``next``.

    Raises:
        ConfigError: ``loader`` is no prepared loader, or it synchronises
            random streams other than its sampler's generator at each new
            iterator (``rng_types``): a new iterator after a fault would
            overwrite the training's streams with rank 0's.
    """

    def __init__(self, loader: Any) -> None:
        if not _is_shard(loader):
            raise ConfigError("ResumableShard wraps a DataLoader that accelerator.prepare() returned")
        extra = [t for t in (getattr(loader, "rng_types", None) or []) if str(t) != "generator"]
        if extra:
            raise ConfigError(f"the prepared loader synchronises the random streams {extra} from rank 0 at every "
                              f"new iterator, which a resume or retry would make at another step: create the "
                              f"Accelerator with rng_types=['generator'] (its default)")
        self.loader = loader
        own_generator(getattr(loader, "base_dataloader", loader))
        self._live: _Epoch | None = None
        self._loaded = False

    def __iter__(self) -> "_Epoch":
        if self._loaded and self._live is not None and not self._live.finished:
            self._loaded = False
            return self._live  # the loaded position (a resumed run's first `iter`)
        self._loaded = False
        if self._live is not None:
            self._live.close()
        self._live = _Epoch(self, int(self.loader.iteration), 0, None)
        return self._live

    def __len__(self) -> int:
        return len(self.loader)

    def generator_states(self) -> dict[str, torch.Tensor]:
        return generator_states(self.loader)

    def set_generator_states(self, states: dict[str, torch.Tensor]) -> None:
        set_generator_states(self.loader, states)

    def state_dict(self) -> dict:
        live = self._live
        if live is None or live.generator_at_start is None:  # the epoch's iterator is not made yet
            epoch = int(self.loader.iteration) if live is None else live.epoch
            return {"epoch": epoch, "batches": 0, "started": False, "finished": False,
                    "generator": self.generator_states()}
        return {"epoch": live.epoch, "batches": live.taken, "started": True, "finished": live.finished,
                "generator": live.generator_at_start}

    def load_state_dict(self, state: dict) -> None:
        self._loaded = True
        started = bool(state["started"])
        generator = state["generator"] if started else None
        if not started:
            self.set_generator_states(state["generator"])
        if self._live is None:
            self._live = _Epoch(self, int(state["epoch"]), int(state["batches"]), generator, bool(state["finished"]))
        else:
            self._live.restart(int(state["epoch"]), int(state["batches"]), bool(state["finished"]), generator)
        self.loader.iteration = int(state["epoch"]) + (1 if state["finished"] else 0)


def generators(loader: Any) -> dict[str, torch.Generator]:
    """The generators a new iterator of ``loader`` draws from, by where they
    are: the loader's own (worker seeds), the one accelerate synchronises
    from rank 0, and its samplers' (a ``RandomSampler`` draws each epoch's
    order from it; accelerate's ``SeedableRandomSampler`` seeds its own
    from its epoch at every iterator, so it is left out)."""
    from accelerate.data_loader import SeedableRandomSampler

    found: dict[str, torch.Generator] = {}
    seen: set[int] = set()
    base = getattr(loader, "base_dataloader", loader)
    pending: list[tuple[str, Any]] = [("sampler", base.sampler), ("batch_sampler", base.batch_sampler)]
    for name, g in [("loader", base.generator), ("synchronized", getattr(loader, "synchronized_generator", None))]:
        if isinstance(g, torch.Generator) and id(g) not in seen:
            found[name], _ = g, seen.add(id(g))
    while pending:
        path, sampler = pending.pop(0)
        if sampler is None:
            continue
        # accelerate's seedable sampler seeds its generator from its epoch at every iterator: nothing to keep
        g = None if isinstance(sampler, SeedableRandomSampler) else getattr(sampler, "generator", None)
        if isinstance(g, torch.Generator) and id(g) not in seen:
            found[f"{path}.generator"], _ = g, seen.add(id(g))
        pending += [(f"{path}.{name}", getattr(sampler, name, None)) for name in ("sampler", "batch_sampler")]
    return found


def generator_states(loader: Any) -> dict[str, torch.Tensor]:
    return {name: g.get_state() for name, g in generators(loader).items()}


def set_generator_states(loader: Any, states: dict[str, torch.Tensor]) -> None:
    """Put back the generators ``states`` names (one made since is left as it is)."""
    now = generators(loader)
    for name, state in states.items():
        if name in now:
            now[name].set_state(state)


class _Epoch(EpochBatches):
    """One epoch of a :class:`ResumableShard`: the loader's iterator, made at
    the first ``next`` (a collective of accelerate's: every rank makes it
    at the same step), counting the batches it yields."""

    def __init__(self, owner: ResumableShard, epoch: int, taken: int, generator: dict | None,
                 finished: bool = False) -> None:
        self.owner = owner
        self._it: Iterator | None = None
        self._source: Any = None
        self.restart(epoch, taken, finished, generator)

    def restart(self, epoch: int, taken: int, finished: bool, generator: dict | None) -> None:
        self.close()
        self.epoch, self.taken, self.finished = epoch, taken, finished
        self.generator_at_start = generator  # None: the epoch's iterator is not made yet

    def close(self) -> None:
        """Abandon the loader's iterator (a rollback): it leaves accelerate's
        gradient state as it would at the end of the epoch."""
        if self._it is not None:
            self._it.close()
            with suppress(ValueError, AttributeError):
                self._source.end()
        self._it = self._source = None

    def begin(self) -> None:
        owner = self.owner
        if self.generator_at_start is None:
            self.generator_at_start = owner.generator_states()
        else:
            owner.set_generator_states(self.generator_at_start)  # the draws of the epoch's first making
        owner.loader.iteration = self.epoch
        if self.taken:
            from accelerate.data_loader import skip_first_batches
            self._source = skip_first_batches(owner.loader, self.taken)
        else:
            self._source = owner.loader
        self._it = iter(self._source)

    def ended(self) -> None:
        self.finished, self._it, self._source = True, None, None
        self.owner.loader.iteration = self.epoch + 1  # a skipping loader counted its own
