"""Turning an exception's text into a fault kind, the way MindIO does.

Frameworks report device and network failures as ``RuntimeError`` with a
recognisable message. :class:`Classifier` matches those messages against an
ordered pattern list (first match wins); users add their own patterns with
:meth:`Classifier.register`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .api import FaultKind, Severity

__all__ = ["Classification", "Classifier", "STOP"]

#: Returned for ``FORCE STOP``: the rank was stopped on purpose, not faulty.
STOP = "stop"


@dataclass(frozen=True)
class Classification:
    kind: FaultKind | str  # a FaultKind, or STOP
    severity: Severity = Severity.HIGH

    @property
    def is_stop(self) -> bool:
        return self.kind == STOP


_DEFAULT: list[tuple[str, FaultKind | str, Severity | None]] = [
    (r"FORCE STOP", STOP, None),
    # An explicit severity, as the fault injector and adapters that know it write it.
    (r"UCE ERROR \[severity=low\]", FaultKind.UCE, Severity.LOW),
    (r"UCE ERROR \[severity=corrupted\]", FaultKind.UCE, Severity.CORRUPTED),
    (r"UCE ERROR", FaultKind.UCE, Severity.HIGH),
    # Severity None: corrupted when it struck inside an optimizer update.
    (r"HBM MULTI BIT ECC", FaultKind.UCE, None),
    (r"uncorrectable ECC error", FaultKind.UCE, None),
    (r"HCCL OP RETRY FAILED|SUSPECT REMOTE ERROR", FaultKind.COMM, Severity.HIGH),
    (r"NCCL (error|communicator was aborted|WARN)|nccl(Remote|System|Internal)Error", FaultKind.COMM, Severity.HIGH),
    (r"Connection (closed|reset) by peer|Broken pipe|link (down|error)", FaultKind.COMM, Severity.HIGH),
    (r"gloo.*(Timed out|timeout)|Timed out waiting .* for recv", FaultKind.COMM, Severity.HIGH),
]


class Classifier:
    """Ordered ``(pattern, kind, severity)`` rules; the first match wins."""

    def __init__(self) -> None:
        self._rules: list[tuple[re.Pattern, FaultKind | str, Severity | None]] = [
            (re.compile(p), k, s) for p, k, s in _DEFAULT
        ]

    def register(self, pattern: str, kind: FaultKind, severity: Severity | None = Severity.HIGH) -> None:
        """Add a rule that is tried before the built-in ones.

        ``severity=None`` means "corrupted if inside an optimizer update,
        else high".
        """
        self._rules.insert(0, (re.compile(pattern), kind, severity))

    def classify(self, error: BaseException | str, *, in_update: bool = False) -> Classification:
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        for pattern, kind, severity in self._rules:
            if pattern.search(text):
                if severity is None:
                    severity = Severity.CORRUPTED if in_update else Severity.HIGH
                return Classification(kind, severity)
        return Classification(FaultKind.UNKNOWN, Severity.HIGH)
