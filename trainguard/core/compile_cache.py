"""Compile caches that survive a restart: one validated entry per key.

A restarted process (recover-in-place, recover, a relaunch after a dump)
would otherwise compile its graphs again (torch.compile: tens of seconds on
a CPU for ResNet-50; large models on accelerators: minutes). The frameworks
keep their compilation artifacts in a directory of their own (Inductor's
``TORCHINDUCTOR_CACHE_DIR``, MindSpore's ``MS_COMPILER_CACHE_PATH``).
trainguard points that directory at a private, local one per process,
fills it from the job's *entry* before the first compile, and publishes the
directory as the entry after the first step when there was none::

    <root>/<key>/manifest.json        key parts, and size + SHA-256 of every file
    <root>/<key>/files/...            the framework's cache directory, as it was
    <root>/.tmp-<key>-<host>-<pid>-*  a publication in progress (renamed when complete)

The key is a hash of what makes artifacts valid (framework version, device,
model code and shapes, configuration), given by the adapter. An entry is
used only when its manifest names the same key parts and every file has the
size and checksum the manifest gives, checked while it is copied; otherwise
it is ignored with one warning and rebuilt: the process compiles afresh and
publishes a new entry. An entry appears by one ``rename`` of a complete
directory, so readers never see half of one, and when several ranks publish
at once the first rename wins and the others discard their copy.
"""

from __future__ import annotations

import enum
import errno
import hashlib
import inspect
import json
import logging
import os
import platform
import shutil
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path, PurePosixPath
from typing import Any, Iterable, Mapping

from .api import ConfigError

__all__ = ["CompileCache", "LocalCache", "Lookup", "cache_key", "code_hash", "cpu_model", "resolve_root",
           "script_hash"]

log = logging.getLogger("trainguard.compile_cache")

FORMAT = 1
MANIFEST = "manifest.json"
FILES = "files"
#: Publications in progress older than this are left-overs of a process that died.
STALE_TMP_S = 3600.0
_CHUNK = 1 << 20
_OFF = {"off", "0", "false", "no", "none"}


class Lookup(enum.Enum):
    """What a process found for its key."""

    OFF = "off"  #: no cache configured
    HIT = "hit"  #: a valid entry, restored into the framework's directory
    MISS = "miss"  #: no entry yet: compile, then publish
    INVALID = "invalid"  #: an entry that must not be used (mismatched, partial, corrupt): ignored, rebuilt


def cache_key(parts: Mapping[str, Any]) -> str:
    """The directory name for ``parts``: ``<framework>-<first 32 hex of the
    SHA-256 of their canonical JSON>``.

    Raises:
        ConfigError: parts that are not JSON (strings, numbers, lists, mappings).
    """
    try:
        text = json.dumps(dict(parts), sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"compile cache key parts must be JSON values: {e}") from None
    framework = "".join(c for c in str(parts.get("framework", "any")) if c.isalnum()) or "any"
    return f"{framework}-{hashlib.sha256(text.encode()).hexdigest()[:32]}"


def resolve_root(setting: str | os.PathLike | bool | None, checkpoint_dir: str | os.PathLike | None,
                 environ: Mapping[str, str] | None = None) -> Path | None:
    """Where the job's compile cache lives, or ``None`` for no cache.

    ``setting`` (a Guard argument) wins; ``None`` falls back to
    ``TRAINGUARD_COMPILE_CACHE``, then to ``<checkpoint_dir>/.trainguard/
    compile_cache`` (storage every rank and every relaunch of the job
    reaches; created when the first entry is published). ``False`` or
    ``"off"`` turns it off.

    Raises:
        ConfigError: a directory given explicitly cannot be created, or a file.
    """
    environ = os.environ if environ is None else environ
    if setting is None:
        setting = environ.get("TRAINGUARD_COMPILE_CACHE") or None
    if setting is True:
        setting = None
    if setting is False or (isinstance(setting, str) and setting.strip().lower() in _OFF):
        return None
    if setting is None:
        if checkpoint_dir is None:
            return None
        return Path(checkpoint_dir).expanduser().absolute() / ".trainguard" / "compile_cache"
    root = Path(setting).expanduser().absolute()
    if root.exists() and not root.is_dir():
        raise ConfigError(f"compile cache {root} is not a directory")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"compile cache directory {root} cannot be created ({e.strerror}); set "
                          f"TRAINGUARD_COMPILE_CACHE to a writable directory, or to 'off'") from None
    return root


