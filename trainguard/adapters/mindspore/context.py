"""Where a MindSpore process stands in its job: rank and world size, its
machine, its replica group, and how MindSpore's errors are classified."""

from __future__ import annotations

import hashlib
import re
import socket
from pathlib import Path

import mindspore as ms

from trainguard.core import Classifier, ConfigError, FaultKind, ReplicaGroup


def host_id() -> int:
    """The same number on every process of this machine (boot), another on others."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    digest = hashlib.sha256(f"{socket.gethostname()}/{boot}".encode()).digest()
    return int.from_bytes(digest[:4], "big") >> 1  # 31 bits: what the Guard's all-gather carries


def rank_and_size() -> tuple[int, int]:
    from mindspore.communication import GlobalComm, get_group_size, get_rank

    if not GlobalComm.INITED:
        return 0, 1
    return get_rank(), get_group_size()


def data_parallel_group(world_size: int) -> ReplicaGroup:
    mode = ms.get_auto_parallel_context("parallel_mode")
    if mode not in ("stand_alone", "data_parallel"):
        raise ConfigError(f"parallel_mode {mode!r} shards parameters; pass `replicas=` describing which ranks hold "
                          f"copies of each shard (trainguard derives it only for data parallel)")
    return ReplicaGroup.full(range(world_size))


# PyNative: "Launch kernel failed, name:...AllReduce"; a compiled graph: "Launch kernel failed: .../AllReduce-op0".
FAILED_COLLECTIVE = re.compile(r"Launch kernel failed(, name)?:.*(AllReduce|AllGather|Broadcast)")


def brief(error: BaseException) -> str:
    """``Type: message`` of ``error`` on one line, without the sections
    MindSpore appends to its errors' text for its developers (the C++ call
    stack, the traced graph code) and their dashed banners."""
    lines: list[str] = []
    for line in str(error).splitlines():
        text = line.strip()
        header = text.startswith("- ") and text.endswith(":")
        if "(For framework developers)" in text or (header and lines):
            break
        if text and set(text) != {"-"} and not header:
            lines.append(text)
    return f"{type(error).__name__}: {' '.join(lines)}" if lines else type(error).__name__


def classifier() -> Classifier:
    """The core's rules plus MindSpore's own error texts."""
    c = Classifier()
    c.register(r"UCEError|HBM_MULTI_BIT_ECC", FaultKind.UCE, None)
    c.register(r"HCCEError|SuspectRemoteError", FaultKind.COMM)
    c.register(r"CommunicationBroken", FaultKind.COMM)
    c.register(FAILED_COLLECTIVE.pattern, FaultKind.COMM)
    return c


def world_group() -> str:
    """The world communication group's name (for profiling records)."""
    from mindspore.communication import GlobalComm

    return GlobalComm.WORLD_COMM_GROUP if GlobalComm.INITED else "world"
