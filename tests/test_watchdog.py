"""The hang watchdog's limits, on a clock the test moves."""

import gc

import pytest

from trainguard.core import ConfigError
from trainguard.core.config import watchdog_from_env
from trainguard.core.api import FaultKind, Severity
from trainguard.core.rank.processor import Processor
from trainguard.core.rank.watchdog import ProgressWatchdog, WatchdogConfig


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def trained(steps=10, step_s=1.0, **config):
    clock = Clock()
    wd = ProgressWatchdog(WatchdogConfig(**config), clock=clock, track_gc=False)
    wd.arm()
    for _ in range(steps):
        clock.t += step_s
        wd.step_done()
    return wd, clock


def test_limit_is_three_median_steps_but_at_least_two_seconds():
    wd, clock = trained(step_s=1.0)
    clock.t += 2.9
    assert wd.check() is None
    clock.t += 0.2
    alarm = wd.check()
    assert alarm is not None and alarm.limit_s == pytest.approx(3.0) and not alarm.in_collective
    assert "median step 1.00 s" in alarm.describe()
    assert wd.check() is None, "one alarm per stall"

    fast, clock = trained(step_s=0.1)
    clock.t += 1.9
    assert fast.check() is None
    clock.t += 0.2
    assert fast.check().limit_s == pytest.approx(2.0)


def test_a_pause_the_adapter_recognises_is_held_to_a_first_sections_limit():
    """Spawned DataLoader workers starting at an epoch: seconds against
    0.1 s steps (issue 37: a hang was declared at 2 s and the job dumped)."""
    wd, clock = trained(step_s=0.1, first_section_s=60)
    pause = ["waiting for a DataLoader"]
    wd.in_pause = lambda: pause[0]
    clock.t += 30
    assert wd.check() is None
    clock.t += 1.5  # still waiting: every check looks again while the pause lasts
    assert wd.check() is None
    pause[0] = ""  # the workers are up: the step goes on, its own limit counted from the pause's last sighting
    clock.t += 0.5
    assert wd.check() is None
    clock.t += 1.4
    assert wd.check() is None
    clock.t += 0.2
    assert wd.check().idle_s == pytest.approx(2.1)

    wd.step_done()
    pause[0] = "waiting for a DataLoader"
    clock.t += 30
    assert wd.check() is None
    clock.t += 31
    alarm = wd.check()
    assert alarm is not None and alarm.idle_s == pytest.approx(61), "a loader that never answers is still a hang"
    assert "waiting for a DataLoader, at least 60 s" in alarm.describe()


def test_progress_restarts_the_clock_and_rearms_the_alarm():
    wd, clock = trained()
    clock.t += 3.5
    assert wd.check() is not None
    wd.step_done()  # it was slow, not hung
    clock.t += 2.0
    assert wd.check() is None


def test_first_step_gets_its_own_limit_and_is_not_learned():
    clock = Clock()
    wd = ProgressWatchdog(WatchdogConfig(first_step_s=60), clock=clock, track_gc=False)
    wd.arm()
    clock.t += 59
    assert wd.check() is None
    clock.t += 2
    assert "first step" in wd.check().why
    wd.step_done()
    assert wd.median_step_s == 0.0, "the first step (compilation, warm-up) is not a typical step"


def test_recovery_pauses_the_watchdog_and_resumes_with_what_it_learned():
    wd, clock = trained(step_s=1.0)
    wd.disarm()
    clock.t += 100
    assert wd.check() is None
    wd.arm()
    clock.t += 3.5
    assert wd.check().limit_s == pytest.approx(3.0)


def test_a_rank_that_reports_its_own_fault_is_not_timed_while_it_recovers():
    # The controller sends no STOP to a rank that stopped itself; the repair
    # that follows can take many steps' time (a MindSpore broadcast of every
    # parameter) and is timed by the controller's phases, not the watchdog.
    for report in ("fault", "stopped"):
        wd, clock = trained(step_s=1.0)
        processor = Processor(None)
        processor.watchdog = wd
        if report == "fault":
            processor.report_fault(FaultKind.UCE, Severity.HIGH, "injected")
        else:
            processor.report_stopped()
        clock.t += 100
        assert wd.check() is None, report
        processor.resumed()
        clock.t += 3.5
        assert wd.check() is not None, f"{report}: resuming re-arms it"


def test_a_section_has_a_generous_limit_of_its_own_and_is_not_step_time():
    wd, clock = trained(step_s=1.0, first_section_s=30)
    with wd.section("checkpoint"):
        clock.t += 29
        assert wd.check() is None
    clock.t += 1.0
    assert wd.check() is None, "section time does not count against the step"
    wd.step_done()
    assert wd.median_step_s == pytest.approx(1.0)
    with wd.section("checkpoint"):
        clock.t += 80  # 3 x the longest (29 s) = 87 s
        assert wd.check() is None
        clock.t += 10
        alarm = wd.check()
    assert alarm is not None and "section 'checkpoint'" in alarm.why


