"""Profiling markers and slow-node detection on real `trainguard run` jobs (gloo, CPU).

Two ranks: this machine has two cores, and a second process per core makes
the ranks' own timings noise. Each step sleeps 75 ms besides ~25 ms of CPU
work, standing for device time (the host waits for its accelerator): on
two shared CPU cores alone, one rank's compute drifts 20% from the other's
for seconds at a time with nothing slow (see bench/slow_nodes.py)."""

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import WORKERS, run_job
from trainguard.core.profiling.files import GROUPS_FILE, numbered_files

SCRIPT = WORKERS / "profiled_train.py"
ALL_ON = '{"CommunicationOperator":"on","Step":"on","SaveCheckpoint":"on","FP":"on","DataLoader":"on"}'
NO_COMM = '{"CommunicationOperator":"off","Step":"on","SaveCheckpoint":"on","FP":"on","DataLoader":"on"}'
ALL_OFF = '{"CommunicationOperator":"off","Step":"off","SaveCheckpoint":"off","FP":"off","DataLoader":"off"}'


def records(job_dir: Path) -> dict[int, list[dict]]:
    out = {}
    for rank_dir in sorted(p for p in job_dir.iterdir() if p.is_dir()):
        out[int(rank_dir.name)] = [json.loads(line) for path in numbered_files(rank_dir)
                                   for line in path.read_text().splitlines()]
    return out


def test_switch_toggles_markers_while_the_job_runs(tmp_path):
    prof, progress = tmp_path / "prof", tmp_path / "progress"
    prof.mkdir()
    switch = prof / "profilingSwitch"
    switch.write_text('{"Step": on')  # malformed: all off, said once
    marks: dict[str, float] = {}

    def toggle() -> None:
        deadline = time.time() + 60
        while time.time() < deadline and not (progress.exists() and progress.read_text().strip().isdigit()
                                               and int(progress.read_text()) >= 5):
            time.sleep(0.05)
        time.sleep(1.0)  # polls of the malformed file go by
        for name, text in (("markers", NO_COMM), ("comm", ALL_ON), ("off", ALL_OFF)):
            marks[name] = time.time()
            tmp = prof / "profilingSwitch.new"  # replaced whole, as a ConfigMap update does: a poll
            tmp.write_text(text)                # between truncate and write would read an empty file
            tmp.replace(switch)
            time.sleep(3.0)

    toggler = threading.Thread(target=toggle)
    toggler.start()
    job = run_job(tmp_path, "toggle", nproc=2, steps=700, script=SCRIPT, save_every=100, timeout=120,
                  env={"TRAINGUARD_PROFILING_DIR": str(prof), "TRAINGUARD_JOB_ID": "toggle",
                       "PROF_PROGRESS": str(progress), "PROF_SLEEP": "0.02", "PROF_WIDTH": "128"})
    toggler.join()
    assert job.rc == 0, job
    assert set(marks) == {"markers", "comm", "off"}, "the job ended before the switch was toggled"
    assert job.log.count("is unusable, all markers off") == 1, job  # one line, though polled many times
    by_rank = records(prof / "toggle")
    assert sorted(by_rank) == [0, 1]
    for rank, recs in by_rank.items():
        names = {r["name"] for r in recs}
        assert names == {"Step", "FP", "DataLoader", "SaveCheckpoint", "Communication"}, (rank, names)
        starts = [r["start"] for r in recs]
        assert marks["markers"] <= min(starts) <= marks["markers"] + 2.0  # on within 2 s, nothing before
        comm = [r for r in recs if r["name"] == "Communication"]
        assert marks["comm"] <= min(r["start"] for r in comm) <= marks["comm"] + 2.0
        assert max(starts) <= marks["off"] + 2.0  # off within 2 s
        groups = {r["group"] for r in comm}
        assert "0" in groups and "trainguard-g0" in groups  # plain dist.all_reduce and DDP's, each once
        per_step = {}
        for r in comm:
            per_step.setdefault((r["step"], r["group"]), []).append(r)
        assert all(len(v) == 1 for (_, g), v in per_step.items() if g == "0")
        mapping = json.loads((prof / "toggle" / str(rank) / GROUPS_FILE).read_text())
        assert mapping["0"]["global_ranks"] == [0, 1] and mapping["trainguard-g0"]["global_ranks"] == [0, 1]
    assert job.report["profiling"]["records_written"] > 0


def slow_nodes(directory: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "trainguard.cli", "slow-nodes", str(directory), "--json"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


# CI runs the 1.3x case; bench/slow_nodes.py measures all three over 20 seeded trials each.
@pytest.mark.parametrize("factor,within", [(1.3, 10), pytest.param(1.1, 100, marks=pytest.mark.slow),
                                           pytest.param(None, None, marks=pytest.mark.slow)])
def test_detection_on_real_runs(tmp_path, factor, within):
    prof = tmp_path / "prof"
    prof.mkdir()
    (prof / "profilingSwitch").write_text(ALL_ON)
    onset = 30
    fault = f"slow:rank=1,step={onset},factor={factor}" if factor else None
    job = run_job(tmp_path, "slow", nproc=2, steps=onset + 110, script=SCRIPT, fault=fault, timeout=150,
                  env={"TRAINGUARD_PROFILING_DIR": str(prof), "TRAINGUARD_JOB_ID": "slow", "PROF_WIDTH": "1024", "PROF_SLEEP": "0.075"})
    assert job.rc == 0, job
    result = slow_nodes(prof)
    live = json.loads((prof / "slow" / "slow_nodes.json").read_text()) if factor else None  # written on findings
    if factor is None:
        assert result["slow_ranks"] == [], result["findings"]
        assert "slow node:" not in job.log
        return
    assert result["slow_ranks"] == [1], result["findings"]
    found = next(f for f in result["findings"] if f["rank"] == 1)
    assert onset <= found["step"] <= onset + within, found
    assert result["per_rank"]["1"]["comm_wait_ms"] < result["per_rank"]["0"]["comm_wait_ms"]  # waits least
    # the controller's live check named the same rank while the job ran
    assert live["slow_ranks"] == [1], live
    assert "slow node: step" in job.log


def test_markers_leave_the_numbers_alone(tmp_path):
    prof = tmp_path / "prof"
    prof.mkdir()
    (prof / "profilingSwitch").write_text(ALL_ON)
    plain = run_job(tmp_path, "plain", nproc=2, steps=20, script=SCRIPT, save_every=10, env={"PROF_WIDTH": "64"})
    marked = run_job(tmp_path, "marked", nproc=2, steps=20, script=SCRIPT, save_every=10,
                     env={"PROF_WIDTH": "64", "TRAINGUARD_PROFILING_DIR": str(prof), "TRAINGUARD_JOB_ID": "m"})
    assert plain.rc == 0 and marked.rc == 0, (plain, marked)
    assert marked.report["final_state_sha256"] == plain.report["final_state_sha256"]
    assert "profiling" not in plain.report
    counts = marked.report["profiling"]["by_name"]
    assert counts["Step"] == 20 and counts["SaveCheckpoint"] == 2 and counts["FP"] == 20, counts
