"""The RUN table and the processor's run status: every change is checked
(transitions.advance) under the processor's lock."""

import logging
import threading
import types
from unittest import mock

import pytest

from trainguard.core import FaultKind, RunStatus, Severity, TransitionError
from trainguard.core import transitions
from trainguard.core.rank import processor as processor_module
from trainguard.core.rank import standing as standing_module
from trainguard.core.rank.processor import Processor
from trainguard.core.commands import Clean, Command, Exit, Rebuild, Repair, Resume, Rollback, Stop
from trainguard.core.rank.recovery import Handlers, recover
from trainguard.core.transitions import RUN, advance, allowed

R = RunStatus


# ------------------------------------------------------------- the table
@pytest.mark.parametrize("current, new", [
    (R.STARTING, R.RECOVERING),  # a replacement process's first recovery command
    (R.STARTING, R.STOPPED),     # an offline processor's fault report
    (R.STOPPED, R.STOPPED),      # a second STOP while stopped
])
def test_widened_run_transitions_are_allowed(current, new):
    assert advance(current, new, what="rank 0") is new


@pytest.mark.parametrize("current, new", [
    (R.FINISHED, R.TRAINING),
    (R.EXITING, R.TRAINING),
    (R.EXITING, R.FINISHED),
    (R.FINISHED, R.STOPPED),
    (R.TRAINING, R.RECOVERING),  # a recovery command needs the step left first
    (R.TRAINING, R.TRAINING),
    (R.RECOVERING, R.RECOVERING),
    (R.STARTING, R.STARTING),
])
def test_clearly_illegal_run_transitions_still_raise(current, new):
    with pytest.raises(TransitionError, match=f"rank 2: illegal RunStatus transition {current.name} -> {new.name}"):
        advance(current, new, what="rank 2")


def test_every_live_state_may_exit_and_the_ends_are_final():
    for state in (R.STARTING, R.TRAINING, R.STOPPED, R.RECOVERING):
        assert allowed(state, R.EXITING), state
    assert RUN[R.EXITING] == frozenset() and RUN[R.FINISHED] == frozenset()
    assert set(RUN) == set(RunStatus)


# ------------------------------------------------------------- the processor
class _Recorder:
    """Wraps advance (its standing's, for the processor's data status, and
    the one its locked run status calls): records each change and whether the
    processor's run-status lock was held while it was checked."""

    def __init__(self, processor):
        self.processor, self.seen = processor, []

    def __call__(self, current, new, *, what=""):
        self.seen.append((current, new, self.processor._run.lock.locked()))
        return advance(current, new, what=what)


@pytest.fixture
def recorded(monkeypatch):
    p = Processor(None, rank=0)
    rec = _Recorder(p)
    monkeypatch.setattr(standing_module, "advance", rec)
    monkeypatch.setattr(transitions, "advance", rec)
    return p, rec


def _changes(rec):
    return [(a, b) for a, b, _ in rec.seen if isinstance(a, RunStatus)]


def test_the_run_status_cannot_be_assigned_directly():
    p = Processor(None, rank=0)
    assert p.run is R.STARTING
    with pytest.raises(AttributeError):
        p.run = R.TRAINING


def test_processor_changes_go_through_advance_under_the_lock(recorded):
    p, rec = recorded
    p.report_fault(FaultKind.UCE, Severity.HIGH, "injected")
    p.report_stopped()
    p.resumed()
    p.report_stopped()
    assert _changes(rec) == [(R.STARTING, R.STOPPED), (R.STOPPED, R.STOPPED), (R.STOPPED, R.TRAINING),
                             (R.TRAINING, R.STOPPED)]
    assert all(locked for a, _, locked in rec.seen if isinstance(a, RunStatus))
    assert p.run is R.STOPPED


def test_an_illegal_set_run_raises_and_names_the_rank():
    p = Processor(None, rank=5)
    p.set_run(R.TRAINING, "registered")
    with pytest.raises(TransitionError, match="rank 5 clean command: illegal RunStatus transition TRAINING -> RECOVERING"):
        p.set_run(R.RECOVERING, "clean command")
    assert p.run is R.TRAINING


def test_set_run_waits_for_the_lock():
    p = Processor(None, rank=0)
    done = threading.Event()
    with p._run.lock:
        t = threading.Thread(target=lambda: (p.set_run(R.TRAINING, "registered"), done.set()))
        t.start()
        assert not done.wait(0.2), "set_run changed the state while another thread held the lock"
        assert p.run is R.STARTING
    t.join(5)
    assert done.is_set() and p.run is R.TRAINING