def test_an_open_section_is_announced_and_its_limit_reported():
    """The processor sends the section's limit to the controller, which
    stretches its missed-heartbeat limit to it (the section's work may hold
    the GIL, and the heartbeat thread, for seconds)."""
    wd, clock = trained(step_s=1.0, first_section_s=30)
    opened = []
    wd.on_section = lambda: opened.append(wd.section_limit_s())
    assert wd.section_limit_s() == 0.0
    with wd.section("evaluation"):
        clock.t += 40
        assert wd.section_limit_s() == 30.0  # at least first_section_s
    assert opened == [30.0] and wd.section_limit_s() == 0.0
    with wd.section("evaluation"):
        assert wd.section_limit_s() == 120.0  # 3 x the longest (40 s)
    assert opened == [30.0, 120.0]


def test_garbage_collection_time_is_left_out():
    wd, clock = trained(step_s=1.0)
    wd._on_gc("start", {})
    clock.t += 10
    assert wd.check() is None, "no alarm while a collection runs"
    wd._on_gc("stop", {})
    clock.t += 2.5
    assert wd.check() is None
    clock.t += 1.0
    assert wd.check() is not None


def test_real_collections_are_seen():
    wd = ProgressWatchdog(WatchdogConfig())
    try:
        wd.arm()
        gc.collect()
        assert wd._gc_started is None and wd._excluded > 0
    finally:
        wd.close()
    assert wd._on_gc not in gc.callbacks


def test_a_rank_blocked_in_a_collective_allows_its_peers_a_benign_pause():
    wd, clock = trained(step_s=1.0, poll_s=0.25)
    wd.in_collective = lambda: True
    clock.t += 7.1  # a peer's 5-step garbage collection, its step, then the rest of ours
    assert wd.check() is None
    clock.t += 0.2
    alarm = wd.check()
    assert alarm.in_collective and "waiting in a collective" in alarm.describe()
    assert alarm.limit_s == pytest.approx(7.25)

    fast, clock = trained(step_s=0.1, poll_s=0.25)
    fast.in_collective = lambda: True
    clock.t += 2.3
    assert fast.check().limit_s == pytest.approx(2.25)


def test_the_allowance_of_a_wait_in_a_collective_lasts_until_the_step_completes():
    """The peer came back, the collective completed, and this rank finishes
    its step with most of the limit spent: a check in between is no hang
    (CI: a peer's 5-step GC, then an alarm 'not in a collective' here)."""
    wd, clock = trained(step_s=1.0, poll_s=0.25)
    blocked = [True]
    wd.in_collective = lambda: blocked[0]
    clock.t += 4.0
    assert wd.check() is None  # waiting: the allowance applies
    blocked[0] = False
    clock.t += 2.5  # the collective completed; the update runs
    assert wd.check() is None
    clock.t += 1.0
    alarm = wd.check()  # hung after the collective, in Python: named as such, at the same limit
    assert alarm is not None and not alarm.in_collective and alarm.limit_s == pytest.approx(7.25)
    assert "after waiting in a collective" in alarm.describe()

    wd.step_done()  # the next step owes nothing to the last one's wait
    clock.t += 3.5
    assert wd.check().limit_s == pytest.approx(3.0)


def test_a_broken_probe_does_not_break_the_watchdog():
    wd, clock = trained()
    wd.in_collective = lambda: 1 / 0
    clock.t += 4
    assert wd.check() is not None


def test_settings_from_the_environment():
    assert not watchdog_from_env({"TRAINGUARD_WATCHDOG": "off"}).enabled
    c = watchdog_from_env({"TRAINGUARD_HANG_STEPS": "4", "TRAINGUARD_HANG_MIN_S": "5",
                           "TRAINGUARD_FIRST_STEP_TIMEOUT_S": "30"})
    assert (c.steps_factor, c.min_limit_s, c.first_step_s, c.first_section_s) == (4, 5, 30, 30)
    with pytest.raises(ConfigError, match="TRAINGUARD_HANG_MIN_S"):
        watchdog_from_env({"TRAINGUARD_HANG_MIN_S": "soon"})
    with pytest.raises(ConfigError, match="factors must be >= 1"):
        watchdog_from_env({"TRAINGUARD_HANG_STEPS": "0.5"})
    with pytest.raises(ConfigError, match="on or off"):
        watchdog_from_env({"TRAINGUARD_WATCHDOG": "maybe"})
