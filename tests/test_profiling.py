"""Profiling switch, record files, detection and the slow-nodes CLI, in one process."""

import json
import logging
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainguard.core import ConfigError
from trainguard.core.profiling import Detector, ProfilingConfig, Recorder, Switch, SwitchFile, parse_switch
from trainguard.core.profiling.files import GROUPS_FILE, RankFiles, numbered_files
from trainguard.core.profiling.live import LiveDetector
from trainguard.core.profiling.records import StepRow, find_job_dir, rows_from_records

ALL_ON = '{"CommunicationOperator":"on","Step":"on","SaveCheckpoint":"on","FP":"on","DataLoader":"on"}'
NO_COMM = '{"CommunicationOperator":"off","Step":"on","SaveCheckpoint":"on","FP":"on","DataLoader":"on"}'


def test_switch_rules():
    assert parse_switch(ALL_ON) == Switch(markers=True, communication=True)
    assert parse_switch(NO_COMM) == Switch(markers=True, communication=False)
    assert parse_switch("{}") == Switch()
    for text, words in [
        ("{not json", "not JSON"),
        ("[1]", "JSON object"),
        ('{"Step":"on","FP":"off","DataLoader":"on","SaveCheckpoint":"on"}', "switch together"),
        ('{"CommunicationOperator":"on"}', "Communication"),
        ('{"Step":"yes"}', "must be"),
        ('{"Stepp":"on"}', "unknown key"),
    ]:
        with pytest.raises(ConfigError, match=words):
            parse_switch(text)


def test_switch_file_logs_one_line_per_problem(tmp_path, caplog):
    path = tmp_path / "profilingSwitch"
    switch = SwitchFile(path, rank=0)
    caplog.set_level(logging.INFO, logger="trainguard.profiling")
    for _ in range(3):
        assert switch.poll() == Switch()
    path.write_text(ALL_ON)
    assert switch.poll() == Switch(True, True)
    path.write_text('{"Step": on}')  # malformed
    for _ in range(5):
        assert switch.poll() == Switch()
        os.utime(path)  # touched again: re-read, same problem
    path.write_text(NO_COMM + " ")
    assert switch.poll() == Switch(True, False)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("does not exist" in m for m in messages) == 1
    assert sum("unusable" in m for m in messages) == 1, messages
    assert sum("profiling switch:" in m for m in messages) == 2


def test_new_file_past_size_and_ageing_keeps_foreign_files(tmp_path):
    clock = iter(range(1_700_000_000, 1_800_000_000)).__next__
    files = RankFiles(tmp_path, "job", 0, file_bytes=1000, cap_bytes=20_000, clock=clock)
    other = RankFiles(tmp_path, "job", 1, file_bytes=1000, cap_bytes=10 ** 9, clock=clock)
    line = b"x" * 99 + b"\n"
    for _ in range(10):
        other.append(line * 10)
    foreign = [files.dir / "notes.txt", files.dir / "123abc", tmp_path / "job" / "README"]
    files.dir.mkdir(parents=True)
    for path in foreign:
        path.write_bytes(b"keep me" * 100)
    files.write_groups({"0": {"global_ranks": [0, 1]}})
    for _ in range(100):
        files.append(line * 2)  # a new file every 5 appends (past 1000 bytes)
    names = [int(p.name) for p in numbered_files(files.dir)]
    assert len(names) == 20 and names == sorted(names) and len(set(names)) == 20
    assert files.age() == 4  # 20% of 20, oldest first
    assert [int(p.name) for p in numbered_files(files.dir)] == names[4:]
    while files.age():
        pass
    assert len(numbered_files(files.dir)) == 7  # under the cap again: ageing stops
    files.cap_bytes = 1  # other files alone fill the cap: still at least three kept
    while files.age():
        pass
    assert len(numbered_files(files.dir)) == 3
    assert all(p.read_bytes() == b"keep me" * 100 for p in foreign)
    assert (files.dir / GROUPS_FILE).exists()
    assert len(numbered_files(other.dir)) == 10  # another rank's files are never touched
    under_cap = RankFiles(tmp_path, "job", 0, cap_bytes=10 ** 9)
    assert under_cap.age() == 0


