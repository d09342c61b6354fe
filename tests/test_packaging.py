"""The core stays framework-free, and the generated protocol code matches the .proto."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROTOCOL = ROOT / "trainguard" / "core" / "protocol"

BLOCKER = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"torch", "mindspore", "megatron", "tensorflow", "keras"}:
            raise ImportError(f"blocked framework import: {name}")
        return None
sys.meta_path.insert(0, Block())
import trainguard.core as core
import importlib, pkgutil
for module in pkgutil.walk_packages(core.__path__, "trainguard.core."):
    importlib.import_module(module.name)
import trainguard.cli
import trainguard.launcher.tfrun, trainguard.tensorflow  # TensorFlow's launcher and adapter import it lazily
assert not any(m.split(".")[0] in {"torch", "mindspore", "megatron", "tensorflow", "keras"} for m in sys.modules)
print("ok", len(core.__all__))
"""


def test_core_imports_with_frameworks_blocked():
    out = subprocess.run([sys.executable, "-c", BLOCKER], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")


def test_generated_protocol_code_is_current(tmp_path):
    protoc = pytest.importorskip("grpc_tools.protoc")
    rc = protoc.main(["protoc", f"-I{PROTOCOL}", f"--python_out={tmp_path}", f"--pyi_out={tmp_path}",
                      str(PROTOCOL / "trainguard.proto")])
    assert rc == 0
    for name in ("trainguard_pb2.py", "trainguard_pb2.pyi"):
        assert (tmp_path / name).read_text() == (PROTOCOL / name).read_text(), (
            f"{name} is stale: regenerate with python -m grpc_tools.protoc -I{PROTOCOL} "
            f"--python_out={PROTOCOL} --pyi_out={PROTOCOL} {PROTOCOL / 'trainguard.proto'}")