def test_concurrent_reports_each_check_the_state_they_change():
    p = Processor(None, rank=0)
    p.set_run(R.TRAINING, "registered")
    errors = []

    def stop():
        try:
            p.report_stopped()
        except Exception as e:  # pragma: no cover - the failure this test looks for
            errors.append(e)

    threads = [threading.Thread(target=stop) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert not errors and p.run is R.STOPPED


def test_an_illegal_report_on_a_background_thread_is_logged_and_still_sent(caplog):
    p = Processor(None, rank=3)
    p._call = object()  # a session: _post queues the message
    p.set_run(R.TRAINING, "registered")
    p.set_run(R.EXITING, "exit command")
    caplog.set_level(logging.ERROR, logger="trainguard.processor")
    t = threading.Thread(target=p.report_fault, args=(FaultKind.HANG, Severity.HIGH, "late"))
    t.start()
    t.join(5)
    assert "rank 3 fault report: illegal RunStatus transition EXITING -> STOPPED" in caplog.text
    assert p.run is R.EXITING
    msg = p._outbox.get_nowait()
    assert msg.fault.message == "late" and msg.fault.status.run == R.EXITING.value


def _connected(p):
    """A processor that looks connected, with no network under it."""
    p._call, p._channel, p._reader = mock.Mock(), mock.Mock(), None
    p._welcome.set()
    return p


def test_close_after_training_says_goodbye_as_finished(recorded):
    p, rec = recorded
    _connected(p)
    p.set_run(R.TRAINING, "registered")
    p.close()
    assert p.run is R.FINISHED and (R.TRAINING, R.FINISHED) in _changes(rec)
    goodbye = p._outbox.get_nowait()
    assert goodbye.goodbye.status.run == R.FINISHED.value


def test_close_as_finished_mid_recovery_ends_the_session_without_a_goodbye_then_raises():
    p = _connected(Processor(None, rank=1))
    p.set_run(R.TRAINING, "registered")
    p.set_run(R.STOPPED, "stop answer")
    p.set_run(R.RECOVERING, "clean command")
    with pytest.raises(TransitionError, match="RECOVERING -> FINISHED"):
        p.close()
    assert p._call is None, "the session ended all the same"
    assert p._outbox.get_nowait() is processor_module._CLOSE
    assert p.run is R.RECOVERING


def test_close_not_finished_leaves_the_status():
    p = _connected(Processor(None, rank=1))
    p.set_run(R.TRAINING, "registered")
    p.set_run(R.STOPPED, "stop answer")
    p.close(finished=False)
    assert p.run is R.STOPPED


# ------------------------------------------------------------- recover
class _Handlers(Handlers):
    def __init__(self):
        self.calls = []

    def clean(self, uce):
        self.calls.append("clean")
        return 0

    def rebuild(self, generation, ranks, join_store=""):
        self.calls.append("rebuild")

    def repair(self, step, transfers):
        self.calls.append("repair")

    def rollback(self, step):
        self.calls.append("rollback")

    def save(self, step, kind):
        return []

    def finalize(self, step, shards, history, own=()):
        pass


def _commanded(p, *commands):
    p.config = types.SimpleNamespace()  # next_command refuses an offline processor
    for i, action in enumerate(commands, 1):
        p._commands.put(Command(i, 1, action))
    return p


def test_a_recovery_walks_the_table(recorded):
    p, rec = recorded
    p.set_run(R.TRAINING, "registered")
    p.report_fault(FaultKind.COMM, Severity.HIGH, "peer gone")
    _commanded(p, Stop(reason="another rank's fault"), Clean(), Rebuild(generation=1), Resume(step=4))
    outcome = recover(p, _Handlers())
    assert outcome.resume and outcome.step == 4
    assert _changes(rec) == [
        (R.STARTING, R.TRAINING), (R.TRAINING, R.STOPPED),  # registered, fault reported
        (R.STOPPED, R.STOPPED),                              # the second STOP
        (R.STOPPED, R.RECOVERING), (R.RECOVERING, R.STOPPED),  # clean
        (R.STOPPED, R.RECOVERING), (R.RECOVERING, R.STOPPED),  # rebuild
        (R.STOPPED, R.TRAINING),                             # resume
    ]
    assert all(locked for a, _, locked in rec.seen if isinstance(a, RunStatus))


def test_a_replacement_process_recovers_from_starting(recorded):
    p, rec = recorded
    _commanded(p, Rebuild(generation=2), Repair(step=3), Rollback(step=3), Resume(step=3, pids_json="{}"))
    handlers = _Handlers()
    assert recover(p, handlers).resume
    assert handlers.calls == ["rebuild", "repair", "rollback"]
    assert _changes(rec)[0] == (R.STARTING, R.RECOVERING)
    assert p.run is R.TRAINING


def test_an_exit_command_to_a_replacement_with_nothing_to_join(recorded):
    p, rec = recorded
    _commanded(p, Exit(code=3, reason="no recovery is waiting for this process"))
    outcome = recover(p, _Handlers())
    assert not outcome.resume and outcome.exit_code == 3
    assert _changes(rec) == [(R.STARTING, R.EXITING)]
