"""The support matrix (docs/support.toml) claims only what its evidence shows.

A row *tested in CI* names tests that exist and that CI runs (not slow, not gpu, not skipped or
xfailed unconditionally); *tested on a GPU* names gpu tests that passed in its results file, or a
results file that says it passed, with the card and the date; *refused* names the tests of the
refusal, which CI runs; *written, untested* says why; *in progress* names its issue. Standard
library only (the tests are read, not imported)."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOT_IN_CI = {"slow", "gpu"}


def gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ROWS = gen_docs().support()["row"]


def _marks(decorators: list[ast.expr]) -> set[str]:
    """The pytest marks among decorators or a pytestmark value: 'slow', 'gpu', and 'off' for a mark that
    keeps a test from running everywhere (skip, xfail with run=False or without a condition)."""
    out: set[str] = set()
    for d in decorators:
        text = ast.unparse(d)
        m = re.match(r"pytest\.mark\.(\w+)", text)
        if not m:
            continue
        name = m.group(1)
        call = d if isinstance(d, ast.Call) else None
        if name in ("slow", "gpu"):
            out.add(name)
        elif name == "skip" or (name == "xfail" and (call is None or not call.args or "run=False" in text)):
            out.add("off")
    return out


@lru_cache(maxsize=None)
def _functions_of(path: str) -> tuple[dict[str, set[str]], set[str]]:
    """A test file's test functions with their marks, and the module's own marks (``pytestmark``)."""
    tree = ast.parse((ROOT / path).read_text())
    module: set[str] = set()
    functions: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets):
            values = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
            module |= _marks(values)
        elif isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            functions[node.name] = _marks(node.decorator_list)
    return functions, module


def marks_of(test_id: str) -> set[str]:
    path, _, name = test_id.partition("::")
    assert path.startswith("tests/") and (ROOT / path).is_file(), f"{test_id}: no such test file"
    functions, module = _functions_of(path)
    assert name in functions, f"{test_id}: no such test function"
    return functions[name] | module


def row_id(row: dict) -> str:
    return f"{row['framework']}/{row['device']}/{row['strategy']}/{row['launcher']}"


def passed_in(evidence: Path, date: str, test_id: str = "", prefix: str = "") -> int:
    """How many items of the GPU run of ``date`` in ``evidence`` are ``test_id`` (any of its parameters)
    or start with ``prefix``; 0 when one of them did not pass (a rehearsal case: was not identical)."""
    if evidence.suffix != ".json":  # a pytest log: PASSED lines under a heading with the date
        path, _, name = test_id.partition("::")
        text = evidence.read_text()
        return len(re.findall(rf"^PASSED {re.escape(test_id)}(?:\[.*\])?\s", text, flags=re.M)) if date in text else 0
    if test_id:
        path, _, name = test_id.partition("::")
        wanted = re.compile(rf"{re.escape(path.removesuffix('.py').replace('/', '.'))}::{re.escape(name)}(\[.*\])?")
    else:
        wanted = re.compile(rf"{re.escape(prefix)}.*")
    found = [i for run in json.loads(evidence.read_text())["runs"] if str(run.get("when", "")).startswith(date)
             for i in run["items"] if wanted.fullmatch(i["item"])]
    return len(found) if found and all(i["result"] in ("passed", "identical") for i in found) else 0


@pytest.mark.parametrize("row", ROWS, ids=row_id)
def test_each_row_claims_only_what_its_evidence_shows(row):
    status = row["status"]
    assert status in gen_docs().STATUS, f"unknown status {status!r}"
    for key in ("framework", "device", "strategy", "launcher", "what"):
        assert row.get(key), f"{key} missing"
    tests = row.get("tests", [])
    if status in ("ci", "refused"):
        assert tests, "a row tested in CI (or refused) names the tests that show it"
        for t in tests:
            off = marks_of(t) & (NOT_IN_CI | {"off"})
            assert not off, f"{t} is marked {sorted(off)}: CI does not run it"
    elif status == "gpu":
        assert row.get("card") and re.fullmatch(r"\d{4}-\d\d-\d\d", row.get("date", "")), "card and date"
        evidence = ROOT / row["evidence"]
        assert evidence.parent == ROOT / "bench" / "results" and evidence.is_file(), row["evidence"]
        assert tests or row.get("items"), "name the gpu tests, or the items of the GPU run, that passed"
        for t in tests:
            assert "gpu" in marks_of(t), f"{t} is not a gpu test"
            assert passed_in(evidence, row["date"], test_id=t), f"{t} did not pass in {row['evidence']} on {row['date']}"
        if row.get("items"):
            assert passed_in(evidence, row["date"], prefix=row["items"]) == row["count"], \
                f"not all {row['count']} items {row['items']!r} passed in {row['evidence']} on {row['date']}"
    elif status == "written":
        assert row.get("why"), "say why it is untested"
        for t in tests:
            marks_of(t)  # exists
    elif status == "in-progress":
        assert isinstance(row.get("issue"), int) and not tests, "an issue number, and no claim"


def test_the_matrix_catches_a_row_that_claims_more_than_its_tests():
    slow = {"framework": "torch", "device": "cpu", "strategy": "dump", "launcher": "trainguard run", "status": "ci",
            "what": "x", "tests": ["tests/test_fault_matrix.py::test_a_hung_rank_is_ended_and_the_relaunch_of_the_dump_is_bit_identical"]}
    with pytest.raises(AssertionError, match="slow"):
        test_each_row_claims_only_what_its_evidence_shows(slow)
    missing = dict(slow, tests=["tests/test_fault_matrix.py::test_no_such_thing"])
    with pytest.raises(AssertionError, match="no such test function"):
        test_each_row_claims_only_what_its_evidence_shows(missing)
    gpu = dict(slow, status="gpu", card="NVIDIA H200", date="2026-11-28", evidence="bench/results/gpu-check.json",
               tests=["tests/test_gpu_snapshot.py::test_a_device_memory_error_on_cuda_restarts_that_process_alone_bit_identical"])
    with pytest.raises(AssertionError, match="did not pass"):
        test_each_row_claims_only_what_its_evidence_shows(gpu)


def test_every_gpu_marked_test_has_a_row_or_is_not_user_facing():
    """Each CUDA test file is named by some row (so a GPU result has a place in the matrix)."""
    named = {t.partition("::")[0] for row in ROWS for t in row.get("tests", [])}
    for path in sorted((ROOT / "tests").glob("test_gpu*.py")):
        assert f"tests/{path.name}" in named, f"{path.name} is in no row of docs/support.toml"
