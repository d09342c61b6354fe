"""The node agent's pool of warm standbys (launcher/warm.py): how many it
keeps, and when; a restarted rank takes one out of it."""

from __future__ import annotations

import pytest

from trainguard.launcher import warm


class FakeStandby:
    started = 0

    def __init__(self):
        FakeStandby.started += 1
        self.code = None

    def poll(self):
        return self.code

    def kill(self):
        self.code = -9

    def wait(self):
        return self.code


@pytest.fixture
def pool(monkeypatch):
    FakeStandby.started = 0
    monkeypatch.setattr(warm, "new_standby", FakeStandby)
    return warm.WarmGroup()


def test_nothing_starts_beside_workers_that_are_not_up_yet(pool):
    pool.keep(4, dumping=False, ranks_up=False, for_a_rank=True)
    pool.keep(4, dumping=False, ranks_up=False, for_a_rank=False)
    assert FakeStandby.started == 0 and pool.take() is None


def test_one_standby_for_a_restarted_rank_and_one_per_worker_while_a_dump_runs(pool):
    pool.keep(4, dumping=False, ranks_up=True, for_a_rank=True)
    pool.keep(4, dumping=False, ranks_up=True, for_a_rank=True)
    assert FakeStandby.started == 1
    pool.keep(4, dumping=True, ranks_up=False, for_a_rank=True)
    assert FakeStandby.started == 4  # the group restart after the dump takes one per worker


def test_one_per_worker_where_the_group_restart_is_the_only_way_back(pool):
    pool.keep(3, dumping=False, ranks_up=True, for_a_rank=False)
    assert FakeStandby.started == 3


def test_a_restarted_rank_takes_a_live_standby_and_a_dead_one_is_replaced(pool):
    pool.keep(2, dumping=False, ranks_up=True, for_a_rank=True)
    first = pool.take()
    assert isinstance(first, FakeStandby) and pool.take() is None
    pool.keep(2, dumping=False, ranks_up=True, for_a_rank=True)
    pool._pool[0].code = 1  # died while waiting
    assert pool.take() is None
    pool.keep(2, dumping=False, ranks_up=True, for_a_rank=True)
    assert FakeStandby.started == 3 and pool.take().poll() is None
