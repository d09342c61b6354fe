"""Resumable data positions for ``Guard(data=...)``.

A rank's data position is its own (ranks read different shards of a
``DistributedSampler``): the Guard saves it with the rank's random streams
in every checkpoint (``own_r<rank>.bin``), in every snapshot and in the node
agent's record at each update, and gives each rank back its own after a
dump, a restart in place or a retry (:mod:`.own`). What the position *is*
comes from the object given as ``data=``; two loaders are understood here:

* torchdata's ``StatefulDataLoader`` (``pip install 'trainguard[data]'``),
  given as it is: :func:`resumable` wraps it in :class:`StatefulLoaderPosition`,
  which adds what its ``state_dict`` lacks -- the epoch that
  ``DistributedSampler.set_epoch`` sets, and the state of the generator a new
  iterator draws its seed from -- and moves the iterator the script holds
  back to the restored position (a rolled-back step reads its batch again).
* a plain ``torch.utils.data.DataLoader``: wrap it in :class:`ResumableLoader`
  and iterate the wrapper.

Either way the loader is given a ``torch.Generator`` of its own when it has
none, so that a new iterator does not draw its seed from the global random
stream (the one dropout draws from): a resume creates an iterator the
fault-free run did not create at that step, and would shift every later
dropout mask.
"""

from __future__ import annotations

import copy
import itertools
import sys
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data.distributed import DistributedSampler

__all__ = ["EpochBatches", "ResumableLoader", "StatefulLoaderPosition", "distributed_sampler", "resumable"]


def distributed_sampler(loader: Any) -> DistributedSampler | None:
    """The ``DistributedSampler`` that orders ``loader``'s samples: its
    ``sampler``, or its ``batch_sampler``'s (``None``: there is none)."""
    for sampler in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if isinstance(sampler, DistributedSampler):
            return sampler
    return None


def _own_generator(loader: DataLoader) -> torch.Generator:
    """``loader``'s generator; a new one, seeded by one draw from the global
    stream now, when it has none (each new iterator draws its base seed from
    it instead of from the global stream)."""
    if loader.generator is None:
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
        loader.generator = torch.Generator().manual_seed(seed)
    return loader.generator


def _is_stateful_loader(obj: Any) -> bool:
    """Whether ``obj`` is torchdata's ``StatefulDataLoader`` (without
    importing torchdata: a script that made one has imported it)."""
    module = sys.modules.get("torchdata.stateful_dataloader")
    return module is not None and isinstance(obj, module.StatefulDataLoader)


def resumable(data: Any) -> Any:
    """What the Guard keeps as the data position for ``data=``: a
    ``StatefulDataLoader`` wrapped in :class:`StatefulLoaderPosition`; any
    other object with ``state_dict``/``load_state_dict`` as it is.

    Raises:
        TypeError: a ``DataLoader`` without those methods (its position
            cannot be saved: wrap it in :class:`ResumableLoader`), or another
            object without them.
    """
    if data is None or isinstance(data, (StatefulLoaderPosition, ResumableLoader)):
        return data
    if _is_stateful_loader(data):
        return StatefulLoaderPosition(data)
    stateful = hasattr(data, "state_dict") and hasattr(data, "load_state_dict")
    if isinstance(data, DataLoader) and not stateful:
        raise TypeError("data: a torch DataLoader has no state_dict(); wrap it in "
                        "trainguard.torch.ResumableLoader(loader) and iterate the wrapper, or use torchdata's "
                        "StatefulDataLoader (docs/torch.md#resumable-data)")
    if not stateful:
        raise TypeError("data must have state_dict() and load_state_dict()")
    return data