class _Invalid(Exception):
    """An entry that must not be used; the message says why."""


class CompileCache:
    """One process's view of the job's entry for one key.

    Args:
        root: the job's cache directory (see :func:`resolve_root`).
        parts: what the artifacts depend on, as JSON values; their hash is the key.
        warn: log an unusable entry as a warning (one per process); ``False``
            logs it at INFO (the other ranks of a job that all start together).
        owner: who this process is, for the manifest (e.g. ``rank 3``).

    Raises:
        ConfigError: parts that are not JSON.
    """

    def __init__(self, root: str | os.PathLike, parts: Mapping[str, Any], *, warn: bool = True,
                 owner: str = "") -> None:
        self.root = Path(root)
        self.key = cache_key(parts)
        self.parts = json.loads(json.dumps(dict(parts), sort_keys=True))  # a plain, comparable copy
        self.entry = self.root / self.key
        self.owner = owner
        self._warn = warn
        self.state = Lookup.MISS
        self.reason = "not looked up yet"
        self.counters = {"hits": 0, "misses": 0, "invalid": 0, "published": 0, "publish_lost": 0}
        self.restored = {"files": 0, "bytes": 0, "seconds": 0.0}
        self._bad: tuple[int, int] | None = None  # identity of the entry found unusable

    # ------------------------------------------------------------- reading
    def restore(self, dest: str | os.PathLike) -> Lookup:
        """Copy a valid entry into ``dest`` (an empty directory), checking
        every file's size and checksum as it goes. On anything wrong,
        ``dest`` is emptied again, so nothing unchecked is ever used.

        Returns:
            :attr:`Lookup.HIT`, :attr:`Lookup.MISS` or :attr:`Lookup.INVALID`
            (also kept in :attr:`state`, with :attr:`reason`).
        """
        started = time.perf_counter()
        dest = Path(dest)
        if not self.entry.exists():
            return self._found(Lookup.MISS, f"no entry for key {self.key} yet")
        try:
            files = self._read_manifest()
            total = 0
            for rel, meta in files.items():
                total += _copy_checked(self.entry / FILES / rel, dest / rel, meta)
        except _Invalid as e:
            _empty(dest)
            self._bad = _identity(self.entry)
            return self._found(Lookup.INVALID, str(e))
        self.restored = {"files": len(files), "bytes": total, "seconds": round(time.perf_counter() - started, 3)}
        return self._found(Lookup.HIT, f"restored {len(files)} files ({total / 1e6:.1f} MB) from {self.entry}")

    def _read_manifest(self) -> dict[str, dict]:
        path = self.entry / MANIFEST
        try:
            manifest = json.loads(path.read_text())
        except FileNotFoundError:
            raise _Invalid(f"{self.entry} has no {MANIFEST} (a partial entry)") from None
        except (OSError, ValueError) as e:
            raise _Invalid(f"{path} is unreadable ({e})") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise _Invalid(f"{path} is not a format-{FORMAT} manifest")
        if manifest.get("parts") != self.parts:
            theirs = manifest.get("parts") if isinstance(manifest.get("parts"), dict) else {}
            diff = [f"{k}={theirs.get(k)!r} (this process: {self.parts.get(k)!r})"
                    for k in sorted(set(theirs) | set(self.parts)) if theirs.get(k) != self.parts.get(k)]
            raise _Invalid(f"{self.entry} was made for other settings: {'; '.join(diff)[:600]}")
        files = manifest.get("files")
        if not isinstance(files, dict):
            raise _Invalid(f"{path} lists no files")
        for rel, meta in files.items():
            pure = PurePosixPath(rel)
            if pure.is_absolute() or ".." in pure.parts or not pure.parts:
                raise _Invalid(f"{path} names a file outside the entry: {rel!r}")
            if not (isinstance(meta, dict) and isinstance(meta.get("size"), int)
                    and isinstance(meta.get("sha256"), str)):
                raise _Invalid(f"{path}: no size and sha256 for {rel!r}")
        return files

    def _found(self, state: Lookup, reason: str) -> Lookup:
        self.state, self.reason = state, reason
        self.counters[{Lookup.HIT: "hits", Lookup.MISS: "misses", Lookup.INVALID: "invalid"}[state]] += 1
        if state is Lookup.INVALID:
            text = f"compile cache not used, compiling afresh: {reason}"
            log.log(logging.WARNING if self._warn else logging.INFO, "%s%s", f"{self.owner}: " if self.owner else "",
                    text)
        else:  # a miss is every first run's: news only to someone debugging
            log.log(logging.INFO if state is Lookup.HIT else logging.DEBUG, "%scompile cache %s: %s",
                    f"{self.owner}: " if self.owner else "", state.value, reason)
        return state

    # ----------------------------------------------------------- writing
    def publish(self, source: str | os.PathLike, *, skip: Iterable[str] = ()) -> bool:
        """Make ``source`` (the framework's cache directory after compiling)
        the entry, unless a valid one is there already.

        The copy goes to a temporary directory beside the entry, with its
        manifest written last, and becomes the entry by one rename; a rename
        that finds an entry there (another rank was first) discards it.

        Args:
            source: the directory to publish.
            skip: top-level names in ``source`` to leave out (lock files).

        Returns:
            Whether this process's copy became the entry.
        """
        source, skip = Path(source), set(skip)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            log.warning("compile cache: cannot create %s (%s); the next restart compiles afresh", self.root, e)
            return False
        self._clear_stale()
        if self._bad != _identity(self.entry) and self._entry_ok():
            self.counters["publish_lost"] += 1
            log.info("compile cache: entry %s was published by another process", self.key)
            return False
        tmp = self.root / f".tmp-{self.key}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            files = {}
            for path in sorted(source.rglob("*")):
                rel = path.relative_to(source)
                if rel.parts[0] in skip or not path.is_file() or path.is_symlink():
                    continue
                files[rel.as_posix()] = _copy_hashed(path, tmp / FILES / rel)
            if not files:
                shutil.rmtree(tmp, ignore_errors=True)
                log.debug("compile cache: nothing was compiled, nothing to publish")
                return False
            manifest = {"format": FORMAT, "key": self.key, "parts": self.parts, "files": files,
                        "created": {"by": self.owner, "host": socket.gethostname(), "pid": os.getpid(),
                                    "unix_time": round(time.time(), 3)}}
            _write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
            _fsync_dir(tmp)
            if self.entry.exists() and (self._bad == _identity(self.entry) or not self._entry_ok()):
                self._move_aside()
            os.rename(tmp, self.entry)
            _fsync_dir(self.root)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if e.errno in (errno.EEXIST, errno.ENOTEMPTY) and self._entry_ok():
                self.counters["publish_lost"] += 1
                log.info("compile cache: another process published entry %s first", self.key)
                return False
            log.warning("compile cache: could not publish %s (%s); the next restart compiles afresh", self.entry, e)
            return False
        self.counters["published"] += 1
        log.info("compile cache: published %d files (%.1f MB) as %s", len(files),
                 sum(f["size"] for f in files.values()) / 1e6, self.entry)
        return True

    def _entry_ok(self) -> bool:
        """A cheap check (manifest, key parts, file sizes) that the entry
        is complete; its checksums are checked by whoever restores it."""
        try:
            files = self._read_manifest()
        except _Invalid:
            return False
        return all(_size(self.entry / FILES / rel) == meta["size"] for rel, meta in files.items())

    def _move_aside(self) -> None:
        trash = self.root / f".trash-{self.key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(self.entry, trash)
        except FileNotFoundError:
            return  # another process moved it already
        shutil.rmtree(trash, ignore_errors=True)

    def _clear_stale(self) -> None:
        now = time.time()
        for path in self.root.glob(".tmp-*"):
            try:
                if now - path.stat().st_mtime > STALE_TMP_S:
                    shutil.rmtree(path, ignore_errors=True)
            except OSError:
                pass

    # ------------------------------------------------------------ report
    def report(self) -> dict:
        """For ``guard.report()["compile_cache"]``."""
        return {"dir": str(self.root), "key": self.key, "state": self.state.value, "reason": self.reason,
                **self.counters, "restored": dict(self.restored)}


