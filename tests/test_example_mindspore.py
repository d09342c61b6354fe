"""The MindSpore ResNet-50 example as a user runs it: ``trainguard run
--framework mindspore`` with 2 CPU workers, small settings to fit CI.

A device memory error is retried in place and the job ends in the fault-free
state with the same processes; ``guard=false`` (plain MindSpore under plain
msrun, the benchmark's baseline) reaches that state too. MindSpore is never
imported into the test process: every job is a subprocess.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import _assert_no_stray_processes
from ms_jobs import FAST_CLUSTER, free_port

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "resnet50" / "train_mindspore.py"
GRAPH = ROOT / "examples" / "resnet50" / "train_mindspore_graph.py"
STEPS = 4
SMALL = [f"steps={STEPS}", "seed=1", "batch_size=2", "image_size=8", "save_every=0", "log_every=0"]
#: The report's keys documented in examples/resnet50/README.md (as the torch example's).
KEYS = {"final_state_sha256", "steps_completed", "lost_steps", "pids", "recoveries", "faults", "world_size",
        "start_step", "wall_s", "step_time_s", "config"}

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("mindspore") is None, reason="needs MindSpore"),
    pytest.mark.timeout(300),
]


@dataclass
class Run:
    rc: int
    report: dict | None
    log: str
    ranks: dict[str, str] = field(default_factory=dict)  # every rank's final state hash (rank 0's is the report's)

    def __str__(self) -> str:  # shown when an assertion about the run fails
        return f"rc={self.rc}\n{self.log[-6000:]}"




def example(tmp: Path, name: str, *, fault: str | None = None, guard: bool = True, script: Path = SCRIPT,
            args: list[str] | None = None, env: dict | None = None) -> Run:
    """One launch of the example: ``trainguard run --framework mindspore``,
    or plain msrun for ``guard=False``; ``script`` with ``args`` (default:
    the ResNet-50 example's small settings) must write ``tmp/NAME.json``."""
    environ = {**{k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}, **FAST_CLUSTER,
               **(env or {})}
    # msrun starts `python SCRIPT`: the test's interpreter, the one MindSpore is in.
    environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + environ.get("PATH", "")
    if fault:
        environ["TRAINGUARD_FAULT"] = fault
    # Each rank writes its final state hash there (the report holds rank 0's): BatchNorm's statistics are
    # each rank's own, so rank 0's state does not tell rank 1's. The Guard's checkpoints (and fault log)
    # go to its checkpoints/, the checkpoint_dir given below.
    finals = tmp / f"{name}-rehearsal"
    environ["TRAINGUARD_REHEARSAL_DIR"] = str(finals)
    launcher = ["-m", "trainguard.cli", "run", "--framework", "mindspore"] if guard else \
        ["-m", "mindspore.parallel.cluster.run"]
    # absolute paths: the stray-process check finds the workers by them
    args = args if args is not None else \
        [*SMALL, f"guard={guard}", f"report={tmp / f'{name}.json'}", f"checkpoint_dir={finals / 'checkpoints'}"]
    cmd = [sys.executable, *launcher, "--worker_num=2", "--local_worker_num=2", f"--master_port={free_port()}",
           "--join=True", f"--log_dir={tmp / f'{name}-logs'}", str(script), *args]
    log = tmp / f"{name}.log"
    with open(log, "w") as out:  # msrun tails every worker log: a file, not a pipe
        try:
            rc = subprocess.run(cmd, env=environ, cwd=tmp, stdout=out, stderr=subprocess.STDOUT,
                                timeout=120).returncode
        except subprocess.TimeoutExpired:
            rc = -1  # the timeout killed the launcher only: msrun starts workers in sessions of their own
            _kill_processes_under(tmp)
    report = tmp / f"{name}.json"
    ranks = {p.stem.removeprefix("r"): json.loads(p.read_text())["final_state_sha256"]
             for p in sorted((finals / "final").glob("r*.json"))}
    return Run(rc, json.loads(report.read_text()) if report.exists() else None, log.read_text(errors="replace"),
               ranks)


def _kill_processes_under(tmp: Path) -> None:
    """SIGKILL every process whose command line names ``tmp`` (this test's jobs)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if str(tmp) in cmdline and int(pid) != os.getpid():
                os.kill(int(pid), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory) -> Run:
    tmp = tmp_path_factory.mktemp("ms-example")
    run = example(tmp, "ref")
    _assert_no_stray_processes(tmp)
    assert run.rc == 0 and run.report is not None, run
    return run


def test_the_example_trains_every_step_under_trainguard_with_one_process_a_rank(fault_free):
    ref = fault_free.report
    assert KEYS <= ref.keys(), sorted(KEYS - ref.keys())
    assert ref["steps_completed"] == STEPS and ref["lost_steps"] == 0 and ref["recoveries"] == []
    assert ref["world_size"] == 2 and ref["guard"] is True
    assert sorted(ref["pids"]) == ["0", "1"] and all(len(p) == 1 for p in ref["pids"].values())
    assert ref["kernel_random_ops"] == [], ref["kernel_random_ops"]  # a retry can set every stream back
    # each rank's own state: BatchNorm's statistics differ between the replicas
    assert fault_free.ranks["0"] == ref["final_state_sha256"] != fault_free.ranks["1"], fault_free.ranks


# forward: the fault leaves MindSpore's gradient recording open (an exception out of the forward pass
# skips its end_graph); left so, rank 1's jit-compiled DistributedGradReducer was next built for a
# backward pass, held the GIL for tens of seconds, and rank 0's gradient all-reduce timed out (exit 75).
# reduce: rank 1 fails after the vote, and joins the gradient all-reduce with a health flag of 0.
@pytest.mark.parametrize("phase", ["forward", pytest.param("backward", marks=pytest.mark.slow),
                                   pytest.param("reduce", marks=pytest.mark.slow)])
def test_a_retried_uce_ends_in_the_fault_free_state_with_the_same_processes(tmp_path, fault_free, phase):
    ref = fault_free.report
    run = example(tmp_path, "uce", fault=f"uce:rank=1,step=2,phase={phase}")
    _assert_no_stray_processes(tmp_path)
    assert run.rc == 0 and run.report is not None, run
    uce = run.report
    assert KEYS <= uce.keys(), sorted(KEYS - uce.keys())
    assert uce["final_state_sha256"] == ref["final_state_sha256"], run
    # Every rank's: rank 1's BatchNorm statistics were rank 0's after the repair (its own set back since).
    assert sorted(run.ranks) == ["0", "1"] and run.ranks == fault_free.ranks, (run.ranks, fault_free.ranks)
    assert uce["steps_completed"] == STEPS and uce["lost_steps"] == 0, run
    assert [r["strategy"] for r in uce["recoveries"]] == ["retry"], run
    assert uce["recoveries"][0]["rank"] == 1 and uce["recoveries"][0]["recover_s"] > 0, run
    # No process was restarted: each rank has one PID, and the one that
    # failed (the fault log's) finished the job.
    assert all(len(p) == 1 for p in uce["pids"].values()), run
    (struck,) = uce["faults"]
    assert struck["spec"] == f"uce:rank=1,step=2,phase={phase}" and uce["pids"]["1"] == [struck["pid"]], run
    assert not (tmp_path / "outputs").exists(), "hydra must not create output directories"


@pytest.mark.slow  # CI: the guarded run against its fault-free twin
def test_plain_mindspore_reaches_the_same_state(tmp_path, fault_free):
    run = example(tmp_path, "plain", guard=False)
    _assert_no_stray_processes(tmp_path)
    assert run.rc == 0 and run.report is not None, run
    assert run.report["guard"] is False and run.report["recoveries"] == [], run
    assert run.report["final_state_sha256"] == fault_free.report["final_state_sha256"], run


def test_graph_mode_compiles_past_missed_heartbeats_without_being_taken_for_hung(tmp_path):
    """The graph-mode example's compile holds Python's GIL, and with it the
    heartbeat thread, for seconds at a stretch (ResNet-50 here: up to 1.3 s;
    ResNet-152: 5.5 s). With a heartbeat every 0.25 s (3 missed: 0.75 s) the
    controller took both ranks for hung and ended the job (exit 77); a rank
    that has no step time yet now gets the first step's limit."""
    run = example(tmp_path, "graph", script=GRAPH, env={"TRAINGUARD_HEARTBEAT_INTERVAL_S": "0.25"},
                  args=["3", str(tmp_path / "graph.json"), str(tmp_path / "graph-ckpt")])
    _assert_no_stray_processes(tmp_path)
    assert run.rc == 0 and "exit code 77" not in run.log, run
    assert run.report["steps_completed"] == 3 and run.report["recoveries"] == [], run
