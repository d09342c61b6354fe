"""What a checkpoint directory must hold, read back without trusting it.

A manifest comes from storage that may hold anything: a torn or bit-flipped
write, another tool's file, a hand edit, the manifest of a save that lost a
rank. :func:`parse` turns its bytes into JSON values (strict UTF-8, bounded
size and nesting) and :func:`problem`, a pure function, names the first
thing in them that a sound checkpoint cannot hold: a malformed file record,
a file name that leaves the checkpoint directory, a layout whose shards do
not cover the world it names. :func:`check` then reads each file where it
lies, never through a symbolic link, against its size and checksum.
:class:`~trainguard.core.checkpoint.CheckpointStore` finalises only
manifests that pass and skips, with the reason, any checkpoint that does not.

The layout rule: for each kind of state a shard names (0 dense, 1 experts),
the ``copies`` of that kind's shards together hold every rank of
``range(world_size)``. Every writer lists a shard's whole copy set there, a
``full`` shard's included (its replica group: the world in the torch
adapter's default, one data-parallel group in Megatron's), dead ranks of an
elastic job included, so a save by fewer live members still covers its
world and one that lost a whole shard does not. Files no shard names (each
non-saving rank's ``rng_r<rank>.pt``) are allowed; a shard may name none (a
Megatron dense shard whose state the expert files hold).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
import zlib
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Mapping

import xxhash

from .api import CheckpointError

__all__ = ["FORMAT", "MANIFEST", "MAX_BYTES", "MAX_DEPTH", "check", "file_problem", "matches", "name_problem",
           "open_inside", "parse", "problem", "unreadable"]

FORMAT = "trainguard-checkpoint/1"
MANIFEST = "manifest.json"

#: The largest manifest read, so that a stray multi-gigabyte file is never
#: read into memory. Measured: a data-parallel job's grows by 167 bytes per
#: rank (a rank in the shard's copies, its RNG file's record, its PIDs), 2.6
#: MiB at 16,384 ranks; one with a shard file per rank by 356 (5.6 MiB), so
#: 64 MiB holds some 190,000 ranks. A save past it is refused when it is
#: finalised, never found unreadable at a resume.
MAX_BYTES = 64 << 20
#: The deepest nesting accepted, so that parsing never recurses without
#: limit; trainguard writes 5 levels (manifest, layout, shards, a shard, its
#: copies; and meta, history, records, a record).
MAX_DEPTH = 64
#: ``file`` or ``subdir/file`` (Megatron's ``mp_rank_00/``, MindSpore's ``rank_0/``).
MAX_NAME_PARTS = 2

_CHUNK = 8 << 20
# A string runs to its closing quote or, unterminated, to the end: every
# quote starts a match, so stripping strings stays linear in the text.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.S)
_BRACKET = re.compile(r"[][{}]")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def parse(data: bytes) -> Any:
    """The JSON value in a manifest's bytes.

    Raises:
        CheckpointError: over :data:`MAX_BYTES`, not UTF-8, nested deeper
            than :data:`MAX_DEPTH`, or not JSON.
    """
    if len(data) > MAX_BYTES:
        raise CheckpointError(f"{MANIFEST} is over {MAX_BYTES >> 20} MiB (not one trainguard wrote)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"unreadable {MANIFEST}: not UTF-8 at byte {e.start}") from None
    if _deeper_than(text, MAX_DEPTH):
        raise CheckpointError(f"unreadable {MANIFEST}: nested deeper than {MAX_DEPTH} levels")
    try:
        return json.loads(text)
    except ValueError as e:  # JSONDecodeError, and a number past int's digit limit
        raise CheckpointError(f"unreadable {MANIFEST} ({e})") from None


def _deeper_than(text: str, limit: int) -> bool:
    # Brackets inside strings (a fault message's "[0, 2]") do not nest.
    depth = 0
    for m in _BRACKET.finditer(_STRING.sub("", text)):
        depth += 1 if m.group() in "[{" else -1
        if depth > limit:
            return True
    return False


def name_problem(name: object) -> str | None:
    """Why ``name`` cannot be a file of a checkpoint (``None``: it can):
    relative, ``file`` or ``subdir/file``, no empty, ``.`` or ``..`` part,
    printable, not the manifest itself."""
    if not isinstance(name, str) or not name:
        return "not a non-empty string"
    if not name.isprintable():  # a control character, NUL, a lone surrogate
        return "holds an unprintable character"
    if name.startswith("/"):
        return "is an absolute path"
    parts = name.split("/")
    if len(parts) > MAX_NAME_PARTS or any(p in ("", ".", "..") for p in parts):
        return "must be 'file' or 'subdir/file', with no empty, '.' or '..' part"
    if name == MANIFEST:
        return f"is the {MANIFEST} itself"
    return None


def _int(value: object, least: int = 0, below: int | None = None) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool) and value >= least
            and (below is None or value < below))


def _record_problem(record: object) -> str | None:
    if not isinstance(record, dict):
        return f"its record is {type(record).__name__}, not an object"
    if not _int(record.get("bytes")):
        return f"its size {record.get('bytes')!r} is not a whole number of bytes"
    if not any(k in record for k in ("sha256", "xxh3", "crc32")):
        return "its record has no checksum (sha256, xxh3 or crc32)"
    if "sha256" in record and not (isinstance(record["sha256"], str) and _SHA256.fullmatch(record["sha256"])):
        return "its sha256 is not 64 lowercase hex digits"
    if "xxh3" in record and not _int(record["xxh3"], below=1 << 64):
        return "its xxh3 is not a 64-bit unsigned integer"
    if "crc32" in record and not _int(record["crc32"], below=1 << 32):
        return "its crc32 is not a 32-bit unsigned integer"
    return None


def _files_problem(files: object) -> str | None:
    if not isinstance(files, dict) or not files:
        return "manifest lists no files"
    for name, record in files.items():
        why = name_problem(name)
        if why is not None:
            return f"file name {name!r} {why}"
        why = _record_problem(record)
        if why is not None:
            return f"file {name}: {why}"
    return None


def _shard_problem(shard: object, files: dict) -> str | None:
    if not isinstance(shard, dict):
        return f"is {type(shard).__name__}, not an object"
    if not _int(shard.get("kind")):
        return f"has kind {shard.get('kind')!r}, not a state kind (0, 1, ...)"
    copies = shard.get("copies")
    if not isinstance(copies, list) or not copies or not all(_int(r) for r in copies):
        return "has no list of the ranks holding copies of it"
    if not isinstance(shard.get("full"), bool):
        return "does not say whether it is full"
    if not _int(shard.get("saved_by")):
        return "does not name the rank that saved it"
    names = shard.get("files")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return "has no list of its files"
    missing = next((n for n in names if n not in files), None)
    if missing is not None:
        return f"names {missing!r}, which the manifest does not list"
    return None


def _coverage_gap(world_size: int, shards: list[dict]) -> str | None:
    """Why ``shards`` do not hold every rank of ``world_size`` for each kind
    of state they name (``None``: they do). Ranks past the world are not
    counted (a single-process save may name its configured replicas)."""
    held: dict[int, set[int]] = {}
    for shard in shards:
        held.setdefault(shard["kind"], set()).update(r for r in shard["copies"] if r < world_size)
    for kind, ranks in sorted(held.items()):
        if len(ranks) < world_size:
            lost = next(r for r in range(world_size) if r not in ranks)
            return (f"a partial checkpoint: its shards of state kind {kind} hold {len(ranks)} of the "
                    f"{world_size} ranks of its world (none holds rank {lost})")
    return None


def _layout_problem(layout: object, files: dict) -> str | None:
    if not isinstance(layout, dict) or not layout:
        return "manifest has no layout (the shards saved and the world they cover)"
    world_size = layout.get("world_size")
    if not _int(world_size, least=1):
        return f"layout names world size {world_size!r}, not a whole number of ranks"
    shards = layout.get("shards")
    if not isinstance(shards, list) or not shards:
        return "layout lists no shards"
    for i, shard in enumerate(shards):
        why = _shard_problem(shard, files)
        if why is not None:
            return f"layout shard {i} {why}"
    return _coverage_gap(world_size, shards)


def problem(manifest: object, step: int | None) -> str | None:
    """The first thing in ``manifest`` that a sound checkpoint of ``step``
    cannot hold, as a reason a user can act on; ``None`` when there is
    none. Sizes and checksums of the files themselves are checked by the
    store."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return f"not a {FORMAT} manifest"
    if not _int(manifest.get("step")) or manifest["step"] != step:
        return f"manifest says step {manifest.get('step')!r}, its directory step {step}"
    meta = manifest.get("meta", {})
    if not isinstance(meta, dict) or not isinstance(meta.get("history", {}), dict):
        return "manifest meta (or its history) is not an object"
    files = manifest.get("files")
    return _files_problem(files) or _layout_problem(manifest.get("layout"), files)