class LocalCache:
    """A process's private copy of the framework's cache directory: filled
    from the entry at start, published after the first completed step when
    there was no usable entry, removed at close.

    Args:
        root: the job's cache directory, or ``None`` for none (a no-op object).
        parts, warn, owner: see :class:`CompileCache`.
        prefix: name prefix of the private directory (under the system's temp directory).
        skip: top-level names in it never published (lock files).
    """

    def __init__(self, root: Path | None, parts: Mapping[str, Any], *, prefix: str, warn: bool = True,
                 owner: str = "", skip: Iterable[str] = ()) -> None:
        self.cache = CompileCache(root, parts, warn=warn, owner=owner) if root is not None else None
        self.prefix, self.skip = prefix, tuple(skip)
        self.local: Path | None = None
        self.local_name = ""
        self._published = False
        if self.cache is not None:
            remove_orphans(prefix)
            self.local = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-"))
            self.local_name = str(self.local)
            self.cache.restore(self.local)

    def after_step(self) -> None:
        """Publish once, after the first completed step, unless it was a hit."""
        if self._published or self.cache is None or self.local is None:
            return
        self._published = True
        if self.cache.state is not Lookup.HIT:
            self.cache.publish(self.local, skip=self.skip)

    def report(self) -> dict:
        return {**self.cache.report(), "local_dir": self.local_name} if self.cache else {"state": Lookup.OFF.value}

    def close(self) -> None:
        if self.local is not None:
            shutil.rmtree(self.local, ignore_errors=True)
            self.local = None


