"""Whether a verified torch checkpoint holds the state its manifest claims.

The manifest's own check (:mod:`trainguard.core.manifest`) proves every
listed file whole and the shards' copy sets covering the world; it cannot
see inside a shard. :func:`content_problem` does: a DCP checkpoint (a
sharded model's) must hold every tensor whole in the files it lists
(:func:`.dcp.coverage_problem`); a ``.pt`` shard that holds DTensors or
``ShardedTensor`` s holds one rank's part of a sharded state, whatever its
layout says (a Guard before sharded state was recognised wrote such files,
marked ``full``) -- found by reading only the pickle's opcodes (nothing is
unpickled).
"""

from __future__ import annotations

import pickletools
import zipfile
from pathlib import Path
from typing import Iterator

from trainguard.core.checkpoint import Verified

__all__ = ["content_problem", "sharded_classes"]

#: Classes whose presence in a pickle means a part of a sharded tensor.
_SHARDED = {("torch.distributed.tensor", "DTensor"), ("torch.distributed.tensor._api", "DTensor"),
            ("torch.distributed._shard.sharded_tensor.api", "ShardedTensor"),
            ("torch.distributed._shard.sharded_tensor", "ShardedTensor")}
_STRINGS = {"SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"}
_MAX_PICKLE = 256 << 20  # a shard's pickle holds structure, not tensor bytes


def _globals(data: bytes) -> Iterator[tuple[str, str]]:
    strings: list[str] = []
    for op, arg, _ in pickletools.genops(data):
        if op.name == "GLOBAL":
            module, _, name = str(arg).partition(" ")
            yield module, name
        elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
            yield strings[-2], strings[-1]
        if op.name in _STRINGS:
            strings = (strings + [arg])[-2:]


def sharded_classes(path: Path) -> list[str]:
    """The sharded-tensor classes a ``torch.save`` file's pickle names
    (empty for a file that is not such a zip, or holds none)."""
    try:
        with zipfile.ZipFile(path) as z:
            found: set[str] = set()
            for info in z.infolist():
                if info.filename.endswith("data.pkl") and info.file_size <= _MAX_PICKLE:
                    found.update(name for module, name in _globals(z.read(info)) if (module, name) in _SHARDED)
            return sorted(found)
    except (zipfile.BadZipFile, OSError, ValueError):  # not a torch.save zip: the loader's own check says so
        return []


def content_problem(found: Verified) -> str | None:
    """Why the shard files of ``found`` do not hold what its manifest says
    (``None``: nothing found)."""
    if found.manifest.get("layout", {}).get("format") == "dcp":
        from trainguard.core import CheckpointError
        from .dcp import coverage_problem
        try:
            why = coverage_problem(found.path, list(found.manifest.get("files", {})))
        except CheckpointError as e:
            return str(e)
        return None if why is None else f"it does not hold the whole state: {why}"
    for shard in found.manifest.get("layout", {}).get("shards", []):
        for name in shard.get("files", []):
            if not name.endswith(".pt"):
                continue
            classes = sharded_classes(found.file(name))
            if classes:
                claim = "the full state" if shard.get("full") else f"the shard of ranks {shard.get('copies')}"
                return (f"{name} is listed as {claim} but holds {', '.join(classes)}s: one rank's part of a "
                        "sharded state, saved as if it were a copy of the state (a trainguard that did not "
                        "know sharded state wrote it); it cannot be resumed")
    return None
