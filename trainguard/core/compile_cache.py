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
model code and shapes, configuration), given by the adapter
(:mod:`.compile_cache_key`). An entry is used only when its manifest names
the same key parts and every file has the size and checksum the manifest
gives, checked while it is copied (:mod:`.compile_cache_files`); otherwise
it is ignored with one warning and rebuilt: the process compiles afresh and
publishes a new entry.

An entry is code the process will run, and anyone who may write the
checkpoint directory may rewrite both a file and its checksum. So, with a
key (:mod:`.integrity`: a project key file or a configured job secret), the
manifest carries an HMAC, and an entry whose HMAC does not hold is refused
(logged); without a key, or for an entry written without one, the entry
is used only when no other user may write it: its root and directory
this user's (or root's) and writable by no one else, every file too. The
framework runs the private copy (0700, in the system's temp directory),
never the shared files. An entry appears by one ``rename`` of a complete
directory, so readers never see half of one, and when several ranks publish
at once the first rename wins and the others discard their copy.
"""

from __future__ import annotations

import enum
import errno
import json
import logging
import os
import shutil
import socket
import tempfile
import time
import uuid
from pathlib import Path, PurePosixPath
from typing import Any, Iterable, Mapping

from . import integrity
from .api import ConfigError
from .compile_cache_files import (InvalidEntry, copy_checked, copy_hashed, empty_dir, file_size, fsync_dir, identity,
                                  write_synced)
from .compile_cache_key import cache_key, code_hash, cpu_model, script_hash
from .private import directory_problem, shared_allowed

__all__ = ["CompileCache", "LocalCache", "Lookup", "cache_key", "code_hash", "cpu_model", "resolve_root",
           "script_hash"]

log = logging.getLogger("trainguard.compile_cache")

FORMAT = 1
MANIFEST = "manifest.json"
FILES = "files"
#: Publications in progress older than this are left-overs of a process that died.
STALE_TMP_S = 3600.0
_OFF = {"off", "0", "false", "no", "none"}
_FROM_ENV = object()


class Lookup(enum.Enum):
    """What a process found for its key."""

    OFF = "off"  #: no cache configured
    HIT = "hit"  #: a valid entry, restored into the framework's directory
    MISS = "miss"  #: no entry yet: compile, then publish
    INVALID = "invalid"  #: an entry that must not be used (mismatched, partial, corrupt): ignored, rebuilt


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
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"compile cache directory {root} cannot be created ({e.strerror}); set "
                          f"TRAINGUARD_COMPILE_CACHE to a writable directory, or to 'off'") from None
    return root


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
                 owner: str = "", key: bytes | None | object = _FROM_ENV) -> None:
        self.root = Path(root)
        self.mac_key: bytes | None = integrity.key_from_env() if key is _FROM_ENV else key  # see the module doc
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
        self._keyed = False  # the entry read last carries a keyed checksum that holds

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
            files, private = self._read_manifest(), self._private()
            total = 0
            for rel, meta in files.items():
                total += copy_checked(self.entry / FILES / rel, dest / rel, meta, private=private)
        except InvalidEntry as e:
            empty_dir(dest)
            self._bad = identity(self.entry)
            return self._found(Lookup.INVALID, str(e))
        self.restored = {"files": len(files), "bytes": total, "seconds": round(time.perf_counter() - started, 3)}
        return self._found(Lookup.HIT, f"restored {len(files)} files ({total / 1e6:.1f} MB) from {self.entry}")

    def _private(self) -> bool:
        """Whether the entry must be private to be used (no keyed checksum vouches for it).

        Raises:
            InvalidEntry: it must be, and its root or directory is not.
        """
        if self._keyed or shared_allowed():
            return False
        for what, path in (("its cache directory", self.root), ("the entry", self.entry)):
            why = directory_problem(path)
            if why is not None:
                raise InvalidEntry(f"{self.entry} carries no keyed checksum (set TRAINGUARD_KEY_FILE, or a shared "
                                   f"secret), and {what} {path} {why}")
        return True

    def _read_manifest(self) -> dict[str, dict]:
        path = self.entry / MANIFEST
        self._keyed = False
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as f:
                manifest = json.loads(f.read(64 << 20))
        except FileNotFoundError:
            raise InvalidEntry(f"{self.entry} has no {MANIFEST} (a partial entry)") from None
        except (OSError, ValueError) as e:
            raise InvalidEntry(f"{path} is unreadable ({e})") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise InvalidEntry(f"{path} is not a format-{FORMAT} manifest")
        if self.mac_key is not None and "mac" in manifest:
            why = integrity.check(self.mac_key, manifest, "compile-cache")
            if why is not None:  # refused, whatever else it holds: never run
                raise InvalidEntry(f"{path} refused: {why}")
            self._keyed = True
        if manifest.get("parts") != self.parts:
            theirs = manifest.get("parts") if isinstance(manifest.get("parts"), dict) else {}
            diff = [f"{k}={theirs.get(k)!r} (this process: {self.parts.get(k)!r})"
                    for k in sorted(set(theirs) | set(self.parts)) if theirs.get(k) != self.parts.get(k)]
            raise InvalidEntry(f"{self.entry} was made for other settings: {'; '.join(diff)[:600]}")
        files = manifest.get("files")
        if not isinstance(files, dict):
            raise InvalidEntry(f"{path} lists no files")
        for rel, meta in files.items():
            pure = PurePosixPath(rel)
            if pure.is_absolute() or ".." in pure.parts or not pure.parts:
                raise InvalidEntry(f"{path} names a file outside the entry: {rel!r}")
            if not (isinstance(meta, dict) and isinstance(meta.get("size"), int)
                    and isinstance(meta.get("sha256"), str)):
                raise InvalidEntry(f"{path}: no size and sha256 for {rel!r}")
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
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            log.warning("compile cache: cannot create %s (%s); the next restart compiles afresh", self.root, e)
            return False
        self._clear_stale()
        if self._bad != identity(self.entry) and self._entry_ok():
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
                files[rel.as_posix()] = copy_hashed(path, tmp / FILES / rel)
            if not files:
                shutil.rmtree(tmp, ignore_errors=True)
                log.debug("compile cache: nothing was compiled, nothing to publish")
                return False
            manifest = {"format": FORMAT, "key": self.key, "parts": self.parts, "files": files,
                        "created": {"by": self.owner, "host": socket.gethostname(), "pid": os.getpid(),
                                    "unix_time": round(time.time(), 3)}}
            if self.mac_key is not None:
                manifest["mac"] = integrity.seal(self.mac_key, json.loads(json.dumps(manifest)), "compile-cache")
            write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
            fsync_dir(tmp)
            if self.entry.exists() and (self._bad == identity(self.entry) or not self._entry_ok()):
                self._move_aside()
            os.rename(tmp, self.entry)
            fsync_dir(self.root)
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
        except InvalidEntry:
            return False
        return all(file_size(self.entry / FILES / rel) == meta["size"] for rel, meta in files.items())

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
