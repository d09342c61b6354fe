"""Each quick start in docs/quickstart.md, followed as a new user would: its script saved into an
empty directory (torch, MindSpore) or the committed tree exported fresh (Megatron's example: a clone's
files, `git archive HEAD`), its command run there as written, its promised output checked."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_bounded

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "quickstart.md"

pytestmark = pytest.mark.timeout(300)


def blocks(framework: str) -> tuple[dict[str, str], str, str]:
    """The quick start's files (name -> text), its command, and the output the page promises."""
    text = PAGE.read_text()
    files = {m.group(1): m.group(2) for m in re.finditer(
        rf"<!-- quickstart:{framework} file=(\S+) -->\n```python\n(.*?)```", text, flags=re.S)}
    run = re.search(rf"<!-- quickstart:{framework} run -->\n```bash\n(.*?)```\n\nIt prints `([^`]*)`", text, flags=re.S)
    assert run, f"docs/quickstart.md has no {framework} command followed by what it prints"
    return files, run.group(1), run.group(2)


def follow(tmp_path: Path, framework: str, *, tree: bool = False) -> None:
    files, command, promised = blocks(framework)
    work = tmp_path / framework
    work.mkdir()
    if tree:  # the committed files, as a fresh clone has them
        archive = subprocess.run(["git", "archive", "--format=tar", "HEAD", "examples"], cwd=ROOT,
                                 capture_output=True, check=True, timeout=60).stdout
        subprocess.run(["tar", "-x", "-C", str(work)], input=archive, check=True, timeout=60)
    for name, code in files.items():
        (work / name).write_text(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINGUARD_", "MS_"))}
    env.update(PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""), PYTHONUNBUFFERED="1",
               HYDRA_FULL_ERROR="1")
    out = run_bounded(["bash", "-euo", "pipefail", "-c", command], env=env, cwd=work, timeout=240, merge=True)
    assert out.returncode == 0, out.stdout[-6000:]
    assert out.stdout.rstrip().endswith(promised), out.stdout[-3000:]


def test_the_torch_quick_start(tmp_path):
    follow(tmp_path, "torch")


@pytest.mark.skipif(importlib.util.find_spec("mindspore") is None, reason="needs MindSpore")
def test_the_mindspore_quick_start(tmp_path):
    follow(tmp_path, "mindspore")


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None or importlib.util.find_spec("hydra") is None,
                    reason="needs the megatron and examples extras")
def test_the_megatron_quick_start(tmp_path):
    follow(tmp_path, "megatron", tree=True)
