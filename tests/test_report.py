"""A picture of a run: the run directory's events, `trainguard report RUN_DIR`
(one PNG and a text summary) and `trainguard status --watch`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from conftest import WORKERS, run_job
from test_control_plane import FAST, Recording, run_ranks, train_to, wait_for
from trainguard.core import Controller, ControllerConfig, ControllerState, Processor, ProcessorConfig, ReplicaGroup
from trainguard.core.rank.watchdog import WatchdogConfig
from trainguard.report.timeline import RunDirError, load, summary

FAULT_RED = (0xD6, 0x28, 0x28)


def cli(*args, timeout=120):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    return subprocess.run([sys.executable, "-m", "trainguard.cli", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout)


def assert_picture(path: Path) -> None:
    """A PNG that decodes, of a readable size, with several colours and a fault marked in red."""
    from PIL import Image

    with Image.open(path) as img:
        assert img.format == "PNG"
        rgb = img.convert("RGB")
    assert rgb.width >= 800 and rgb.height >= 500
    colours = rgb.getcolors(maxcolors=1 << 20)
    assert len(colours) > 20, "a picture of a few flat colours"
    assert any(n > 30 and c == FAULT_RED for n, c in colours), "no fault drawn"


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("make, message", [
    (lambda d: d / "missing", "no run directory"),
    (lambda d: (d / "f.txt").write_text("x") and d / "f.txt", "is not a directory"),
    (lambda d: d, "no events.jsonl in"),
    (lambda d: (d / "events.jsonl").write_bytes(b"\x00\xffgarbage\n{not json\n[1,2]\n") and d,
     "holds no readable event"),
])
def test_a_missing_or_corrupt_run_directory_is_a_clear_error(tmp_path, make, message):
    target = make(tmp_path)
    with pytest.raises(RunDirError, match=message):
        load(target)
    out = cli("report", target)
    assert out.returncode == 1 and message in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "report.png").exists()


def test_unreadable_lines_are_skipped_and_counted(tmp_path):
    lines = [{"t": 100.0, "ev": "controller", "job_id": "j", "world_size": 1, "strategies": ["retry"]},
             {"t": 100.5, "ev": "rank", "rank": 0, "step": 0}, {"t": 100.5, "ev": "state", "state": "NORMAL"},
             {"t": 102.0, "ev": "steps", "steps": [4], "down": []},
             {"t": 103.0, "ev": "finished", "rank": 0, "step": 6}]
    text = "\n".join(json.dumps(x) for x in lines)
    (tmp_path / "events.jsonl").write_text(text.replace('"steps"', '"st\x00') + "\n{torn")
    tl = load(tmp_path)
    assert tl.skipped == 2 and tl.last_step() == 6
    assert "2 unreadable line(s)" in summary(tl)


# ------------------------------------------------- events of a live controller
def idle_rank(c: Controller, rank: int, world: int = 2) -> Processor:
    """A rank that may sit between steps on a busy machine (no hang watchdog)."""
    p = Processor(ProcessorConfig(controller=c.address, token=c.token, rank=rank, world_size=world,
                                  connect_timeout_s=5, watchdog=WatchdogConfig(enabled=False)),
                  force_exit=lambda code: None)
    p.connect(step=0, replicas=[ReplicaGroup.full(range(world))])
    return p


def test_controller_records_a_retry_and_the_report_draws_it(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    monkeypatch.setenv("TRAINGUARD_RUN_DIR", str(run_dir))
    with Controller(ControllerConfig(**FAST), 3) as c:
        procs = [idle_rank(c, r, world=3) for r in range(3)]
        wait_for(lambda: c.state is ControllerState.NORMAL)
        train_to(procs, 4)
        outcomes = run_ranks(procs, [Recording(r) for r in range(3)], {1: RuntimeError("UCE ERROR: bad HBM page")})
        assert all(o.resume for o in outcomes.values())
        train_to(procs, 6)
        for p in procs:
            p.close()
        wait_for(lambda: c.state is ControllerState.FINISHED)
        record = c.snapshot()["recoveries"][0]
    tl = load(run_dir)
    (ep,) = tl.episodes
    assert ep.outcome == "NORMAL" and ep.record["strategy"] == "retry" and ep.faults[0]["rank"] == 1
    assert [p["name"] for p in ep.phases] == ["clean", "rebuild", "repair", "rollback", "resume"]
    assert tl.finished == {0: 6, 1: 6, 2: 6} and tl.world_size == 3
    text = summary(tl)
    assert (f"uce on rank 1 at step {record['step']}: retry -> recovered" in text
            and f"lost {record['lost_steps']} steps" in text), text
    out = cli("report", run_dir, "--out", tmp_path / "timeline.png")
    assert out.returncode == 0, out.stderr
    assert "picture: " in out.stdout and "faults: 1" in out.stdout
    assert_picture(tmp_path / "timeline.png")


# ------------------------------------------------------ a real job, end to end
@pytest.mark.serial  # a real launch: 10-30 s on a busy 2-core machine
@pytest.mark.timeout(300)
def test_report_of_a_two_rank_job_with_a_fault(tmp_path):
    run_dir = tmp_path / "run"
    job = run_job(tmp_path, "uce", nproc=2, steps=12, save_every=4, fault="uce:rank=1,step=5,phase=backward",
                  script=WORKERS / "snapshot_train.py", env={"SNAP_STEP_SLEEP": "0.1"},
                  extra_args=["--run-dir", str(run_dir)])
    assert job.rc == 0, job
    (record,) = job.report["recoveries"]
    out = cli("report", run_dir)
    assert out.returncode == 0, out.stderr
    assert_picture(run_dir / "report.png")
    text = out.stdout
    assert f"{record['fault']} on rank {record['rank']} at step {record['step']}: {record['strategy']} -> " \
           f"recovered" in text, text
    assert f"lost {record['lost_steps']} steps" in text and f"{job.report['lost_steps']} steps recomputed" in text
    assert "1 launch (exit codes 0)" in text and "steps: 12 reached" in text
    saved = sorted(int(p.name.split("_")[1]) for p in job.ckpt.glob("step_*"))
    assert saved and f"checkpoints: {len(saved)} (steps {', '.join(map(str, saved))})" in text, text
    assert "snapshots: 12" in text  # snapshot_train takes one each step


# ------------------------------------------------------------ status --watch
class Watcher:
    """``trainguard status --watch`` in a subprocess; its output gathered as it comes."""

    def __init__(self, controller: Controller, *extra: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trainguard.cli", "status", "--controller", controller.address, "--token",
             controller.token, "--watch", "--interval", "0.2", *extra], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env=env)
        self.out: list[str] = []
        self._reader = threading.Thread(target=lambda: self.out.extend(iter(self.proc.stdout.readline, "")),
                                        daemon=True)
        self._reader.start()

    def tables(self) -> list[str]:
        return [t for t in "".join(self.out).split("\n\n") if t.startswith("job ")]

    def saw(self, steps: dict[int, int]) -> bool:
        def shows(table: str) -> bool:
            rows = {int(line.split()[0]): int(line.split()[1]) for line in table.splitlines()[2:]
                    if line.split() and line.split()[0].isdigit()}
            return all(rows.get(r) == s for r, s in steps.items())
        return any(shows(t) for t in self.tables())

    def finish(self, timeout: float = 30) -> tuple[int, str, str]:
        rc = self.proc.wait(timeout)
        self._reader.join(5)
        return rc, "".join(self.out), self.proc.stderr.read()


def test_watch_redraws_the_ranks_steps_and_ends_when_the_controller_stops():
    c = Controller(ControllerConfig(**FAST), 2)
    c.start()
    procs = [idle_rank(c, r) for r in range(2)]
    try:
        train_to(procs, 3)
        w = Watcher(c)
        wait_for(lambda: w.saw({0: 3, 1: 3}), timeout=30)
        train_to(procs, 7)
        wait_for(lambda: w.saw({0: 7, 1: 7}), timeout=30)
        assert "last fault: none" in w.tables()[-1] and "TRAINING" in w.tables()[-1]
    finally:
        for p in procs:
            p.close(finished=False)
        c.stop()
    rc, out, err = w.finish()
    assert rc == 3 and "went away while the job was" in out, (out, err)
    assert "Traceback" not in err


def test_watch_exits_0_when_the_job_finishes_and_1_when_nothing_answers():
    with Controller(ControllerConfig(**FAST), 2) as c:
        procs = [idle_rank(c, r) for r in range(2)]
        train_to(procs, 2)
        w = Watcher(c)
        wait_for(lambda: w.saw({0: 2, 1: 2}), timeout=30)
        for p in procs:
            p.close()
        rc, out, err = w.finish()
        address = c.address
    assert rc == 0 and "the job finished" in out and "FINISHED" in out, (out, err)
    out = cli("status", "--controller", address, "--token", "x" * 64, "--watch", "--interval", "0.2")
    assert out.returncode == 1 and "unreachable" in out.stderr and "Traceback" not in out.stderr


def test_the_watch_table_of_a_large_job_shows_the_ranks_that_stand_out():
    from trainguard.report.watch import render

    ranks = {str(r): {"pid": 100 + r, "host": "n", "step": 50, "run": "TRAINING", "data": "UPDATED", "alive": True}
             for r in range(40)}
    ranks["7"].update(step=41, run="STOPPED")
    ranks["9"].update(alive=False)
    snap = {"job_id": "j", "state": "ABNORMAL", "world_size": 41, "ranks": ranks,
            "episode": {"faults": ["rank 7: hang: stuck"], "plan": None, "reason": ""}}
    table = render(snap, address="h:1")
    rows = [line.split()[0] for line in table.splitlines() if line.split() and line.split()[0].isdigit()]
    assert rows == ["7", "9"], table
    assert "min 41  median 50  max 50" in table and "not registered: [40]" in table
    assert "last fault: now: rank 7: hang: stuck (deciding)" in table
