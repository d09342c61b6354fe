"""Keyed integrity of what a job leaves on storage: checkpoint manifests and
compile-cache entries carry an HMAC (:func:`seal`) under a key that must
outlive the job, so a later job can check what an earlier one wrote.

Which key, first found wins:

1. ``TRAINGUARD_KEY_FILE``: a project key file (checked as the token file
   is: this user's or root's, no one else may write it, nor read it outside
   its group). It may stay the same while job secrets change;
2. the job secret when one is *configured* (``TRAINGUARD_TOKEN_FILE`` or
   ``TRAINGUARD_TOKEN``: every job of several nodes has one), through its own
   derivation: the same secret, the same key, job after job;
3. none. The fresh secret a launcher makes for a single-node job is never
   used: it dies with the job, and the next one could check nothing.

The launcher hands its workers the key it found (``TRAINGUARD_CHECKPOINT_KEY``:
the key in hex, or ``none``), so a worker never mistakes the launcher's
fresh secret in ``TRAINGUARD_TOKEN`` for a configured one.

What is checked with and without a key is :mod:`.checkpoint`'s and
:mod:`.compile_cache`'s (docs/security.md says it for users).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any, Mapping

from .api import ConfigError
from .proof import derive
from .secret import _read_token_file, configured_secret

__all__ = ["KEY_ENV", "KEY_FILE_ENV", "check", "key_for_workers", "key_from_env", "seal", "stable_key"]

KEY_FILE_ENV = "TRAINGUARD_KEY_FILE"
KEY_ENV = "TRAINGUARD_CHECKPOINT_KEY"
ALG = "hmac-sha256"


def stable_key(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The key from a project key file or a configured secret; ``None`` without either.

    Raises:
        ConfigError: a key file that is unreadable, open to others, or short.
    """
    environ = os.environ if environ is None else environ
    path = environ.get(KEY_FILE_ENV)
    if path:
        value = _read_token_file(path, variable=KEY_FILE_ENV)
        if len(value) < 16:
            raise ConfigError(f"{KEY_FILE_ENV}={path} holds fewer than 16 characters")
        return derive(value, "integrity")
    secret = configured_secret(environ)
    return derive(secret, "integrity") if secret is not None else None


def key_for_workers(environ: Mapping[str, str] | None = None) -> str:
    """What a launcher sets ``TRAINGUARD_CHECKPOINT_KEY`` to, before it puts its own secret in the
    environment: the key it was given (a launch inside a launch), else the stable key, in hex; or ``none``."""
    key = key_from_env(environ)
    return key.hex() if key is not None else "none"


def key_from_env(environ: Mapping[str, str] | None = None) -> bytes | None:
    """This process's key: the launcher's (``TRAINGUARD_CHECKPOINT_KEY``), else :func:`stable_key`.

    Raises:
        ConfigError: a malformed ``TRAINGUARD_CHECKPOINT_KEY``, or see :func:`stable_key`.
    """
    environ = os.environ if environ is None else environ
    given = environ.get(KEY_ENV)
    if given is None:
        return stable_key(environ)
    if given == "none":
        return None
    try:
        key = bytes.fromhex(given)
    except ValueError:
        key = b""
    if len(key) != 32:
        raise ConfigError(f"{KEY_ENV} must be 64 hex digits or 'none' (the launcher sets it)")
    return key


def _canonical(document: Mapping[str, Any]) -> bytes:
    body = {k: v for k, v in document.items() if k != "mac"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def key_id(key: bytes) -> str:
    """A name for ``key`` that tells keys apart and reveals nothing of them."""
    return hashlib.sha256(b"trainguard key id" + key).hexdigest()[:12]


def seal(key: bytes, document: Mapping[str, Any], purpose: str) -> dict:
    """The ``mac`` entry of ``document`` (a JSON object, ``mac`` itself left out) for ``purpose``."""
    value = hmac.new(key, purpose.encode() + b"\0" + _canonical(document), hashlib.sha256).hexdigest()
    return {"alg": ALG, "key": key_id(key), "value": value}


def check(key: bytes, document: Mapping[str, Any], purpose: str) -> str | None:
    """Why ``document``'s ``mac`` does not hold under ``key`` (``None``: it holds)."""
    mac = document.get("mac")
    if not isinstance(mac, dict) or mac.get("alg") != ALG or not isinstance(mac.get("value"), str):
        return "it carries no keyed checksum (written without a key)"
    try:
        expected = seal(key, document, purpose)["value"]
    except (TypeError, ValueError):
        return "it cannot be checked (not plain JSON)"
    if not hmac.compare_digest(mac["value"], expected):
        if mac.get("key") != key_id(key):
            return (f"its keyed checksum was made with another key (key id {str(mac.get('key'))[:12]}, this job's "
                    f"{key_id(key)}): written under another secret or key file, or forged")
        return "its keyed checksum does not match: altered after it was written"
    return None
