"""Files a job writes into directories others may write in.

The run directory, a report's picture, the snapshot root, the compile
cache and the checkpoint directory may sit where another user can write
(``/tmp``, a group's share). Written naively, a link planted at a file's
name makes a root job write wherever the link points, and a directory that
user owns lets them rename the job's files and put their own in place. So:

* a directory is used only when it is owned by this process's user or by
  root, and no one else may rename entries in it (writable by others only
  with the sticky bit, as ``/tmp``); ``TRAINGUARD_ALLOW_SHARED_DIRS=1``
  allows another owner, or a group-writable one, for a shared setup where
  that is intended (:func:`directory_problem`, :func:`check_directory`);
* a directory it makes is 0700, a file 0600, whatever the umask;
* a file is opened without following a link (``O_NOFOLLOW``), from its
  directory's descriptor, and used only when it is a regular file of this
  user (:func:`open_append`, :func:`open_read`); a whole file is written
  to a new name beside it and renamed over the old, which replaces a link
  instead of writing through it (:func:`write_replace`).

Only the standard library: every part of the job imports this.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path
from typing import Mapping

from .api import ConfigError

__all__ = ["ALLOW_ENV", "check_directory", "directory_problem", "make_directory", "open_append", "open_read",
           "shared_allowed", "write_replace"]

ALLOW_ENV = "TRAINGUARD_ALLOW_SHARED_DIRS"
_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC


def shared_allowed(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``TRAINGUARD_ALLOW_SHARED_DIRS`` allows directories of other users (or groups)."""
    environ = os.environ if environ is None else environ
    return environ.get(ALLOW_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def directory_problem(path: str | os.PathLike, *, allow_shared: bool = False) -> str | None:
    """Why ``path`` is no directory to write in (``None``: it is one).

    A link the user made to a directory is followed (the path is theirs);
    the directory it reaches is what is checked.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "does not exist"
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if allow_shared:
        return None
    if st.st_uid not in (os.geteuid(), 0):
        return (f"belongs to uid {st.st_uid}, not to this process's uid {os.geteuid()} (nor root): that user could "
                f"swap the files written there for links; set {ALLOW_ENV}=1 if that is intended")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        return (f"has mode {stat.S_IMODE(st.st_mode):o}: other users may rename what is written there (make it "
                f"writable by its owner only, or sticky like /tmp; or set {ALLOW_ENV}=1 if that is intended)")
    return None


def check_directory(path: str | os.PathLike, what: str, environ: Mapping[str, str] | None = None) -> Path:
    """``path`` when it is a directory to write in (see :func:`directory_problem`).

    Raises:
        ConfigError: it is not, saying why and what to do.
    """
    why = directory_problem(path, allow_shared=shared_allowed(environ))
    if why is not None:
        raise ConfigError(f"{what} {path} {why}")
    return Path(path)


def make_directory(path: str | os.PathLike, what: str, environ: Mapping[str, str] | None = None) -> Path:
    """``path``, made 0700 when missing (its missing parents too), then checked as :func:`check_directory` does.

    Raises:
        ConfigError: it cannot be made, or is no directory to write in.
    """
    path = Path(path)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{what} {path} cannot be created ({e.strerror or e})") from None
    return check_directory(path, what, environ)


def _checked_file(fd: int, name: str) -> int:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise PermissionError(f"{name} is not a regular file")
    if st.st_uid != os.geteuid():
        os.close(fd)
        raise PermissionError(f"{name} belongs to uid {st.st_uid}, not to this process's uid {os.geteuid()}")
    return fd


def open_append(directory: str | os.PathLike, name: str) -> int:
    """A descriptor appending to ``directory/name``: made 0600 when missing,
    never through a link, refused when it is not a regular file of this
    user; one left group- or world-readable is made 0600.

    Raises:
        OSError: ``ELOOP`` for a link, ``PermissionError`` for a file of another user, ...
    """
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = os.open(name, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | _FLAGS, 0o600, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    fd = _checked_file(fd, name)
    if stat.S_IMODE(os.fstat(fd).st_mode) & 0o077:
        os.fchmod(fd, 0o600)
    return fd


def open_read(path: str | os.PathLike) -> int:
    """A descriptor reading ``path``: never through a link at its last
    part, never a FIFO or device (a regular file only).

    Raises:
        OSError: ``ELOOP`` for a link, ``PermissionError`` for no regular file, ...
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _FLAGS)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise PermissionError(f"{path} is not a regular file")
    return fd


def write_replace(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` as ``path`` (0600): to a new file beside it, synced,
    then renamed over it, so a link at ``path`` is replaced, never written
    through, and a reader never sees half a file.

    Raises:
        OSError: the directory cannot be written, ...
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _FLAGS, 0o600)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
