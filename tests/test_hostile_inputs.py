"""Inputs another user can shape, refused or made harmless (issue 41, item 6).

Before: ``trainguard report`` crashed on lines of the wrong types, printed
raw terminal escapes from the events file, and took 1.3 GB for a 19 MiB
file; the annotations file had no size cap and, pointed at the token file,
printed the secret; a newline in the job id forged a log line; a junk
``TRAINGUARD_LOG_LEVEL`` gave a traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainguard.core import ConfigError, ControllerConfig
from trainguard.core.annotations import from_annotations, read_annotations
from trainguard.report.timeline import RunDirError, load, summary

START = {"t": 1000.0, "ev": "controller", "job_id": "j", "world_size": 2, "strategies": ["retry"]}

# Each line crashed the report before (the crash it made).
BAD_LINES = {
    "a step past any float (OverflowError)": {"t": 1001, "ev": "rank", "rank": 0, "step": 10 ** 400},
    "a time past any float (OverflowError)": {"t": 10 ** 400, "ev": "exit", "code": 0},
    "a checkpoint without its step (KeyError)": {"t": 1002, "ev": "checkpoint", "path": "x"},
    "an object where a name goes (TypeError)": {"t": 1003, "ev": "fault", "kind": {"a": 1}, "rank": 1, "step": 2},
    "a fallback without a strategy (TypeError)": [{"t": 1004, "ev": "state", "state": "ABNORMAL"},
                                                   {"t": 1005, "ev": "fallback"}],
    "an infinite time (ValueError)": {"t": float("inf"), "ev": "launch"},
}


def _run_dir(tmp_path: Path, *events) -> Path:
    lines = [json.dumps(START)]
    for ev in events:
        lines += [json.dumps(e) for e in (ev if isinstance(ev, list) else [ev])]
    (tmp_path / "events.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path


@pytest.mark.parametrize("what", sorted(BAD_LINES))
def test_report_takes_a_line_of_the_wrong_types_without_crashing(tmp_path, what):
    tl = load(_run_dir(tmp_path, BAD_LINES[what], {"t": 1010, "ev": "finished", "rank": 0, "step": 3}))
    text = summary(tl)
    assert "steps: 3 reached" in text, text
    pytest.importorskip("matplotlib")
    from trainguard.report.plot import draw

    assert draw(tl, tmp_path / "out.png").read_bytes()[:4] == b"\x89PNG"


def test_report_prints_no_terminal_escapes(tmp_path):
    evil = "\x1b]0;pwned\x07\x1b[2J\x1b[31mred"
    tl = load(_run_dir(tmp_path, {"t": 1001, "ev": "controller", "job_id": evil, "world_size": 1,
                                  "strategies": [evil]},
                       {"t": 1002, "ev": "state", "state": "ABNORMAL"},
                       {"t": 1003, "ev": "fault", "kind": evil, "rank": 0, "step": 1}))
    text = summary(tl)
    assert "\x1b" not in text and "\x07" not in text, repr(text)
    assert "\\x1b[2J" in text  # written out, visible


def test_report_memory_is_bounded_whatever_the_file_holds(tmp_path):
    """A 19 MiB file of one ``steps`` line cost 1.3 GB before."""
    with open(tmp_path / "events.jsonl", "w") as f:
        f.write(json.dumps(START) + "\n")
        f.write('{"t": 1001, "ev": "steps", "steps": [' + ",".join(["0"] * (19 << 19)) + "]}\n")
        for i in range(64):  # and wide ones under the line cap: curves of 131,072 ranks
            f.write('{"t": %d, "ev": "steps", "steps": [%s]}\n' % (1002 + i, ",".join(["7"] * 40000)))
    code = textwrap.dedent(f"""
        from trainguard.report.timeline import load, summary
        summary(load({str(tmp_path)!r}))
        peak = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
        print(int(peak.split()[1]) // 1024)  # this process's own peak (ru_maxrss keeps its parent's)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) < 400, f"{out.stdout.split()[-1]} MiB"


def test_report_reads_no_link_and_no_fifo(tmp_path):
    (tmp_path / "real.jsonl").write_text(json.dumps(START) + "\n")
    (tmp_path / "events.jsonl").symlink_to(tmp_path / "real.jsonl")
    with pytest.raises(RunDirError, match="a link, or no regular file, is not read"):
        load(tmp_path)
    (tmp_path / "events.jsonl").unlink()
    os.mkfifo(tmp_path / "events.jsonl")
    with pytest.raises(RunDirError):
        load(tmp_path)  # refused at once, not blocked on a pipe no one writes


# ------------------------------------------------------------ annotations
def test_an_annotations_file_pointed_at_the_secret_does_not_print_it(tmp_path):
    secret = "c2VjcmV0LXRva2VuLXZhbHVl=="  # base64: a key-like start, then '='
    token = tmp_path / "token"
    token.write_text(secret + "\n")
    with pytest.raises(ConfigError) as e:
        from_annotations({"TRAINGUARD_ANNOTATIONS": str(token)})
    assert "c2Vj" not in str(e.value) and "line 1" in str(e.value), str(e.value)
    token.write_text("api-token-0123456789abcdef\n")
    with pytest.raises(ConfigError) as e:
        from_annotations({"TRAINGUARD_ANNOTATIONS": str(token)})
    assert "0123456789" not in str(e.value), str(e.value)


def test_an_oversized_or_special_annotations_file_is_refused(tmp_path):
    big = tmp_path / "big"
    big.write_text('a="' + "x" * (300 << 10) + '"\n')
    with pytest.raises(ConfigError, match="over 256 KiB"):
        read_annotations(big)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ConfigError, match="not a regular file"):
        read_annotations(tmp_path / "fifo")  # refused, not blocked on a pipe


# ------------------------------------------------------------ the job id, the log level
@pytest.mark.parametrize("job_id", ["a\n[trainguard launcher ERROR] forged", "a b", "../up", "x\x1b[2J", ""])
def test_a_job_id_that_could_forge_a_log_line_or_a_path_is_refused(job_id):
    with pytest.raises(ConfigError, match="job id"):
        ControllerConfig(job_id=job_id)


def test_a_junk_log_level_is_one_warning_not_a_traceback():
    code = "from trainguard.core import logs; import logging; logs.setup('t'); " \
           "print(logging.getLogger('trainguard').level)"
    env = {**os.environ, "TRAINGUARD_LOG_LEVEL": "LOUD\x1b[2J"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert out.stdout.strip() == str(20) and "is no log level" in out.stderr and "\x1b" not in out.stderr, out.stderr
