"""The patch engine: insert, detect and remove one marked block in a
framework's installed launcher file, reversibly and byte for byte.

A :class:`Target` describes one launcher (where its file lies in an
environment, the supported framework versions, the line to insert after and
the code to insert). Everything else here is generic:

* :func:`locate` finds the file and the framework's version by running the
  target environment's interpreter (this process never imports the
  framework);
* :func:`plan_apply` and :func:`plan_revert` are pure functions from file
  bytes to a :class:`Plan` (new bytes plus a sentence saying what changes), or
  a :class:`PatchError` saying why not;
* :func:`execute` writes a plan: the original is saved beside the file as
  ``<file>.trainguard-orig`` before the first edit, every write is atomic
  (temporary file in the same directory, then ``os.replace``) and keeps the
  file's mode;
* :func:`handing_over` writes a target's block: the launcher hands over to
  trainguard unless ``TRAINGUARD_DISABLE`` is set or trainguard is missing.

The inserted block's first line records the SHA-256 of the original file, so
a revert can prove it restores the exact original bytes: from the backup
when its hash matches, otherwise by cutting the block out and checking the
hash of what remains. If neither gives the original, nothing is changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Located", "PatchError", "Plan", "Target", "backup_path", "check_version", "check_writable", "execute",
           "handing_over", "locate", "plan_apply", "plan_revert", "read_backup", "state"]

BACKUP_SUFFIX = ".trainguard-orig"
_START = re.compile(rb"^([ \t]*)# >>> trainguard:[^\n]*\n", re.M)
_HASH = re.compile(rb"original sha256 ([0-9a-f]{64}) >>>")
_END = re.compile(rb"^[ \t]*# <<< trainguard <<<[ \t]*\r?\n", re.M)


class PatchError(Exception):
    """The patch cannot be applied or reverted; the file was left untouched."""


@dataclass(frozen=True, kw_only=True)
class Target:
    """One launcher file that ``adapters-patch NAME`` edits.

    Attributes:
        name: the subcommand, e.g. ``"torchrun"``.
        summary: one line for ``--help``.
        package: import name of the framework's top-level package (``"torch"``).
        distribution: its distribution name, for the installed version.
        relative_path: the file inside the package (``"distributed/run.py"``).
        min_version: lowest supported version (inclusive), as a release tuple.
        max_version: first unsupported version (exclusive).
        anchor: the exact line (without newline) the block goes after; it
            must occur exactly once.
        body: the block's code, unindented, lines joined by ``"\\n"``; it is
            indented like the line after the anchor.
        more: further ``(anchor, body)`` blocks in the same file (each
            anchor exactly once), applied and reverted with the first.
    """

    name: str
    summary: str
    package: str
    distribution: str
    relative_path: str
    min_version: tuple[int, ...]
    max_version: tuple[int, ...]
    anchor: str
    body: str
    more: tuple[tuple[str, str], ...] = ()

    @property
    def blocks(self) -> tuple[tuple[str, str], ...]:
        """Every ``(anchor, body)`` the target inserts."""
        return ((self.anchor, self.body), *self.more)

    @property
    def supported(self) -> str:
        low, high = (".".join(map(str, v)) for v in (self.min_version, self.max_version))
        return f"{low} <= {self.package} < {high}"


def handing_over(name: str, imports: str, call: str, unless: str = "") -> str:
    """A :attr:`Target.body` for launcher ``name``: unless ``TRAINGUARD_DISABLE``
    is set (it is taken out of the environment, so the workers never see it)
    or the expression ``unless`` is true, import ``imports`` (``"module
    import function as _tg_alias"``) and run ``call``; where trainguard
    cannot be imported, say so and how to undo the patch, and let the
    launcher run on as it would without it."""
    guard = f"not {unless} and " if unless else ""
    return f"""\
import os, sys
if {guard}os.environ.pop("TRAINGUARD_DISABLE", "") in ("", "0"):
    try:
        from {imports}
    except ImportError as _tg_error:
        print(f"trainguard: cannot import trainguard ({{_tg_error}}); running plain {name} "
              f"(undo the patch with `adapters-patch {name} --revert`)", file=sys.stderr)
    else:
{textwrap.indent(call, " " * 8)}"""


@dataclass(frozen=True)
class Located:
    """Where a target's file is in one environment."""

    path: Path
    version: str
    has_trainguard: bool | None = None  # None: not known (an explicit --file)


@dataclass(frozen=True)
class Plan:
    """What applying or reverting would do to one file."""

    path: Path
    state: str  # "not patched" | "patched" | "patched by an older trainguard"
    action: str  # one sentence
    new: bytes | None = None  # None: nothing to write
    original: bytes | None = None  # the original bytes, when the plan writes a backup
    remove_backup: bool = False


def release(version: str) -> tuple[int, ...]:
    """``"2.13.0+cpu"`` -> ``(2, 13, 0)``. Pre-releases and local suffixes
    count as their release, so a ``2.14.0a0`` nightly is outside ``< 2.14``."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    if not m:
        raise PatchError(f"cannot read the version {version!r}")
    return tuple(int(p) for p in m.group(1).split("."))


def check_version(target: Target, version: str) -> None:
    """Raises: PatchError: ``version`` is outside the supported range."""
    v = release(version)
    if not target.min_version <= v < target.max_version:
        raise PatchError(f"{target.package} {version} is not supported by `adapters-patch {target.name}` "
                         f"(supported: {target.supported})")


_PROBE = """\
import importlib.metadata, importlib.util, json, sys
if sys.path[:1] == [""]:
    del sys.path[0]  # like a console script: the current directory is not on the path
package, distribution = sys.argv[1:]
spec = importlib.util.find_spec(package)
if spec is None or not spec.submodule_search_locations:
    print(json.dumps(None))
else:
    print(json.dumps({"dir": list(spec.submodule_search_locations)[0],
                      "version": importlib.metadata.version(distribution),
                      "has_trainguard": importlib.util.find_spec("trainguard") is not None}))
"""


def locate(target: Target, python: str) -> Located:
    """Find the target's file in the environment of interpreter ``python``
    without importing the framework (``find_spec`` on a top-level package
    does not run it).

    Raises:
        PatchError: the interpreter cannot be run, or the framework or the
            file is not installed there.
    """
    cmd = [python, "-c", _PROBE, target.package, target.distribution]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise PatchError(f"cannot run the Python interpreter {python}: {e}") from None
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise PatchError(f"the Python interpreter {python} failed (exit code {out.returncode}): {last}")
    found = json.loads((out.stdout.strip().splitlines() or ["null"])[-1])
    if found is None:
        raise PatchError(f"{target.package} is not installed in the environment of {python}")
    path = Path(found["dir"]) / target.relative_path
    if not path.is_file():
        raise PatchError(f"{path} does not exist: this {target.package} install has no {target.relative_path}")
    return Located(path, found["version"], found["has_trainguard"])


# ----------------------------------------------------------------- pure part
def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _block(target: Target, body: str, indent: bytes, newline: bytes, original_sha: str) -> bytes:
    undo = f"`adapters-patch {target.name} --revert`"
    start = (f"# >>> trainguard: added by `adapters-patch {target.name}`; undo with {undo}; "
             f"original sha256 {original_sha} >>>")
    lines = [start, *body.split("\n"), "# <<< trainguard <<<"]
    return b"".join(indent + line.encode() + newline if line else newline for line in lines)


def _insert(target: Target, original: bytes) -> bytes:
    found: list[tuple[int, bytes]] = []
    for anchor_text, body_text in target.blocks:
        anchor = re.compile(rb"^" + re.escape(anchor_text.encode()) + rb"[ \t]*(\r?\n)", re.M)
        hits = list(anchor.finditer(original))
        if len(hits) != 1:
            how = "not found" if not hits else f"found {len(hits)} times"
            raise PatchError(f"the line `{anchor_text}` was {how}: this file was changed by someone else, "
                             f"so it is left alone")
        at, newline = hits[0].end(), hits[0].group(1)
        body = re.compile(rb"([ \t]+)\S").match(original, at)
        if body is None:
            raise PatchError(f"the line after `{anchor_text}` is not an indented body: this file was changed "
                             f"by someone else, so it is left alone")
        found.append((at, _block(target, body_text, body.group(1), newline, sha256(original))))
    out, last = [], 0
    for at, block in sorted(found):
        out += [original[last:at], block]
        last = at
    return b"".join(out) + original[last:]


def _find_blocks(data: bytes) -> tuple[list[tuple[int, int]], str]:
    """Where each trainguard block in ``data`` starts and ends, and the
    original's sha256 their first lines record (the same in each).

    Raises:
        PatchError: the markers are missing, unpaired or out of order, or
            a hash is not there or differs between blocks.
    """
    starts, ends = list(_START.finditer(data)), list(_END.finditer(data))
    spans = [(s.start(), e.end()) for s, e in zip(starts, ends)]
    paired = len(starts) == len(ends) and all(
        e.start() >= s.end() and (i + 1 == len(starts) or starts[i + 1].start() >= e.end())
        for i, (s, e) in enumerate(zip(starts, ends)))
    if not starts or not paired:
        raise PatchError(f"its trainguard block is damaged ({len(starts)} start and {len(ends)} end markers)")
    recorded = {m.group(1).decode() if m else None for m in (_HASH.search(s.group(0)) for s in starts)}
    if None in recorded or len(recorded) != 1:
        raise PatchError("the first line of its trainguard block does not record the original's sha256")
    return spans, recorded.pop()


def _cut(data: bytes, spans: list[tuple[int, int]]) -> bytes:
    out, last = [], 0
    for start, end in spans:
        out.append(data[last:start])
        last = end
    return b"".join(out) + data[last:]


def state(data: bytes) -> str:
    """``"patched"`` when ``data`` holds a trainguard marker line, else ``"not patched"``."""
    return "patched" if _START.search(data) or _END.search(data) else "not patched"


def plan_apply(target: Target, path: Path, data: bytes, backup: bytes | None) -> Plan:
    """Plan inserting the block into ``data`` (the file's bytes).

    Idempotent: a file already holding this block gets an empty plan; one
    holding a different trainguard block gets that block replaced.

    Raises:
        PatchError: the anchor is missing or repeated, or the file was
            changed after patching other than inside the block.
    """
    if state(data) == "not patched":
        after = " and ".join(f"`{anchor}`" for anchor, _ in target.blocks)
        return Plan(path, "not patched", f"insert the trainguard block after {after} and save the "
                    f"original as {backup_path(path)}", _insert(target, data), original=data)
    refuse = f"reinstall {target.package} to get a clean file"
    try:
        spans, want = _find_blocks(data)
    except PatchError as e:
        raise PatchError(f"{path} is patched but {e}; {refuse}") from None
    original = _cut(data, spans)
    if sha256(original) != want:
        raise PatchError(f"{path} was edited after it was patched (without its trainguard block it is not the "
                         f"original); `adapters-patch {target.name} --revert` restores the original from the "
                         f"backup, or {refuse}")
    new = _insert(target, original)
    if new == data:
        return Plan(path, "patched", "nothing to do: already patched")
    return Plan(path, "patched by an older trainguard", "replace the trainguard block", new, original=original)


def plan_revert(target: Target, path: Path, data: bytes, backup: bytes | None) -> Plan:
    """Plan restoring the original bytes: the backup when its hash is the
    one the block recorded, else the file without its block when that is.

    Raises:
        PatchError: neither gives the bytes whose hash the block recorded.
    """
    if state(data) == "not patched":
        return Plan(path, "not patched", "nothing to do: not patched")
    refuse = f"reinstall {target.package} to get a clean file"
    try:
        spans, want = _find_blocks(data)
    except PatchError as e:
        raise PatchError(f"cannot restore the original {path}: {e}; {refuse}") from None
    cut = _cut(data, spans)
    done = f"and delete {backup_path(path)}"
    if backup is not None and sha256(backup) == want:
        note = "" if cut == backup else " (the file had other edits besides the block; they are discarded)"
        return Plan(path, "patched", f"restore the original from the backup{note} {done}", backup,
                    remove_backup=True)
    if sha256(cut) == want:
        return Plan(path, "patched", f"restore the original by removing the block {done}", cut, remove_backup=True)
    why = "is missing" if backup is None else "does not match the recorded sha256"
    raise PatchError(f"cannot restore the original {path}: the backup {why}, and removing the block does not "
                     f"give the original either (the file was edited after patching); {refuse}")


# ---------------------------------------------------------------------- I/O
def backup_path(path: Path) -> Path:
    return path.with_name(path.name + BACKUP_SUFFIX)


def read_backup(path: Path) -> bytes | None:
    try:
        return backup_path(path).read_bytes()
    except FileNotFoundError:
        return None


def is_writable(path: Path) -> bool:
    """Whether ``path`` can be replaced: the file and its directory (for the
    temporary file and the backup) must be writable."""
    return os.access(path, os.W_OK) and os.access(path.parent, os.W_OK)


def check_writable(path: Path) -> None:
    """Raises: PatchError: ``path`` or its directory is read-only."""
    if not is_writable(path):
        raise PatchError(f"{path} is read-only (or its directory is): a read-only install cannot be "
                         f"patched; run as the install's owner, or patch a writable environment")


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def execute(plan: Plan) -> None:
    """Write ``plan``: the backup first (when the plan carries the original),
    then the file. On failure the file keeps its old bytes.

    Raises:
        PatchError: the file or its directory is not writable.
    """
    if plan.new is None:
        return
    path = plan.path
    check_writable(path)
    mode = path.stat().st_mode & 0o7777
    backup, wrote_backup = backup_path(path), False
    try:
        if plan.original is not None:
            _write_atomic(backup, plan.original, mode)
            wrote_backup = True
        _write_atomic(path, plan.new, mode)
    except OSError as e:
        if wrote_backup and plan.state == "not patched":  # the file is still the original
            backup.unlink(missing_ok=True)
        raise PatchError(f"cannot write {e.filename or path}: {e.strerror or e}; the file is unchanged") from None
    if plan.remove_backup:
        backup.unlink(missing_ok=True)