def test_recorder_writes_ndjson_and_follows_the_switch(tmp_path):
    switch = tmp_path / "switch.json"
    config = ProfilingConfig(directory=tmp_path / "prof", switch_path=switch, job_id="j", rank=3)
    rec = Recorder(config)
    assert not rec.markers
    switch.write_text(NO_COMM)
    rec.apply(rec.switch.poll())
    assert rec.markers and not rec.communication
    with rec.span("SaveCheckpoint", 7):
        time.sleep(0.01)
    rec.add("Communication", 7, 100.0, 0.5, {"op": "allreduce", "group": "0", "bytes": 4})
    rec.add("Step", 7, 99.0, 2.0)
    rec.group("0", [0, 1, 2, 3], "gloo")
    rec.flush()
    (path,) = numbered_files(tmp_path / "prof" / "j" / "3")
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["name"] for r in records] == ["SaveCheckpoint", "Communication", "Step"]
    assert records[0]["rank"] == 3 and records[0]["step"] == 7 and records[0]["dur"] >= 0.01
    assert records[1]["op"] == "allreduce"
    assert json.loads((path.parent / GROUPS_FILE).read_text())["0"]["global_ranks"] == [0, 1, 2, 3]
    row = rows_from_records(records)[7]
    assert row.step_s == 2.0 and row.comm_s == 0.5 and row.compute_s == 1.5 and row.save_s >= 0.01
    rec.close()


def test_config_from_env(tmp_path):
    env = {"TRAINGUARD_PROFILING_DIR": str(tmp_path), "MINDX_TASK_ID": "task-7", "TRAINGUARD_JOB_ID": "tg"}
    config = ProfilingConfig.from_env(rank=0, started_at=5.0, environ=env)
    assert config.job_id == "task-7" and config.switch_path == tmp_path / "profilingSwitch"
    assert ProfilingConfig.from_env(rank=0, started_at=5.0, environ={}) is None
    plain = ProfilingConfig.from_env(rank=0, started_at=1234.5, environ={"TRAINGUARD_PROFILING_DIR": "x"})
    assert plain.job_id == "default_task_id_1234"
    with pytest.raises(ConfigError, match="CAP_MB"):
        ProfilingConfig.from_env(rank=0, started_at=0, environ={**env, "TRAINGUARD_PROFILING_CAP_MB": "lots"})
    with pytest.raises(ConfigError, match="job id"):
        ProfilingConfig(directory=tmp_path, switch_path=tmp_path, job_id="a/b", rank=0)
    # The controller follows the ranks' records by the ranks' rule, its own job id last.
    assert ProfilingConfig.job_dir_from_env("tg", {}) is None
    assert ProfilingConfig.job_dir_from_env("ctl", env) == tmp_path / "task-7"
    assert ProfilingConfig.job_dir_from_env("ctl", {"TRAINGUARD_PROFILING_DIR": str(tmp_path)}) == tmp_path / "ctl"


def synthetic_rows(steps: int, ranks: int, slow: int | None, factor: float, onset: int, seed: int):
    """Per-step rows of a synchronous job: each rank computes ~10 ms with
    5% noise; everybody's step lasts as long as the slowest rank's compute
    plus 2 ms of transfer, the rest of it waiting."""
    rnd = random.Random(seed)
    out = {r: {} for r in range(ranks)}
    for s in range(steps):
        compute = {r: 0.010 * rnd.lognormvariate(0, 0.05) * (factor if r == slow and s >= onset else 1.0)
                   for r in range(ranks)}
        step = max(compute.values()) + 0.002
        for r in range(ranks):
            row = StepRow(s, step_s=step, fp_s=compute[r] / 3, has_step=True)
            row.comm_spans.append((0.0, step - compute[r]))
            out[r][s] = row
    return out


