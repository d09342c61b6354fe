"""One contract, run against every framework's Guard (in the manner of
torchft's transport tests): each is a :class:`~trainguard.core.rank.RankRuntime`
and offers the loop of :class:`trainguard.core.rank.Guard` with the same
outcomes -- the steps it yields, the body it insists on, a fault raised
where no controller can recover it, the report's keys, a checkpoint it
resumes from to the same state.

The scenarios run in a subprocess per framework (``workers/rank_contract.py``,
world size 1, no controller): MindSpore is never imported into the test
process. The fault and recovery paths with a controller and several ranks
are the subject of each adapter's own job tests.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from conftest import WORKERS

REPORT_KEYS = {"steps_completed", "lost_steps", "pids", "recoveries", "final_state_sha256", "compile_cache"}


def _run(framework: str, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp(f"contract-{framework}")
    out = subprocess.run([sys.executable, str(WORKERS / "rank_contract.py"), framework, str(root)],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


class RankContract:
    """The suite; a subclass names its framework in ``framework``."""

    framework = ""

    @pytest.fixture(scope="class")
    @classmethod
    def outcome(cls, tmp_path_factory) -> dict:
        return _run(cls.framework, tmp_path_factory)

    def test_it_is_a_rank_runtime_offering_the_guard_contract(self, outcome):
        assert outcome["loop"]["runtime"] and outcome["loop"]["contract"], outcome["loop"]

    def test_steps_yields_each_completed_step_once_and_counts_them(self, outcome):
        loop = outcome["loop"]
        assert loop["seen"] == [0, 1, 2] and loop["step"] == 3, loop

    def test_the_report_has_the_common_keys_and_a_clean_history(self, outcome):
        loop = outcome["loop"]
        assert REPORT_KEYS <= set(loop["report"]), loop["report"]
        assert loop["lost_steps"] == 0 and loop["recoveries"] == [], loop
        assert loop["pids"] == {"0": [loop["pid"]]}, loop

    def test_a_body_outside_protect_is_refused_with_the_fix(self, outcome):
        assert outcome["unprotected"] == {
            "type": "ConfigError",
            "message": "wrap the body of `for step in guard.steps(...)` in `with guard.protect():`"}

    def test_without_a_controller_a_fault_is_raised_not_swallowed(self, outcome):
        fault = outcome["fault"]
        assert fault["raised"] == {"type": "RuntimeError", "message": "a fault in the body of step 1"}, fault
        assert fault["step"] == 1, fault  # step 0 completed; step 1 was not counted

    def test_a_new_guard_resumes_from_the_checkpoint_to_the_same_state_and_goes_on(self, outcome):
        resume = outcome["resume"]
        assert resume == {"step": 4, "same_state": True, "seen": [4, 5]}, resume


class TestTorch(RankContract):
    framework = "torch"


@pytest.mark.skipif(importlib.util.find_spec("mindspore") is None, reason="needs MindSpore")
@pytest.mark.timeout(300)
class TestMindSpore(RankContract):
    framework = "mindspore"