def remove_orphans(prefix: str) -> None:
    """Private directories left on this machine by processes that died (a
    killed rank cannot clean up after itself); named ``<prefix><pid>-...``."""
    for path in Path(tempfile.gettempdir()).glob(f"{prefix}*"):
        pid = path.name[len(prefix):].split("-", 1)[0]
        try:
            if pid.isdigit() and path.stat().st_uid == os.getuid():
                os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass


def code_hash(classes: Iterable[type]) -> str:
    """SHA-256 over the names and source code of ``classes`` (a model's
    module classes): editing a layer's code changes it."""
    digest = hashlib.sha256()
    for cls in sorted(set(classes), key=lambda c: f"{c.__module__}.{c.__qualname__}"):
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            source = ""  # built in or generated: its name and the framework's version identify it
        digest.update(f"{cls.__module__}.{cls.__qualname__}\n{source}\n".encode())
    return digest.hexdigest()


def script_hash() -> str:
    """SHA-256 of the running script (``sys.argv[0]``), or ``""``."""
    script = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    try:
        return hashlib.sha256(script.read_bytes()).hexdigest() if script and script.is_file() else ""
    except OSError:
        return ""


def cpu_model() -> str:
    """The CPU's architecture and model name (compiled CPU kernels depend on them)."""
    name = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.machine()}:{name}"


def _identity(path: Path) -> tuple[int, int] | None:
    """Which directory is at ``path`` now (a new publication is a new one)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1


def _copy_checked(src: Path, dst: Path, meta: Mapping[str, Any]) -> int:
    """Copy one file of an entry, refusing it unless its size and checksum
    are the manifest's."""
    size = _size(src)
    if size < 0:
        raise _Invalid(f"{src} is missing")
    if size != meta["size"]:
        raise _Invalid(f"{src} has {size} bytes, its manifest says {meta['size']} (truncated or changed)")
    try:
        got = _copy_hashed(src, dst, synced=False)
    except OSError as e:
        raise _Invalid(f"{src} could not be read ({e})") from None
    if got["sha256"] != meta["sha256"] or got["size"] != meta["size"]:
        raise _Invalid(f"{src} does not match its checksum (corrupt)")
    return got["size"]


def _copy_hashed(src: Path, dst: Path, *, synced: bool = True) -> dict:
    dst.parent.mkdir(parents=True, exist_ok=True)
    digest, size = hashlib.sha256(), 0
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while chunk := fin.read(_CHUNK):
            digest.update(chunk)
            fout.write(chunk)
            size += len(chunk)
        if synced:
            fout.flush()
            os.fsync(fout.fileno())
    shutil.copymode(src, dst)  # compiled libraries stay loadable
    return {"size": size, "sha256": digest.hexdigest()}


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some network file systems refuse fsync on a directory
    finally:
        os.close(fd)


def _empty(path: Path) -> None:
    if path.is_dir():
        for child in path.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
