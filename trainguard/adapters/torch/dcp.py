"""Checkpoints of sharded state in torch.distributed.checkpoint's (DCP's)
format, written and read without collectives.

A DCP checkpoint is a directory of data files (``__<rank>_<n>.distcp``)
and one ``.metadata`` naming, for every tensor, its global size and the
chunks each file holds. ``dcp.save`` agrees on that metadata in
collectives over every rank; a dying gasp has lost a rank, so each saver
here plans and writes its own part alone (:func:`write_part`: its data file
and its own ``__<rank>.metadata``, DCP's rank-local form) and the
finaliser merges the savers' metadata into the global ``.metadata``
(:func:`merge`) once they are all on storage. DCP, torchtitan or any
reader of the format loads the result as it loads a checkpoint ``dcp.save``
wrote; :func:`read_into` reads one (trainguard's or the user's own) into
this rank's part of the state, again without collectives.

Nothing untrusted is unpickled: ``.metadata`` is a pickle, read by an
unpickler that builds only DCP's metadata classes (:func:`read_metadata`),
and a value DCP stored as bytes is loaded with ``weights_only=True``.
:func:`coverage_problem` checks that a checkpoint's chunks tile every
tensor it names.
"""

from __future__ import annotations

import dataclasses
import io
import math
import pickle
import warnings
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.storage import WriteResult

from trainguard.core import CheckpointError

__all__ = ["METADATA", "coverage_problem", "merge", "part_files", "read_into", "read_metadata", "write_part"]

METADATA = ".metadata"

#: What a DCP ``.metadata`` pickle may build: DCP's metadata dataclasses,
#: the torch values they hold, and plain containers.
_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint._extension", "StreamTransformExtension"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),  # StorageMeta's checkpoint_id
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "tuple"), ("builtins", "list"),
    ("builtins", "dict"), ("builtins", "object"), ("copyreg", "_reconstructor"),
}
_DTYPES = {str(d).removeprefix("torch.") for d in vars(torch).values() if isinstance(d, torch.dtype)}
#: The largest ``.metadata`` read (a few hundred bytes per tensor chunk).
MAX_METADATA = 512 << 20


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "torch" and name in _DTYPES):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")


def read_metadata(path: Path) -> Metadata:
    """A DCP ``.metadata`` file (or a rank's ``__<rank>.metadata``).

    Raises:
        CheckpointError: unreadable, too large, or naming anything but DCP's
            metadata classes (nothing else is built).
    """
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_METADATA + 1)
        if len(data) > MAX_METADATA:
            raise CheckpointError(f"{path} is larger than {MAX_METADATA >> 20} MiB")
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path} is not a readable DCP metadata file: {type(e).__name__}: {e}") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict) \
            or not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"{path} is not a DCP metadata file")
    return metadata


def part_files(rank: int, directory: Path) -> list[str]:
    """The files :func:`write_part` wrote for ``rank`` in ``directory``."""
    return sorted(p.name for p in directory.glob(f"__{rank}_*.distcp")) + [f"__{rank}{METADATA}"]


def write_part(directory: Path, state: dict, rank: int) -> list[str]:
    """Write this saver's part of ``state`` (DTensors contribute their
    local shards, plain tensors and other values the whole) into
    ``directory`` as DCP's rank-local files, with no collective: DCP's
    planner and writer, run as a coordinator of one. Returns the files'
    names (data first, ``__<rank>.metadata`` last)."""
    writer = FileSystemWriter(directory, sync_files=True, overwrite=True)
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict=state, storage_meta=writer.storage_meta(), is_coordinator=True)
    writer.set_up_storage_writer(True, rank=rank, use_collectives=False)
    with warnings.catch_warnings():  # "an existing checkpoint... overwriting": another saver's part is there
        warnings.simplefilter("ignore")
        plan = writer.prepare_local_plan(planner.create_local_plan())
    plans, metadata = planner.create_global_plan([plan])
    plan = planner.finish_plan(writer.prepare_global_plan(plans)[0])
    results = writer.write_data(plan, planner).value()
    writer.finish(metadata, [results])
    return part_files(rank, directory)