# ------------------------------------------------------------------ reading
def check(directory: Path, step: int | None, seen: dict | None = None) -> tuple[dict, None] | tuple[None, str]:
    """``(manifest, None)`` when ``directory`` is a sound checkpoint of
    ``step``: its manifest passes :func:`problem` and every file it lists
    has its size and checksum; else ``(None, the first reason)``. ``seen``
    is given each file's ``fstat`` as it was checked (the manifest's under
    its name)."""
    if os.path.islink(directory):
        return None, "the step directory is a symbolic link (refused: a checkpoint is read only where it lies)"
    try:
        with open_inside(directory, MANIFEST) as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                return None, f"{MANIFEST} is not a regular file"
            if seen is not None:
                seen[MANIFEST] = st
            data = f.read(MAX_BYTES + 1)  # one byte more tells an oversized one, unread beyond
        manifest = parse(data)
    except FileNotFoundError:
        return None, f"no {MANIFEST}"
    except OSError as e:
        return None, unreadable(MANIFEST, e)
    except CheckpointError as e:
        return None, str(e)
    why = problem(manifest, step)
    for name, record in manifest["files"].items() if why is None else ():
        why = file_problem(directory, name, record, seen=seen)
        if why is not None:
            break
    return (manifest, None) if why is None else (None, why)


