"""The pod's annotations, mounted as a file by Kubernetes' Downward API, and
where a job's recover strategies come from.

A pod spec that mounts its own annotations::

    volumes:
    - name: podinfo
      downwardAPI:
        items:
        - path: annotations
          fieldRef: {fieldPath: metadata.annotations}

gets a file (``/etc/podinfo/annotations`` when mounted at ``/etc/podinfo``)
that the kubelet writes with Go's ``fmt.Sprintf("%v=%q\\n", key, value)`` for
each annotation, sorted by key, the last newline trimmed: one ``key="value"``
line each, the value a Go double-quoted string literal (``\\"``, ``\\\\``,
``\\n``, ``\\t``, ``\\xNN``, ``\\uNNNN`` ... escapes). :func:`parse_annotations`
reads exactly that, strictly: a line that is not ``key="value"``, a key that
is not an annotation key, an escape Go does not know, or a key given twice
is an error naming the file and line, never skipped.

The strategies a job runs with (:func:`resolve_strategies`), first found
wins: ``trainguard run --strategies``, ``TRAINGUARD_STRATEGIES``, the pod's
``recover-strategy`` annotation (MindCluster's name: comma-separated retry,
recover, recover-in-place, elastic-training, dump, exit) read from the file
``TRAINGUARD_ANNOTATIONS`` names -- else :data:`DEFAULT_PATH` when that file
exists --, the default ``retry,dump,exit``. Every source is checked by
:func:`trainguard.core.config.parse_strategies`, as the flag is.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from typing import Mapping

from .api import ConfigError, Strategy
from .config import ControllerConfig, parse_strategies

__all__ = [
    "DEFAULT_PATH",
    "ENV_VAR",
    "STRATEGY_KEY",
    "StrategyChoice",
    "annotations_file",
    "from_annotations",
    "parse_annotations",
    "read_annotations",
    "resolve_strategies",
]

#: Where the example manifests (deploy/k8s/) mount the pod's annotations; read
#: only when it exists and ``TRAINGUARD_ANNOTATIONS`` is unset.
DEFAULT_PATH = "/etc/podinfo/annotations"
#: The variable naming the annotations file (it must then exist).
ENV_VAR = "TRAINGUARD_ANNOTATIONS"
#: The largest annotations file read: Kubernetes' limit for all of a pod's annotations.
MAX_BYTES = 256 << 10
#: The annotation holding the strategies (MindCluster's job annotation).
STRATEGY_KEY = "recover-strategy"

# An annotation key: an optional DNS-subdomain prefix and '/', then a name of
# at most 63 characters, alphanumerics at both ends ('-', '_', '.' inside).
_NAME = r"[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_PREFIX = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)*"
_KEY = re.compile(rf"(?:{_PREFIX}/)?{_NAME}")
_SIMPLE = {"a": 0x07, "b": 0x08, "f": 0x0C, "n": 0x0A, "r": 0x0D, "t": 0x09, "v": 0x0B, "\\": 0x5C, '"': 0x22}
_HEX = {"x": 2, "u": 4, "U": 8}


def _unquote(literal: str) -> str:
    """The value of a Go interpreted string literal (``"..."``, quotes included).

    Raises:
        ValueError: not one literal, an unknown or short escape, a raw
            newline or quote inside, or bytes that are not UTF-8.
    """
    if len(literal) < 2 or literal[0] != '"' or literal[-1] != '"':
        raise ValueError("the value is not a double-quoted string")
    body, out, i = literal[1:-1], bytearray(), 0
    while i < len(body):
        c = body[i]
        if c == '"':
            raise ValueError(f"an unescaped '\"' at column {i + 2} of the value")
        if c == "\n":
            raise ValueError("a raw newline inside the value")
        if c != "\\":
            out += c.encode("utf-8")
            i += 1
            continue
        if i + 1 >= len(body):
            raise ValueError("the value ends in a lone backslash")
        e = body[i + 1]
        if e in _SIMPLE:
            out.append(_SIMPLE[e])
            i += 2
        elif e in _HEX:
            digits = body[i + 2:i + 2 + _HEX[e]]
            if len(digits) != _HEX[e] or not re.fullmatch(r"[0-9A-Fa-f]+", digits):
                raise ValueError(f"\\{e} needs {_HEX[e]} hex digits (at column {i + 2} of the value)")
            n = int(digits, 16)
            if e == "x":
                out.append(n)  # one byte, as in Go
            elif 0xD800 <= n < 0xE000 or n > 0x10FFFF:
                raise ValueError(f"the \\{e} escape at column {i + 2} of the value is not a Unicode code point Go accepts")
            else:
                out += chr(n).encode("utf-8")
            i += 2 + _HEX[e]
        elif e in "01234567":
            digits = body[i + 1:i + 4]
            if len(digits) != 3 or not re.fullmatch(r"[0-7]{3}", digits) or int(digits, 8) > 255:
                raise ValueError(f"an octal escape needs 3 digits up to \\377 (at column {i + 2} of the value)")
            out.append(int(digits, 8))
            i += 4
        else:
            raise ValueError(f"an escape Go does not know at column {i + 2} of the value")
    try:
        return out.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"the value is not UTF-8 ({err.reason})") from None


def parse_annotations(text: str, source: str = "annotations") -> dict[str, str]:
    """The annotations in a Downward API file's text.

    Args:
        text: the file's text: ``key="value"`` lines (an empty file: none).
        source: names the file in errors.

    Raises:
        ConfigError: a malformed line, naming ``source`` and the line.
    """
    out: dict[str, str] = {}
    lines = text.split("\n")
    for number, line in enumerate(lines, 1):
        if line == "" and number == len(lines):
            continue  # a final newline (the kubelet trims it; a hand-written copy may not)
        key, eq, literal = line.partition("=")
        where = f"{source} line {number}"
        # No error quotes the file: pointed at another file (a secret, say), it must not print it.
        if not eq:
            raise ConfigError(f"{where}: expected key=\"value\" (the line has no '=')")
        if not _KEY.fullmatch(key) or len(key) > 317:
            raise ConfigError(f"{where}: the text before '=' is not an annotation key")
        if key in out:
            raise ConfigError(f"{where}: an annotation is given twice")
        try:
            out[key] = _unquote(literal)
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None
    return out


def read_annotations(path: str | os.PathLike) -> dict[str, str]:
    """The annotations in the file at ``path`` (see :func:`parse_annotations`).

    Raises:
        ConfigError: the file cannot be read, is not UTF-8, or is malformed.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ConfigError(f"the pod annotations file {path} ({ENV_VAR}) is not a regular file")
            data = f.read(MAX_BYTES + 1)
        if len(data) > MAX_BYTES:
            raise ConfigError(f"the pod annotations file {path} ({ENV_VAR}) is over {MAX_BYTES >> 10} KiB "
                              "(Kubernetes' limit for all of a pod's annotations)")
        text = data.decode("utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read the pod annotations file {path} ({ENV_VAR}): {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"cannot read the pod annotations file {path} ({ENV_VAR}): not UTF-8 (byte {e.start})") \
            from None
    return parse_annotations(text, str(path))


def annotations_file(environ: Mapping[str, str] | None = None) -> str | None:
    """The annotations file to read: ``TRAINGUARD_ANNOTATIONS`` (which must
    exist), else :data:`DEFAULT_PATH` if it exists, else ``None``.

    Raises:
        ConfigError: ``TRAINGUARD_ANNOTATIONS`` names no file.
    """
    environ = os.environ if environ is None else environ
    named = environ.get(ENV_VAR)
    if named:
        if not os.path.isfile(named):
            raise ConfigError(f"{ENV_VAR}={named}: no such file (mount the pod's annotations there with the "
                              f"Downward API, or unset {ENV_VAR})")
        return named
    return DEFAULT_PATH if os.path.isfile(DEFAULT_PATH) else None


@dataclass(frozen=True)
class StrategyChoice:
    """The strategies a job runs with, and where they came from."""

    strategies: tuple[Strategy, ...]
    source: str  # "--strategies", "TRAINGUARD_STRATEGIES", "annotation file PATH", "default", ...

    @property
    def text(self) -> str:
        return ",".join(s.value for s in self.strategies)

    def describe(self) -> str:
        """The launcher's first log line."""
        return f"strategies {self.text} (from {self.source})"


def _checked(text: str, source: str) -> StrategyChoice:
    try:
        return StrategyChoice(parse_strategies(text), source)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def from_annotations(environ: Mapping[str, str] | None = None) -> StrategyChoice | None:
    """The ``recover-strategy`` annotation of the mounted annotations file,
    or ``None`` when there is no file or no such annotation.

    Raises:
        ConfigError: a named file that is missing, a malformed file, or an
            invalid strategy list.
    """
    path = annotations_file(environ)
    if path is None:
        return None
    value = read_annotations(path).get(STRATEGY_KEY)
    if value is None:
        return None
    return _checked(value, f"annotation file {path}")


def resolve_strategies(flag: str | None = None, environ: Mapping[str, str] | None = None, *,
                       default: tuple[Strategy, ...] | None = None) -> StrategyChoice:
    """The job's strategies: ``flag`` (``--strategies``), else
    ``TRAINGUARD_STRATEGIES``, else the ``recover-strategy`` annotation,
    else ``default`` (``None``: the controller's). The annotations file is
    read only when it decides.

    Raises:
        ConfigError: the deciding source is invalid (the message names it).
    """
    environ = os.environ if environ is None else environ
    if flag is not None:
        return _checked(flag, "--strategies")
    if "TRAINGUARD_STRATEGIES" in environ:
        return _checked(environ["TRAINGUARD_STRATEGIES"], "TRAINGUARD_STRATEGIES")
    return from_annotations(environ) or StrategyChoice(default or ControllerConfig().strategies, "default")
