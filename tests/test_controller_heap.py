"""A large job's controller freezes its heap once every rank registered (so
a full collection does not walk the job's long-lived objects inside a
fault's stop fan-out), and unfreezes it when it stops; a small job's is
left alone."""

from __future__ import annotations

import gc

import pytest

from trainguard.core.api import ControllerState
from trainguard.core.control.heap import LARGE, Heap


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_the_heap_is_frozen_once_every_rank_registered_and_released_at_stop(unfrozen):
    heap = Heap(LARGE)
    heap.tick(ControllerState.INIT)  # ranks still registering: nothing yet
    assert gc.get_freeze_count() == 0 and not heap.frozen
    heap.tick(ControllerState.NORMAL)
    frozen = gc.get_freeze_count()
    assert heap.frozen and frozen > 0
    kept = [object() for _ in range(10)]  # noqa: F841 -- a later tick freezes nothing more
    heap.tick(ControllerState.RECOVERING)
    assert gc.get_freeze_count() == frozen
    heap.release()
    assert not heap.frozen and gc.get_freeze_count() == 0


def test_a_small_jobs_heap_is_left_alone(unfrozen):
    heap = Heap(LARGE - 1)
    heap.tick(ControllerState.NORMAL)
    assert not heap.frozen and gc.get_freeze_count() == 0