def file_problem(directory: Path, name: str, record: Mapping, *, checksum: bool = True,
                 seen: dict | None = None) -> str | None:
    """What is wrong with file ``name`` of ``directory`` against its record
    (one that passed :func:`problem`); ``None``: nothing."""
    try:
        with open_inside(directory, name) as f:
            st = os.fstat(f.fileno())
            if seen is not None:
                seen[name] = st
            if not stat.S_ISREG(st.st_mode):
                return f"{name} is not a regular file"
            if st.st_size != record["bytes"]:
                return f"{name} has {st.st_size} bytes, expected {record['bytes']} (truncated or overwritten)"
            if checksum and not matches(f, record):
                return f"{name} fails its checksum (corrupted)"
    except OSError as e:
        return unreadable(name, e)
    return None


def open_inside(directory: Path, name: str) -> BinaryIO:
    """``name`` (``file`` or ``subdir/file``) opened for reading where it
    lies in ``directory`` (a checkpoint's step directory, itself no link).
    Each part is opened with ``O_NOFOLLOW`` from its parent's descriptor, so
    no symbolic link is followed and none can be swapped in between;
    ``O_NONBLOCK`` keeps a FIFO from blocking the open.

    Raises:
        OSError: ``ELOOP`` or ``ENOTDIR`` for a link on the way, ``ENOENT``, ...
    """
    *dirs, leaf = name.split("/")
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for part in dirs:
            sub = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = sub
        leaf_fd = os.open(leaf, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
    finally:
        os.close(fd)
    return os.fdopen(leaf_fd, "rb")


def unreadable(name: str, e: OSError) -> str:
    """Why ``name`` could not be opened inside its checkpoint, in words."""
    if e.errno == errno.ENOENT:
        return f"{name} is missing"
    if e.errno == errno.ELOOP:
        return f"{name} is a symbolic link (refused: a checkpoint is read only from inside its directory)"
    if e.errno == errno.ENOTDIR:
        return f"{name} lies under a symbolic link or a file, not a directory of the checkpoint (refused)"
    return f"{name} cannot be read ({e.strerror or e})"


def _chunks(f: BinaryIO) -> Iterator[bytes]:
    while chunk := f.read(_CHUNK):
        yield chunk


def matches(f: BinaryIO, record: Mapping) -> bool:
    """Whether what ``f`` reads has ``record``'s checksum."""
    if "sha256" in record:
        h = hashlib.sha256()
        for chunk in _chunks(f):
            h.update(chunk)
        return h.hexdigest() == record["sha256"]
    if "xxh3" in record:
        x = xxhash.xxh3_64()
        for chunk in _chunks(f):
            x.update(chunk)
        return x.intdigest() == record["xxh3"]
    # manifests written before snapshots were checked with XXH3-64
    crc = 0
    for chunk in _chunks(f):
        crc = zlib.crc32(chunk, crc)
    return crc == record["crc32"]
