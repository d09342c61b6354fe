"""The key of a compile cache entry: what makes compiled artifacts valid.

An adapter gathers the key parts (framework version, device, model code
and shapes, configuration) with the helpers here; :func:`cache_key` turns
them into the entry's directory name. Two processes whose parts differ in
anything never share an entry.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import platform
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping

from .api import ConfigError

__all__ = ["cache_key", "code_hash", "cpu_model", "script_hash"]


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
