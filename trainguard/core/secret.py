"""The job secret and the control plane's TLS settings.

Every control call carries a proof of the job secret, never the secret
itself (:mod:`.handshake`). Where the secret comes from, first found wins:

1. ``TRAINGUARD_TOKEN_FILE``: a file every node mounts (a Kubernetes
   ``Secret``, say); the whole file, surrounding blanks dropped. Checked
   as ssh checks a private key: this user's or root's, writable by no one
   else and readable by no one outside its group (a group-readable one is
   allowed with a warning);
2. ``TRAINGUARD_TOKEN``: the same value set on every node;
3. a single-node job only: a fresh secret made by the launcher, handed to
   its own workers through their environment and nowhere else (its
   controller listens on loopback).

A job of several nodes without one refuses to start: the rendezvous store
every node shares (torch's ``TCPStore``, msrun's) is unauthenticated and
listens on every interface, so nothing secret may travel through it.

With ``TRAINGUARD_TLS_CERT``, ``TRAINGUARD_TLS_KEY`` and ``TRAINGUARD_TLS_CA``
(PEM files: this node's certificate and key, and the authority that signed
every node's) the controller serves TLS and asks each client for a
certificate signed by that authority (mutual TLS); relays and clients
present theirs. The secret is still proved on every call: TLS proves the
endpoints and keeps the traffic private, the secret proves the job.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from .api import ConfigError

if TYPE_CHECKING:  # imported when used: checkpoints read the secret without the control plane
    import grpc

__all__ = ["MIN_SECRET_CHARS", "TLS", "configured_secret", "job_secret", "new_token", "shared_secret"]

log = logging.getLogger("trainguard.secret")

#: The shortest secret accepted from a file or the environment.
MIN_SECRET_CHARS = 16

_HOW = ("give every node (every pod) the same secret: mount one file on every node and set TRAINGUARD_TOKEN_FILE to its path "
        "(a Kubernetes Secret: see docs/security.md), or set TRAINGUARD_TOKEN to the same "
        f"value (at least {MIN_SECRET_CHARS} characters; `python -c 'import secrets; print(secrets.token_hex(32))'`)")


def new_token() -> str:
    """A fresh per-job secret (256 bits, hex)."""
    import secrets

    return secrets.token_hex(32)


def configured_secret(environ: Mapping[str, str] | None = None) -> str | None:
    """The secret set by ``TRAINGUARD_TOKEN_FILE`` or ``TRAINGUARD_TOKEN``
    (``None``: neither is set).

    Raises:
        ConfigError: an unreadable file, or a short secret or one with blanks.
    """
    environ = os.environ if environ is None else environ
    path = environ.get("TRAINGUARD_TOKEN_FILE")
    if path:
        value, where = _read_token_file(path), f"TRAINGUARD_TOKEN_FILE={path}"
    else:
        value, where = environ.get("TRAINGUARD_TOKEN", "").strip(), "TRAINGUARD_TOKEN"
    if not value:
        return None
    if len(value) < MIN_SECRET_CHARS or any(c.isspace() or not c.isprintable() for c in value):
        raise ConfigError(f"the job secret in {where} must be at least {MIN_SECRET_CHARS} printable characters "
                          "without blanks")
    return value


def _read_token_file(path: str, variable: str = "TRAINGUARD_TOKEN_FILE") -> str:
    """The secret in ``path``, checked as ssh checks a private key: a regular
    file of this user or root, that no one else may write, nor read unless
    in its group (a Kubernetes Secret mounted ``defaultMode: 0400``, or 0440
    with an ``fsGroup``: its path is a link into the volume's data, which is
    followed).

    Raises:
        ConfigError: unreadable, not a regular file, too large, another user's, or open to others.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ConfigError(f"cannot read the job secret from {variable}={path}: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        where = f"the {'job secret' if variable == 'TRAINGUARD_TOKEN_FILE' else 'key'} in {variable}={path}"
        if not stat.S_ISREG(st.st_mode) or st.st_size > 4096:
            raise ConfigError(f"{where} is not a regular file of at most 4096 bytes")
        if st.st_uid not in (os.geteuid(), 0):
            raise ConfigError(f"{where} belongs to uid {st.st_uid}: it must be this user's (uid {os.geteuid()}) "
                              "or root's")
        if st.st_mode & 0o026:
            raise ConfigError(f"{where} has mode {stat.S_IMODE(st.st_mode):o}, open to other users: chmod 600 it "
                              "(a Kubernetes Secret: defaultMode 0400)")
        if st.st_mode & 0o040:
            log.warning("%s is readable by its group (mode %o): every member can join the job", where,
                        stat.S_IMODE(st.st_mode))
        try:
            return f.read(4097).decode("utf-8").strip()
        except UnicodeDecodeError:
            raise ConfigError(f"{where} is not UTF-8 text") from None


def shared_secret(environ: Mapping[str, str] | None = None, *, needed_by: str) -> str:
    """The secret ``needed_by`` (a TaskD manager, say) shares with processes
    it did not start, so it cannot make one itself.

    Raises:
        ConfigError: none is set, or the one set is unusable.
    """
    value = configured_secret(environ)
    if value is None:
        raise ConfigError(f"{needed_by} needs a shared secret, and none is set: {_HOW}")
    return value


def job_secret(environ: Mapping[str, str] | None = None, *, nodes: int) -> str:
    """The job secret for a job of ``nodes`` nodes (see the module docstring).

    Raises:
        ConfigError: an unreadable, empty or short secret, or none for a job
            of several nodes.
    """
    if nodes > 1:
        return shared_secret(environ, needed_by=f"a job of {nodes} nodes")
    return configured_secret(environ) or new_token()


@dataclass(frozen=True)
class TLS:
    """This node's certificate and key, and the authority every node's is
    signed by (PEM bytes)."""

    cert: bytes
    key: bytes
    ca: bytes

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "TLS | None":
        """The TLS files named by ``TRAINGUARD_TLS_CERT/KEY/CA``; ``None``
        when none is set.

        Raises:
            ConfigError: only some are set, or one cannot be read.
        """
        environ = os.environ if environ is None else environ
        names = ("TRAINGUARD_TLS_CERT", "TRAINGUARD_TLS_KEY", "TRAINGUARD_TLS_CA")
        paths = [environ.get(n, "") for n in names]
        if not any(paths):
            return None
        if not all(paths):
            missing = [n for n, p in zip(names, paths) if not p]
            raise ConfigError(f"TLS needs all of {', '.join(names)}; {', '.join(missing)} not set")
        parts = []
        for name, path in zip(names, paths):
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError as e:
                raise ConfigError(f"cannot read {name}={path}: {e}") from None
            if b"-----BEGIN" not in data:
                raise ConfigError(f"{name}={path} is not a PEM file")
            parts.append(data)
        return cls(*parts)

    def server(self) -> grpc.ServerCredentials:
        """Credentials of a server that asks every client for a certificate."""
        import grpc

        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel(self) -> grpc.ChannelCredentials:
        """Credentials of a client that checks the server and shows its own."""
        import grpc

        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)
