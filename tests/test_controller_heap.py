"""A large job's controller collects its heap once after registration and
freezes it (so a full collection does not land in a fault's stop fan-out),
and unfreezes it when it stops; a small job's is left alone."""

from __future__ import annotations

import gc

import pytest

from trainguard.core.api import ControllerState
from trainguard.core.control.heap import LARGE, SETTLE_S, Heap


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_the_heap_is_frozen_once_registration_settled_and_released_at_stop(unfrozen):
    now = [0.0]
    heap = Heap(LARGE, clock=lambda: now[0])
    heap.tick(ControllerState.INIT)
    now[0] += 10
    heap.tick(ControllerState.INIT)  # ranks still registering: nothing yet
    assert gc.get_freeze_count() == 0
    heap.tick(ControllerState.NORMAL)  # every rank registered: wait for the Welcomes to go out
    now[0] += SETTLE_S / 2
    heap.tick(ControllerState.NORMAL)
    assert gc.get_freeze_count() == 0 and not heap.frozen
    now[0] += SETTLE_S
    heap.tick(ControllerState.NORMAL)
    assert heap.frozen and gc.get_freeze_count() > 0
    heap.release()
    assert not heap.frozen and gc.get_freeze_count() == 0


def test_a_small_jobs_heap_is_left_alone(unfrozen):
    now = [0.0]
    heap = Heap(LARGE - 1, clock=lambda: now[0])
    for state in (ControllerState.NORMAL, ControllerState.NORMAL):
        heap.tick(state)
        now[0] += 2 * SETTLE_S
    assert not heap.frozen and gc.get_freeze_count() == 0
