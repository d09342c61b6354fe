"""The run-time profiling switch: a JSON file that turns markers on and off.

The file is TaskD's ``profilingSwitch`` (a Kubernetes ConfigMap key mounted
as a file works as is)::

    {"CommunicationOperator":"off","Step":"on","SaveCheckpoint":"on","FP":"on","DataLoader":"on"}

``Step``, ``FP``, ``DataLoader`` and ``SaveCheckpoint`` switch together, so
they must agree; ``CommunicationOperator`` switches alone, but only while the
other four are on (TaskD's rule: to turn the four off, turn Communication off
too). A missing key counts as ``"off"``. A file that cannot be read, is not
JSON, has an unknown key or value, or breaks those rules turns everything
off, and :class:`SwitchFile` says why once -- not once per poll.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from ..api import ConfigError

__all__ = ["MARKER_KEYS", "OFF", "Switch", "SwitchFile", "parse_switch"]

log = logging.getLogger("trainguard.profiling")

#: The keys that switch together (TaskD's names).
MARKER_KEYS = ("Step", "FP", "DataLoader", "SaveCheckpoint")
COMM_KEY = "CommunicationOperator"


@dataclass(frozen=True)
class Switch:
    """What is on: the four markers together, and communication."""

    markers: bool = False
    communication: bool = False

    def describe(self) -> str:
        if not self.markers:
            return "all markers off"
        return "Step/FP/DataLoader/SaveCheckpoint on, Communication " + ("on" if self.communication else "off")


OFF = Switch()


def parse_switch(text: str) -> Switch:
    """The switch a file's text asks for.

    Raises:
        ConfigError: not a JSON object of ``"on"``/``"off"`` values with
            TaskD's keys, or the four markers disagree, or Communication is
            on without them.
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"not JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"expected a JSON object, got {type(data).__name__}")
    known = (COMM_KEY, *MARKER_KEYS)
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown}; known: {list(known)}")
    values = {}
    for key in known:
        value = data.get(key, "off")
        if not isinstance(value, str) or value.strip().lower() not in ("on", "off"):
            raise ConfigError(f"{key} must be \"on\" or \"off\", got {value!r}")
        values[key] = value.strip().lower() == "on"
    markers = {values[k] for k in MARKER_KEYS}
    if len(markers) > 1:
        on = [k for k in MARKER_KEYS if values[k]]
        raise ConfigError(f"Step, FP, DataLoader and SaveCheckpoint switch together, but only {on} are on")
    switch = Switch(markers=values["Step"], communication=values[COMM_KEY])
    if switch.communication and not switch.markers:
        raise ConfigError("CommunicationOperator is on while Step/FP/DataLoader/SaveCheckpoint are off; "
                          "turn the four on, or Communication off too")
    return switch


class SwitchFile:
    """Polls a switch file; cheap when nothing changed (one ``stat``).

    Args:
        path: the file (a ConfigMap mount replaces it through a symlink,
            which ``stat`` follows).
        rank: for log lines (only rank 0 logs above DEBUG).
    """

    def __init__(self, path: str | os.PathLike, *, rank: int = 0) -> None:
        self.path = Path(path)
        self.rank = rank
        self.current = OFF
        self.problem = ""
        self._seen: tuple | None = None

    def poll(self) -> Switch:
        """Read the file if it changed; return the switch now in force."""
        try:
            st = os.stat(self.path)
            key: tuple = (st.st_ino, st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            key = ("missing",)
        except OSError as e:
            key = ("error", str(e))
        if key == self._seen:
            return self.current
        self._seen = key
        if key == ("missing",):
            self._set(OFF, f"profiling switch {self.path} does not exist: all markers off")
            return self.current
        try:
            switch = parse_switch(self.path.read_text())
        except (OSError, UnicodeDecodeError, ConfigError) as e:
            self._set(OFF, f"profiling switch {self.path} is unusable, all markers off: {e}")
        else:
            self._set(switch, "")
        return self.current

    def _set(self, switch: Switch, problem: str) -> None:
        if problem:
            if problem != self.problem:  # every rank reads the same file: rank 0 speaks for them
                log.log(logging.WARNING if self.rank == 0 else logging.DEBUG, "rank %d: %s", self.rank, problem)
        elif switch != self.current or self.problem:
            log.log(logging.INFO if self.rank == 0 else logging.DEBUG, "rank %d: profiling switch: %s",
                    self.rank, switch.describe())
        self.problem = problem
        self.current = switch