class StatefulLoaderPosition:
    """The data position of a torchdata ``StatefulDataLoader``: its own
    ``state_dict`` (the sampler position, workers' states), the epoch of its
    ``DistributedSampler`` (``set_epoch``; ``None`` without one) and the
    state of its generator.

    Loading a position moves the loader's current iterator -- the one the
    script holds -- to it in place, so ``next`` on it yields the batch that
    follows the position (the sampler is fast-forwarded by indices; no
    sample is loaded and dropped). Without a current iterator (a new
    process), the iterator is created now and ``iter(loader)`` returns it.
    """

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.sampler = distributed_sampler(loader)
        self.generator = _own_generator(loader)

    def state_dict(self) -> dict:
        return {"loader": self.loader.state_dict(),
                "epoch": None if self.sampler is None else int(self.sampler.epoch),
                "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        if self.sampler is not None and state.get("epoch") is not None:
            self.sampler.set_epoch(int(state["epoch"]))  # before any iterator orders the epoch's samples
        loader_state = copy.deepcopy(state["loader"])
        live = self.loader._iterator
        if live is not None and self.loader.num_workers == 0:
            live.load_state_dict(loader_state)  # in place: the script's iterator goes on from here
            self.loader.next_iter_state = None
        else:
            if live is not None:  # worker processes: shut them down, start the iterator over from the state
                live._shutdown_workers()
                live.__init__(self.loader, loader_state)
                self.loader.next_iter_state = None
            else:
                self.loader.load_state_dict(loader_state)
                self.loader.state_dict()  # creates the iterator now; `iter(loader)` returns it
        if state.get("generator") is not None:  # after the iterator's creation drew from it
            self.generator.set_state(state["generator"])


class _Skip:
    """A batch sampler that leaves out its first ``skip`` batches until
    :meth:`disarm` (the making of one iterator may ``iter`` it twice, as
    torch's worker iterator does; a persistent-workers iterator that keeps it
    for later epochs gets them whole)."""

    def __init__(self, batches: Any, skip: int) -> None:
        self.batches, self.skip = batches, skip

    def disarm(self) -> None:
        self.skip = 0

    def __iter__(self) -> Iterator:
        return itertools.islice(iter(self.batches), self.skip, None)

    def __len__(self) -> int:
        return len(self.batches)


class ResumableLoader:
    """A plain ``DataLoader`` whose position can be saved: give the wrapper
    to the Guard as ``data=`` and iterate the wrapper (one ``iter`` per epoch,
    as with the loader)::

        sampler = DistributedSampler(dataset, seed=7)
        data = ResumableLoader(DataLoader(dataset, batch_size=32, sampler=sampler))
        guard = Guard(model, opt, data=data, checkpoint_dir="ckpt")
        batches = iter(data)
        for step in guard.steps(total):
            with guard.protect():
                batch = next(batches, None)
                if batch is None:                         # the epoch is over
                    sampler.set_epoch(sampler.epoch + 1)
                    batches = iter(data)
                    batch = next(batches)
                ...

    The position is the epoch (the ``DistributedSampler``'s, from
    ``set_epoch``), the batches taken in it, and the loader's generator as it
    was when the epoch's iterator was made (the loader is given a generator
    of its own if it has none, so that iterators do not draw from the global
    random stream). Loading a position moves the current iterator to it; its
    next batch is the one after the position, found by skipping the
    sampler's indices (no sample of the skipped batches is loaded). Random
    augmentations drawn inside worker processes are not replayed for the
    skipped batches, so they differ after a resume mid-epoch.

    Raises:
        TypeError: ``loader`` is not a ``DataLoader`` with a batch size (its
            ``batch_sampler``) over a map-style dataset.
    """

    def __init__(self, loader: DataLoader) -> None:
        if not isinstance(loader, DataLoader) or loader.batch_sampler is None:
            raise TypeError("ResumableLoader wraps a torch DataLoader that makes batches (batch_size or batch_sampler)")
        if isinstance(loader.dataset, IterableDataset):  # no indices to skip by: its position is the dataset's
            raise TypeError("ResumableLoader needs a map-style dataset; for an IterableDataset use torchdata's "
                            "StatefulDataLoader with a dataset that has state_dict()/load_state_dict()")
        self.loader = loader
        self.sampler = distributed_sampler(loader)
        self.generator = _own_generator(loader)
        self._live: _Batches | None = None
        self._loaded = False  # a position was loaded and the script has not read from it yet

    def __iter__(self) -> "_Batches":
        if self._loaded and self._live is not None and not self._live.finished:
            self._loaded = False
            return self._live  # the loaded position (a resumed run's first `iter`)
        self._loaded = False
        self._live = _Batches(self, self._epoch(), 0, None)
        return self._live

    def __len__(self) -> int:
        return len(self.loader)

    def _epoch(self) -> int | None:
        return None if self.sampler is None else int(self.sampler.epoch)

    def state_dict(self) -> dict:
        live = self._live
        if live is None or live.generator_at_start is None:  # the epoch's iterator is not made yet
            return {"epoch": self._epoch() if live is None else live.epoch, "batches": 0, "started": False,
                    "finished": False, "generator": self.generator.get_state()}
        return {"epoch": live.epoch, "batches": live.taken, "started": True, "finished": live.finished,
                "generator": live.generator_at_start}

    def load_state_dict(self, state: dict) -> None:
        epoch = state.get("epoch")
        self._loaded = True
        if self.sampler is not None and epoch is not None:
            self.sampler.set_epoch(int(epoch))
        if not state["started"]:
            self.generator.set_state(state["generator"])
            if self._live is None:
                self._live = _Batches(self, epoch, 0, None)
            else:  # the iterator the script holds starts the epoch
                self._live.restart(epoch, 0, False, None)
            return
        if self._live is None:
            self._live = _Batches(self, epoch, int(state["batches"]), state["generator"], bool(state["finished"]))
        else:
            self._live.restart(epoch, int(state["batches"]), bool(state["finished"]), state["generator"])
        self._live.begin()


class EpochBatches:
    """One epoch of a resumable loader (``owner``): the loader's iterator,
    made by :meth:`begin` on the first ``next``, counting the batches it
    yields. ``owner._live`` is the epoch being trained; its first ``next``
    after a position was loaded clears ``owner._loaded``."""

    owner: Any
    finished: bool
    taken: int
    _it: Iterator | None

    def begin(self) -> None:
        raise NotImplementedError

    def ended(self) -> None:
        """The loader's iterator is exhausted."""
        self.finished = True

    def __iter__(self) -> "EpochBatches":
        return self

    def __next__(self) -> Any:
        if self.owner._live is self:
            self.owner._loaded = False
        if self.finished:
            raise StopIteration
        if self._it is None:
            self.begin()
        try:
            batch = next(self._it)
        except StopIteration:
            self.ended()
            raise
        self.taken += 1
        return batch


class _Batches(EpochBatches):
    """An epoch of a :class:`ResumableLoader`: the loader's iterator, made
    on the first ``next`` (or when a position is loaded), counting the
    batches it yields."""

    def __init__(self, owner: ResumableLoader, epoch: int | None, taken: int, generator: torch.Tensor | None,
                 finished: bool = False) -> None:
        self.owner = owner
        self.restart(epoch, taken, finished, generator)

    def restart(self, epoch: int | None, taken: int, finished: bool, generator: torch.Tensor | None) -> None:
        self.epoch, self.taken, self.finished = epoch, taken, finished
        self.generator_at_start = generator  # None: the epoch's iterator is not made yet
        self._it: Iterator | None = None

    def begin(self) -> None:
        """Make the loader's iterator, skipping the batches already taken."""
        owner = self.owner
        if self.generator_at_start is None:
            self.generator_at_start = owner.generator.get_state()
        else:
            owner.generator.set_state(self.generator_at_start)  # the draw of the first making of this epoch
        loader, batches = owner.loader, owner.loader.batch_sampler
        if self.taken and loader._iterator is not None and loader.persistent_workers:
            loader._iterator._shutdown_workers()  # its workers would take the whole epoch's batches again
            loader._iterator = None
        skip = _Skip(batches, self.taken)
        if self.taken:  # DataLoader refuses a new batch_sampler after construction; for the making only
            object.__setattr__(loader, "batch_sampler", skip)
        try:
            self._it = iter(loader)
        finally:
            skip.disarm()
            object.__setattr__(loader, "batch_sampler", batches)

