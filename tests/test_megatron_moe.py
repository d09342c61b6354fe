"""The seed's TTP flow with experts (MoE, EP 2, 4 ranks under ``trainguard
run``): a device memory error repaired in place from two replicas -- the
dense state from a rank holding other experts, the expert state from the
other copy of this rank's experts -- and a crash saved by the dying gasp and
resumed, both bit-identical to the fault-free run (dropout on: the random
streams must be those of the locked step)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
WORKER = Path(__file__).resolve().parent / "workers" / "moe_recipe.py"
pytestmark = pytest.mark.timeout(400)


def run(tmp: Path, name: str, fault: str | None = None, **extra: str) -> tuple[int, dict | None, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env.update({"TRAINGUARD_HEARTBEAT_INTERVAL_S": "0.5", "PYTHONUNBUFFERED": "1", **extra})
    if fault:
        env["TRAINGUARD_FAULT"] = fault
    cmd = [sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", "4", "--monitor-interval", "0.1",
           "--max-restarts", "0", str(WORKER), f"{name}.json", f"{name}-ckpt"]
    out = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=240)
    report = tmp / f"{name}.json"
    return out.returncode, json.loads(report.read_text()) if report.exists() else None, out.stdout + out.stderr


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe")
    rc, ref, log = run(tmp, "ref")
    assert rc == 0, log[-4000:]
    assert ref["steps_completed"] == 6 and ref["recoveries"] == []
    d = ref["digests"]
    assert d[0] == d[2] and d[1] == d[3] and d[0] != d[1]  # replicas per expert-parallel rank, experts differ
    return tmp, ref


def test_a_uce_with_experts_is_repaired_in_place_from_two_replicas_bit_identical(reference):
    tmp, ref = reference
    # Rank 1 strikes once the others committed step 3: under load, rank 2 was once still inside its
    # update then, and needed a repair itself (so rank 1's dense state came from rank 3).
    rc, got, log = run(tmp, "uce", "uce:rank=1,step=3,phase=backward", MOE_HOLD="1,3")
    assert rc == 0, log[-4000:]
    assert got["digests"] == ref["digests"], log[-4000:]
    assert got["steps_completed"] == 6 and got["lost_steps"] == 0
    [record] = got["recoveries"]
    assert (record["fault"], record["strategy"], record["step"]) == ("uce", "retry", 3), record
    assert {k: len(v) for k, v in got["pids"].items()} == {str(r): 1 for r in range(4)}  # nobody restarted
    assert "the state on this rank's device is discarded" in log
    # rank 2 holds expert-parallel rank 0's experts: only the dense state may come from it
    assert "rank 1 took its dense state at step 3 from rank 2" in log, log[-4000:]
    assert "rank 1 took its expert state at step 3 from rank 3" in log, log[-4000:]
    assert not (tmp / "uce-ckpt" / "latest_checkpointed_iteration.txt").exists()  # nothing dumped


def test_a_crash_with_experts_is_saved_by_the_dying_gasp_and_resumes_bit_identical(reference):
    tmp, ref = reference
    rc, _, log = run(tmp, "crash", "crash:rank=1,step=3")
    assert rc == 75, log[-4000:]
    step = tmp / "crash-ckpt" / "iter_0000003"
    manifest = json.loads((step / "manifest.json").read_text())
    # one file per expert-parallel rank, each holding that rank's dense and expert state; rank 1's by rank 3
    assert sorted(manifest["files"]) == ["mp_rank_00_000/model_optim_rng.pt", "mp_rank_00_001/model_optim_rng.pt"]
    assert sorted((s["kind"], s["saved_by"]) for s in manifest["layout"]["shards"] if s["files"]) == [(1, 0), (1, 3)]
    assert "no random-number state kept" not in log
    rc, resumed, log = run(tmp, "crash")
    assert rc == 0, log[-4000:]
    assert resumed["start_step"] == 3 and resumed["steps_completed"] == 6
    assert resumed["digests"] == ref["digests"], log[-4000:]
    assert [(r["strategy"], r["step"], r["rank"]) for r in resumed["recoveries"]] == [("dump", 3, 1)]
