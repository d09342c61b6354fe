"""``adapters-patch msrun``: on copies of the installed
``mindspore/parallel/cluster/process_entity/_api.py`` (apply, idempotence,
byte-for-byte revert, refusals, ``--check``), and the patched copy loaded as a
module: its ``_ProcessManager._check_taskd`` hands the manager to trainguard's
``attach`` (faked here) or falls through to MindSpore's own code. The real
install is only read."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trainguard.patch import cli, core
from trainguard.patch.msrun import TARGET

if importlib.util.find_spec("mindspore") is None:  # find_spec does not import it
    pytest.skip("mindspore is not installed", allow_module_level=True)

VERSION = "2.10.0"
SUPPORTED = "supported: 2.10 <= mindspore < 2.11"
ANCHOR = '        """check if enable taskd."""'
START = b"# >>> trainguard: added by `adapters-patch msrun`"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def installed() -> Path:
    """The real _api.py; whatever happens, it must end as it began."""
    path = core.locate(TARGET, sys.executable).path
    before = sha(path.read_bytes())
    assert core.state(path.read_bytes()) == "not patched", f"{path} was patched before the tests started"
    yield path
    after = sha(path.read_bytes())
    if after != before:  # last line of defence: put the original back, then fail loudly
        cli.main(["msrun", "--revert"])
    assert after == before, f"{path} was left modified by the tests"
    assert not core.backup_path(path).exists(), "a backup was left beside the installed file"


@pytest.fixture
def copy(installed, tmp_path) -> Path:
    dst = tmp_path / "mindspore" / "parallel" / "cluster" / "process_entity" / "_api.py"
    dst.parent.mkdir(parents=True)
    shutil.copyfile(installed, dst)
    return dst


def patch(capsys, path: Path, *flags: str, version: str = VERSION) -> tuple[int, str, str]:
    rc = cli.main(["msrun", "--file", str(path), "--mindspore-version", version, *flags])
    out, err = capsys.readouterr()
    return rc, out, err


# ------------------------------------------------------------ apply / revert
def test_apply_is_idempotent_and_revert_restores_the_original_bytes(copy, capsys):
    original = copy.read_bytes()
    rc, out, _ = patch(capsys, copy)
    assert rc == 0 and "done: insert the trainguard block" in out
    once = copy.read_bytes()
    assert once.count(START) == 1 and b"# <<< trainguard <<<" in once
    assert f"original sha256 {sha(original)}".encode() in once
    compile(once, str(copy), "exec")
    assert core.backup_path(copy).read_bytes() == original

    rc, out, _ = patch(capsys, copy)
    assert rc == 0 and "nothing to do: already patched" in out
    assert copy.read_bytes() == once

    rc, out, _ = patch(capsys, copy, "--revert")
    assert rc == 0 and "restore the original from the backup" in out
    assert copy.read_bytes() == original and sha(copy.read_bytes()) == sha(original)
    assert not core.backup_path(copy).exists()


def test_the_block_goes_first_in_check_taskd(copy, capsys):
    patch(capsys, copy)
    text = copy.read_text()
    body = text[text.index(ANCHOR):]
    assert body.index(START.decode()) < body.index("self.handler = RSCPluginHandle()")
    assert f"{ANCHOR}\n        {START.decode()}" in text  # indented like the method's body
    assert " " * 16 + "from trainguard.launcher.msrun import attach as _tg_attach\n" in body
    assert " " * 16 + "if _tg_attach(self):\n" + " " * 20 + "return\n" in body
    assert 'os.environ.pop("TRAINGUARD_DISABLE"' in body and "except ImportError" in body


def test_revert_of_an_unpatched_file_changes_nothing(copy, capsys):
    original = copy.read_bytes()
    rc, out, _ = patch(capsys, copy, "--revert")
    assert rc == 0 and "nothing to do: not patched" in out
    assert copy.read_bytes() == original


def test_revert_without_the_backup_removes_the_block_exactly(copy, capsys):
    original = copy.read_bytes()
    patch(capsys, copy)
    core.backup_path(copy).unlink()
    rc, out, _ = patch(capsys, copy, "--revert")
    assert rc == 0 and "restore the original by removing the block" in out
    assert copy.read_bytes() == original


# ------------------------------------------------- the patched _check_taskd
CHECK_TASKD = """
import importlib.util, json, os, sys, types
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "trainguard":
            raise ImportError("trainguard blocked by the test")
attach = os.environ.get("FAKE_ATTACH")  # "true" | "false" | unset: trainguard is missing
if attach is None:
    sys.meta_path.insert(0, Block())
else:
    import trainguard.launcher
    fake = types.ModuleType("trainguard.launcher.msrun")
    def fake_attach(manager):
        manager.attached = True
        if attach == "true":
            manager.handler, manager.enable_mindx = "trainguard's handler", True
        return attach == "true"
    fake.attach = fake_attach
    sys.modules[fake.__name__] = fake