@pytest.mark.parametrize("factor,limit", [(1.3, 10), (1.1, 100)])
def test_detector_names_the_slow_rank(factor, limit):
    from trainguard.core.profiling.report import run_detector

    for seed in range(5):
        detector = run_detector(synthetic_rows(300, 4, 2, factor, 80, seed))
        assert sorted(detector.slow) == [2], (seed, [f.reason for f in detector.findings])
        assert 80 <= detector.slow[2].step <= 80 + limit


def test_detector_quiet_without_a_slow_rank():
    from trainguard.core.profiling.report import run_detector

    detector = run_detector(synthetic_rows(3000, 4, None, 1.0, 0, 11))
    assert detector.slow == {}


def record_lines(rank: int, s: int, row: StepRow) -> str:
    """What a rank writes for one step: FP, Communication, then Step."""
    lines = [{"name": "FP", "rank": rank, "step": s, "start": 0.0, "dur": row.fp_s}]
    lines += [{"name": "Communication", "rank": rank, "step": s, "start": a, "dur": b - a} for a, b in row.comm_spans]
    lines.append({"name": "Step", "rank": rank, "step": s, "start": 0.0, "dur": row.step_s})
    return "".join(json.dumps(x) + "\n" for x in lines)


def write_job(root: Path, rows: dict) -> Path:
    for rank, by_step in rows.items():
        d = root / "job" / str(rank)
        d.mkdir(parents=True)
        text = "".join(record_lines(rank, s, row) for s, row in by_step.items())
        (d / "1700000000").write_text(text + '{"name": "Step", "ste')  # a line still being written
    return root / "job"


def test_slow_nodes_cli(tmp_path):
    write_job(tmp_path, synthetic_rows(200, 3, 1, 1.3, 50, 3))
    cli = [sys.executable, "-m", "trainguard.cli", "slow-nodes"]
    out = subprocess.run(cli + [str(tmp_path), "--plot", str(tmp_path / "p.png")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "slow ranks: 1" in out.stdout and "SLOW" in out.stdout
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads(subprocess.run(cli + [str(tmp_path / "job"), "--json"], capture_output=True,
                                       text=True, check=True).stdout)
    assert result["slow_ranks"] == [1] and result["findings"][0]["how"] == "cross-rank"
    assert result["per_rank"]["1"]["compute_ms"] > 1.2 * result["per_rank"]["0"]["compute_ms"]
    assert result["unreadable_lines"] == 0  # the torn last line is left for a later read, not parsed
    (tmp_path / "other" / "0").mkdir(parents=True)
    (tmp_path / "other" / "0" / "1").write_text("")
    bad = subprocess.run(cli + [str(tmp_path)], capture_output=True, text=True)
    assert bad.returncode == 2 and "several jobs" in bad.stderr
    missing = subprocess.run(cli + [str(tmp_path / "nope")], capture_output=True, text=True)
    assert missing.returncode == 2 and "not a directory" in missing.stderr
    with pytest.raises(ConfigError, match="no profiling records"):
        find_job_dir(tmp_path / "job" / "0")


def test_live_detector_follows_growing_files(tmp_path):
    rows = synthetic_rows(200, 2, 0, 1.3, 40, 5)
    job = tmp_path / "job"
    live = LiveDetector(job, 2, poll_s=0.1)
    assert live.poll() == []  # nothing written yet
    done = 0
    for upto in (30, 90, 200):
        for rank, by_step in rows.items():
            (job / str(rank)).mkdir(parents=True, exist_ok=True)
            with open(job / str(rank) / "1700000000", "a") as f:
                f.write("".join(record_lines(rank, s, by_step[s]) for s in range(done, upto)))
        done = upto
        found = live.poll()
        if upto == 30:
            assert found == [] and live.status()["steps_compared"] == 30
    status = live.status()
    assert status["slow_ranks"] == [0] and status["steps_compared"] == 200, status
    assert json.loads((job / "slow_nodes.json").read_text())["slow_ranks"] == [0]