def merge(directory: Path, ranks: Sequence[int]) -> None:
    """Merge the rank-local metadata of ``ranks`` (each written by
    :func:`write_part`) into the global ``.metadata`` of ``directory``:
    every tensor's chunks from all of them (a chunk two savers hold is
    taken from the first), every other value once.

    Raises:
        CheckpointError: a part is unreadable, or two parts disagree on a
            tensor's size or dtype.
    """
    merged = Metadata(state_dict_metadata={}, planner_data={}, storage_data={})
    for rank in ranks:
        part = read_metadata(directory / f"__{rank}{METADATA}")
        for fqn, item in part.state_dict_metadata.items():
            have = merged.state_dict_metadata.get(fqn)
            if have is None:
                merged.state_dict_metadata[fqn] = dataclasses.replace(item, chunks=list(item.chunks)) \
                    if isinstance(item, TensorStorageMetadata) else item
            elif isinstance(item, TensorStorageMetadata):
                if not isinstance(have, TensorStorageMetadata) or have.size != item.size or \
                        have.properties.dtype != item.properties.dtype:
                    raise CheckpointError(f"the parts of {directory} disagree on {fqn}")
                known = {tuple(c.offsets) for c in have.chunks}
                have.chunks.extend(c for c in item.chunks if tuple(c.offsets) not in known)
        if isinstance(part.planner_data, dict):
            for key, value in part.planner_data.items():
                merged.planner_data.setdefault(key, value)
        for index, info in part.storage_data.items():
            merged.storage_data.setdefault(index, info)
    writer = FileSystemWriter(directory, sync_files=True)
    writer.set_up_storage_writer(True)
    writer.finish(merged, [[WriteResult(index=i, size_in_bytes=s.length, storage_data=s)
                            for i, s in merged.storage_data.items()]])


def coverage_problem(directory: Path, files: Sequence[str] | None = None) -> str | None:
    """Why the DCP checkpoint in ``directory`` does not hold every tensor
    it names whole (``None``: each tensor's chunks tile it, each chunk is
    stored, in ``files`` when given).

    Raises:
        CheckpointError: its ``.metadata`` is unreadable.
    """
    metadata = read_metadata(directory / METADATA)
    stored = {(i.fqn, tuple(i.offset or ())): s for i, s in metadata.storage_data.items()}
    for fqn, item in metadata.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            if (fqn, ()) not in stored:
                return f"{fqn} has no stored value"
            continue
        chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in item.chunks]
        for offsets, sizes in chunks:
            info = stored.get((fqn, offsets))
            if info is None:
                return f"the chunk of {fqn} at {list(offsets)} is not stored"
            if files is not None and info.relative_path not in files:
                return f"the chunk of {fqn} at {list(offsets)} is in {info.relative_path}, which is not listed"
            if any(o < 0 or o + s > n for o, s, n in zip(offsets, sizes, item.size)):
                return f"a chunk of {fqn} at {list(offsets)} reaches past its size {list(item.size)}"
        if any(_overlap(a, b) for i, a in enumerate(chunks) for b in chunks[i + 1:]):
            return f"two chunks of {fqn} overlap"
        held, whole = sum(math.prod(s) for _, s in chunks), math.prod(item.size)
        if held != whole:
            return (f"{fqn} (size {list(item.size)}) is held in part: its chunks hold {held} of its {whole} "
                    "elements")
    return None


def _overlap(a: tuple, b: tuple) -> bool:
    (ao, asz), (bo, bsz) = a, b
    return all(x < y + ys and y < x + xs for x, xs, y, ys in zip(ao, asz, bo, bsz)) and \
        math.prod(asz) > 0 and math.prod(bsz) > 0


class _SafeReader(FileSystemReader):
    """DCP's file reader, with its ``.metadata`` read by :func:`read_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(Path(self.path) / METADATA)
        metadata.storage_meta = None
        return metadata


class _SafePlanner(DefaultLoadPlanner):
    """DCP's load planner, loading stored bytes with ``weights_only=True``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element  # noqa: PLC0415
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def read_into(directory: Path, state: dict) -> None:
    """Load the DCP checkpoint in ``directory`` into ``state`` in place
    (DTensors receive their local shards; other values are replaced in
    their containers), with no collective.

    Raises:
        CheckpointError: its metadata is unreadable, or it lacks a value
            ``state`` has, or a value does not fit.
    """
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore")
        try:
            dcp.load(state, storage_reader=_SafeReader(directory), planner=_SafePlanner(), no_dist=True)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - DCP raises its own CheckpointException and plain errors
            raise CheckpointError(f"{directory} does not load into this state: {type(e).__name__}: "
                                  f"{str(e)[:2000]}") from None