# The copy, loaded inside MindSpore's package so its relative imports resolve.
name = "mindspore.parallel.cluster.process_entity._api_patched_copy"
spec = importlib.util.spec_from_file_location(name, sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
class Taskd:  # MindSpore's RSCPluginHandle on a machine without taskd
    created = 0
    def __init__(self):
        Taskd.created += 1
    def check_enable(self):
        return False
module.RSCPluginHandle = Taskd
manager = object.__new__(module._ProcessManager)
manager.attached, manager.enable_mindx, manager.handler = False, False, None
result = module._ProcessManager._check_taskd(manager)
print(json.dumps({"returned": result, "attached": manager.attached, "handler": manager.handler,
                  "enable_mindx": manager.enable_mindx, "taskd_handles_created": Taskd.created,
                  "TRAINGUARD_DISABLE": os.environ.get("TRAINGUARD_DISABLE")}))
"""
ATTACHED = {"returned": None, "attached": True, "handler": "trainguard's handler", "enable_mindx": True,
            "taskd_handles_created": 0, "TRAINGUARD_DISABLE": None}
TRIED = {"returned": None, "attached": True, "handler": None, "enable_mindx": False, "taskd_handles_created": 1,
         "TRAINGUARD_DISABLE": None}
MSRUN = {**TRIED, "attached": False}
MISSING = ("trainguard: cannot import trainguard (trainguard blocked by the test); running plain msrun "
           "(undo the patch with `adapters-patch msrun --revert`)")


@pytest.mark.parametrize("env, expected, warned", [
    ({"FAKE_ATTACH": "true"}, ATTACHED, False),
    ({"FAKE_ATTACH": "true", "TRAINGUARD_DISABLE": "0"}, ATTACHED, False),
    ({"FAKE_ATTACH": "false"}, TRIED, False),
    ({"FAKE_ATTACH": "true", "TRAINGUARD_DISABLE": "1"}, MSRUN, False),
    ({}, MSRUN, True),
], ids=["attached", "disable-0-is-enabled", "attach-declines", "disabled", "trainguard-missing"])
def test_the_patched_check_taskd_attaches_or_falls_through(copy, capsys, env, expected, warned):
    patch(capsys, copy)
    full = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINGUARD_", "FAKE_"))}
    out = subprocess.run([sys.executable, "-c", CHECK_TASKD, str(copy)], capture_output=True, text=True,
                         env={**full, **env}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == expected
    ours = [line for line in out.stderr.splitlines() if line.startswith("trainguard:")]
    assert ours == ([MISSING] if warned else []), out.stderr


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize("version", ["2.9.0", "2.9.1", "2.11.0", "2.11.0rc1", "3.0"])
def test_unsupported_versions_are_refused(copy, capsys, version):
    original = copy.read_bytes()
    rc, _, err = patch(capsys, copy, version=version)
    assert rc == 2
    assert f"mindspore {version} is not supported" in err and SUPPORTED in err
    assert copy.read_bytes() == original and not core.backup_path(copy).exists()


@pytest.mark.parametrize("version", ["2.10.0", "2.10.1"])
def test_supported_versions_pass_the_check(copy, capsys, version):
    rc, out, _ = patch(capsys, copy, "--check", version=version)
    assert rc == 0 and "action:     insert the trainguard block" in out


@pytest.mark.parametrize("edit, how", [
    (lambda b: b.replace(b'"""check if enable taskd."""', b'"""Check if taskd is enabled."""'), "was not found"),
    (lambda b: b + b'\n\ndef _again():\n    if True:\n        """check if enable taskd."""\n        pass\n',
     "was found 2 times"),
])
def test_a_changed_file_is_refused(copy, capsys, edit, how):
    copy.write_bytes(edit(copy.read_bytes()))
    changed = copy.read_bytes()
    rc, _, err = patch(capsys, copy)
    assert rc == 2 and f"the line `{ANCHOR}` {how}" in err and "changed by someone else" in err
    assert copy.read_bytes() == changed and not core.backup_path(copy).exists()


# ------------------------------------------------------- --check and --python
def test_check_prints_the_plan_and_changes_nothing(copy, capsys):
    original = copy.read_bytes()
    rc, out, _ = patch(capsys, copy, "--check")
    assert rc == 0
    for line in (f"file:       {copy}", f"mindspore:  {VERSION} ({SUPPORTED})", "state:      not patched",
                 f"action:     insert the trainguard block after `{ANCHOR}`"):
        assert line in out, out
    assert copy.read_bytes() == original and not core.backup_path(copy).exists()

    patch(capsys, copy)
    patched = copy.read_bytes()
    rc, out, _ = patch(capsys, copy, "--check", "--revert")
    assert rc == 0 and "state:      patched" in out and "action:     restore the original from the backup" in out
    assert copy.read_bytes() == patched


def test_python_option_finds_the_installed_mindspore(installed, capsys):
    before = installed.read_bytes()
    rc = cli.main(["msrun", "--check", "--python", sys.executable])
    out = capsys.readouterr().out
    assert rc == 0, out
    for line in (f"file:       {installed}", f"mindspore:  {VERSION} ({SUPPORTED})", "state:      not patched",
                 "action:     insert the trainguard block"):
        assert line in out, out
    assert installed.read_bytes() == before and not core.backup_path(installed).exists()
