"""The default process group, made abortable.

Frameworks run collectives of their own on the default group every step:
HF Trainer's token count (an ``all_gather`` in ``get_batch_samples``),
Lightning's per-batch SIGTERM ``broadcast``, accelerate's RNG
synchronisation at each new iterator, torchmetrics' syncs, a user's
``dist.all_reduce``. When a peer fails, a healthy rank waiting in one of
them sits there until gloo's timeout (30 minutes), however fast trainguard
releases its own group.

:func:`route` puts an :class:`~.process_group.AbortableProcessGroup` in the
default group's place, over the same store, world and backend name, so
``torch.distributed``'s functions called with no ``group`` (or
``group=dist.group.WORLD``) go through it, and a STOP releases them too.
The group the job started with stays alive, unused (objects made before may
hold it). torch has no supported call for this: it sets what
``init_process_group`` sets for the default group (``_world``'s maps and
``_update_default_pg``, torch 2.13).

A default group trainguard already made (``init_process_group("trainguard")``,
:mod:`.backend`) is used as it is. One whose backend is not gloo (NCCL for
CUDA tensors, with gloo for CPU ones) is left alone: its collectives wait
for the backend's timeout, as before.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from .process_group import AbortableProcessGroup

__all__ = ["route"]

log = logging.getLogger("trainguard.torch")


def route(make: Callable[[Any], AbortableProcessGroup]) -> tuple[AbortableProcessGroup | None, Any]:
    """Make the default group abortable: ``make(store)`` builds the new
    group on the default group's store (every rank calls this at the same
    point, as it builds a gloo group). Returns the abortable default group
    (``None``: left alone, see the module docstring) and the group it
    replaced (keep it alive)."""
    old = c10d._get_default_group()
    if isinstance(old, AbortableProcessGroup):
        return old, None
    backend, store = c10d._world.pg_map[old]
    if backend != dist.Backend.GLOO:
        log.info("the default process group runs %s: collectives on it wait for its own timeout when a peer fails "
                 "(use guard.process_group for your own)", backend)
        return None, None
    new = make(store)
    world = c10d._world
    world.pg_map[new] = (backend, store)  # dist.get_backend() still says gloo: frameworks branch on it
    world.pg_names[new] = world.pg_names[old]
    world.pg_group_ranks[new] = dict(world.pg_group_ranks[old])
    world.pg_backend_config[new] = world.pg_backend_config[old]
    tag = world.pg_to_tag.get(old, "")
    world.pg_to_tag[new] = tag
    for name in {tag, ""}:
        world.tags_to_pg.setdefault(name, []).append(new)
    for table in (world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config, world.pg_to_tag):
        table.pop(old, None)
    for groups in world.tags_to_pg.values():
        while old in groups:
            groups.remove(old)
    c10d._update_default_pg(new)
    return new, old
