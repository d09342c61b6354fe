"""MindSpore graph mode under the Guard: trainguard points MindSpore's own
compile cache (``MS_COMPILER_CACHE_ENABLE`` / ``MS_COMPILER_CACHE_PATH``)
at a private directory per rank filled from the job's entry, so a relaunch
loads its graphs instead of compiling them and ends bit-identical.

MindSpore is never imported into the test process: every job is a subprocess."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from conftest import WORKERS, _assert_no_stray_processes
from ms_jobs import run_ms
from trainguard.core.compile_cache import MANIFEST, CompileCache, Lookup

if importlib.util.find_spec("mindspore") is None:  # find_spec does not import it
    pytest.skip("mindspore is not installed", allow_module_level=True)

USED = "Use the compilation cache"  # MindSpore's own log line when it loads cached graphs


def run(tmp: Path, name: str, cache: Path):
    return run_ms(tmp, name, script=WORKERS / "ms_model_train.py", steps=3,
                  env={"TEST_MS_MODE": "graph", "TRAINGUARD_COMPILE_CACHE": str(cache)})


def worker_logs(tmp: Path, name: str) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted((tmp / f"{name}-logs").glob("worker_*.log")))


@pytest.mark.timeout(240)
def test_a_relaunch_loads_its_graphs_from_the_job_cache(tmp_path):
    cache = tmp_path / "cache"
    cold = run(tmp_path, "cold", cache)
    assert cold.rc == 0 and cold.report is not None, cold
    cc = cold.report["compile_cache"]
    assert cc["state"] == "miss" and cc["published"] == 1, cc
    assert cc["mindspore"]["graph_files_after_first_step"] >= 1, cc
    assert USED not in worker_logs(tmp_path, "cold")
    entries = sorted(p for p in cache.iterdir() if not p.name.startswith("."))
    assert len(entries) == 2  # one per rank, as MindSpore keeps its cache
    for entry in entries:
        parts = json.loads((entry / MANIFEST).read_text())["parts"]
        assert parts["mode"] == "graph" and parts["framework"] == "mindspore"
        assert CompileCache(cache, parts).restore(tmp_path / f"check-{entry.name}") is Lookup.HIT

    warm = run(tmp_path, "warm", cache)
    assert warm.rc == 0 and warm.report is not None, warm
    cc = warm.report["compile_cache"]
    assert cc["state"] == "hit" and cc["restored"]["files"] >= 2 and cc["published"] == 0, cc
    assert worker_logs(tmp_path, "warm").count(USED) >= 2  # both ranks loaded their graphs
    assert warm.report["steps_completed"] == cold.report["steps_completed"] == 6
    assert warm.report["final_state_sha256"] == cold.report["final_state_sha256"]
    _assert_no_stray_processes(tmp_path)
