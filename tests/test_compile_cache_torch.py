"""torch.compile under the Guard: restarted processes compile warm from the
job's compile cache, end bit-identical to a run that compiled everything
itself, and never use an entry made for other settings or damaged.

Real jobs (2 ranks, gloo) of ``tests/workers/compiled_train.py``; every
rank writes its report, whose ``compile_cache`` shows trainguard's lookup
and torch's own FX graph / AOTAutograd cache hits and misses."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from conftest import WORKERS, _assert_no_stray_processes, run_job
from trainguard.adapters.torch.compile_cache import key_parts
from trainguard.core.compile_cache import MANIFEST, CompileCache, Lookup, cache_key

SCRIPT = WORKERS / "compiled_train.py"
STEPS = 6


def run(tmp: Path, name: str, cache: Path, **kwargs):
    env = {"TRAINGUARD_COMPILE_CACHE": str(cache), **kwargs.pop("env", {})}
    return run_job(tmp, name, nproc=2, steps=STEPS, script=SCRIPT, env=env, **kwargs)


def reports(job, tmp: Path, name: str) -> list[dict]:
    return [job.report, json.loads((tmp / f"{name}.json.rank1").read_text())]


def entry_is_valid(cache: Path) -> bool:
    [entry] = [p for p in cache.iterdir() if not p.name.startswith(".")]
    parts = json.loads((entry / MANIFEST).read_text())["parts"]
    reader = CompileCache(cache, parts)
    return reader.key == entry.name and reader.restore(cache.parent / f"check-{entry.name}") is Lookup.HIT


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    """A fault-free run that compiles everything itself (an empty cache)."""
    tmp = tmp_path_factory.mktemp("compiled-first")
    job = run(tmp, "first", tmp / "cache")
    assert job.rc == 0 and job.report is not None, job
    _assert_no_stray_processes(tmp)
    return tmp, job, reports(job, tmp, "first")


@pytest.mark.timeout(120)
def test_two_ranks_compiling_at_once_leave_one_valid_entry(first):
    tmp, job, (r0, r1) = first
    for r in (r0, r1):
        assert r["compile_cache"]["state"] == "miss", job
        assert r["compile_cache"]["torch"]["fxgraph_cache_miss"] > 0  # it compiled
        assert r["compile_cache"]["torch"]["fxgraph_cache_hit"] == 0
    assert sorted([r0["compile_cache"]["published"], r1["compile_cache"]["published"]]) == [0, 1]
    assert r0["compile_cache"]["publish_lost"] + r1["compile_cache"]["publish_lost"] == 1
    assert entry_is_valid(tmp / "cache")
    assert not list((tmp / "cache").glob(".tmp-*"))


@pytest.mark.timeout(150)
def test_relaunch_after_a_crash_compiles_warm_and_ends_bit_identical(tmp_path, first):
    cache = tmp_path / "cache"
    crashed = run(tmp_path, "crash", cache, fault="crash:rank=1,step=3", strategies="dump,exit")
    assert crashed.rc == 75, crashed
    assert entry_is_valid(cache)  # published after the first step, before the crash
    again = run(tmp_path, "relaunch", cache, ckpt=crashed.ckpt)
    assert again.rc == 0, again
    for r in reports(again, tmp_path, "relaunch"):
        cc = r["compile_cache"]
        assert cc["state"] == "hit" and cc["hits"] == 1 and cc["restored"]["files"] > 0, again
        assert cc["torch"]["fxgraph_cache_hit"] > 0 and cc["torch"]["fxgraph_cache_miss"] == 0, cc
        assert cc["torch"]["autograd_cache_hit"] > 0 and cc["torch"]["autograd_cache_miss"] == 0, cc
    assert again.report["steps_completed"] == STEPS and again.report["lost_steps"] == 0
    assert again.report["final_state_sha256"] == first[1].report["final_state_sha256"]


@pytest.mark.timeout(150)
def test_a_process_restarted_in_place_compiles_warm(tmp_path, first):
    shutil.copytree(first[0] / "cache", tmp_path / "cache")  # the job's earlier launch compiled already
    job = run(tmp_path, "in-place", tmp_path / "cache", fault="crash:rank=1,step=3",
              strategies="recover-in-place,dump,exit", extra_args=["--max-restarts", "1"])
    assert job.rc == 0, job
    survivor, replacement = reports(job, tmp_path, "in-place")
    assert len(survivor["pids"]["0"]) == 1 and len(survivor["pids"]["1"]) == 2  # only rank 1 was restarted
    assert replacement["compile_cache"]["state"] == "hit", job
    assert replacement["compile_cache"]["torch"]["fxgraph_cache_miss"] == 0
    assert replacement["compile_cache"]["torch"]["fxgraph_cache_hit"] > 0
    assert job.report["final_state_sha256"] == first[1].report["final_state_sha256"]


def _truncate_largest(entry: Path) -> None:
    biggest = max((p for p in (entry / "files").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])


def _other_torch(entry: Path) -> None:
    manifest = json.loads((entry / MANIFEST).read_text())
    manifest["parts"]["torch"] = "2.12.0"
    (entry / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.timeout(150)
@pytest.mark.parametrize("damage, says", [pytest.param(_truncate_largest, "truncated", marks=pytest.mark.slow),
                                          (_other_torch, "torch='2.12.0' (this process: '2.13")])
def test_a_damaged_or_foreign_entry_is_not_used(tmp_path, first, damage, says):
    cache = tmp_path / "cache"
    shutil.copytree(first[0] / "cache", cache)
    [entry] = [p for p in cache.iterdir() if not p.name.startswith(".")]
    damage(entry)
    job = run(tmp_path, "damaged", cache)
    assert job.rc == 0, job
    for r in reports(job, tmp_path, "damaged"):
        cc = r["compile_cache"]
        assert cc["state"] == "invalid" and says in cc["reason"], cc
        assert cc["torch"]["fxgraph_cache_hit"] == 0 and cc["torch"]["fxgraph_cache_miss"] > 0, cc
    warned = [line for line in job.log.splitlines() if re.search(r"WARNING.*compile cache not used", line)]
    assert len(warned) == 1 and says in warned[0], job  # one warning for the job (rank 0); rank 1 logs INFO
    assert job.report["final_state_sha256"] == first[1].report["final_state_sha256"]
    assert entry_is_valid(cache)  # rebuilt


def test_the_key_tells_models_and_torch_versions_apart():
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    b = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Tanh(), torch.nn.Linear(48, 1))
    c = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    cpu = torch.device("cpu")
    key = cache_key(key_parts(a, cpu, {"batch": [16, 32]}))
    assert key == cache_key(key_parts(torch.compile(a)._orig_mod, cpu, {"batch": [16, 32]}))
    assert key != cache_key(key_parts(b, cpu, {"batch": [16, 32]}))  # other shapes
    assert key != cache_key(key_parts(c, cpu, {"batch": [16, 32]}))  # other module classes
    assert key != cache_key(key_parts(a, cpu, {"batch": [8, 32]}))  # other configuration
    assert key != cache_key(key_parts(a, cpu, {"batch": [16, 32]}, torch_version="2.12.0"))
