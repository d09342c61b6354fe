"""Resumable data (issue 27): torchdata's ``StatefulDataLoader`` given as
``data=`` as it is, and a plain ``DataLoader`` in ``ResumableLoader``, go on
at the exact next batch after a dying gasp and a restart in place, epoch
boundaries included, bit-identical to a fault-free run.

The jobs run ``workers/data_train.py`` on 2 gloo ranks: a model with
dropout, a ``DistributedSampler`` of 6 batches per rank and epoch, ``set_epoch``
at each epoch, 15 steps (epochs 0 and 1, half of 2). Every rank logs each
step's sample indices; the last entry of a step is what it trained on.
The faults sit at the epoch boundary: the dump on the last batch of epoch 1
(step 11; the relaunch reads it, then crosses into epoch 2), the restart in
place at step 12, the first batch of epoch 2 (the survivor had crossed the
boundary in the step that failed and must cross it again).

Before: the same jobs with the loader given as the Guard took it before (a
``StatefulDataLoader``'s own state only: ``stateful-raw``) or not given
(a plain ``DataLoader``, which the Guard refused: ``bare``) resume on the
wrong batches -- the ``-m slow`` tests at the end show it."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from conftest import WORKERS, run_job
from trainguard.adapters.torch.data import StatefulLoaderPosition, resumable
from trainguard.adapters.torch.own import pack, unpack
from trainguard.torch import ResumableLoader

torchdata = pytest.importorskip("torchdata.stateful_dataloader")
StatefulDataLoader = torchdata.StatefulDataLoader

pytestmark = [pytest.mark.timeout(400),
              pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")]  # torchdata 0.11 on newer torch

SCRIPT = WORKERS / "data_train.py"
STEPS = 15
DUMP = "crash:rank=1,step=11,phase=forward"  # the last batch of epoch 1
IN_PLACE = "crash:rank=1,step=12,phase=backward"  # the first batch of epoch 2


# ------------------------------------------------------------------ in one process
class Counted(Dataset):
    """Sample ``i`` is ``i``; counts the samples loaded."""

    def __init__(self, n: int) -> None:
        self.n, self.loaded = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.loaded += 1
        return i


def _sampler(dataset, rank: int = 1) -> DistributedSampler:
    return DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=3)


def _take(it, n: int) -> list[list[int]]:
    return [next(it).tolist() for _ in range(n)]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stateful_loader_keeps_its_samplers_epoch_and_moves_the_held_iterator_back(workers):
    dataset = Counted(40)
    sampler = _sampler(dataset)
    loader = StatefulDataLoader(dataset, batch_size=4, sampler=sampler, num_workers=workers)
    position = resumable(loader)
    assert isinstance(position, StatefulLoaderPosition) and loader.generator is not None
    it = iter(loader)
    _take(it, 5)
    sampler.set_epoch(1)  # the next epoch, as a script does after StopIteration
    it = iter(loader)
    _take(it, 2)
    saved = unpack(pack({"data": position.state_dict()}))["data"]  # the own part's round trip
    assert saved["epoch"] == 1
    expected = _take(it, 3)
    sampler.set_epoch(5)  # whatever happened after the commit
    position.load_state_dict(copy.deepcopy(saved))
    assert sampler.epoch == 1
    assert _take(it, 3) == expected, "the iterator the script holds goes on after the loaded position"

    # a new process: the loaded position is where iter(loader) starts
    dataset2 = Counted(40)
    sampler2 = _sampler(dataset2)
    loader2 = StatefulDataLoader(dataset2, batch_size=4, sampler=sampler2, num_workers=workers)
    resumable(loader2).load_state_dict(saved)
    assert sampler2.epoch == 1 and _take(iter(loader2), 3) == expected
    if workers == 0:
        assert dataset2.loaded == 12, "the batches before the position are skipped by index, not loaded"


def test_a_new_iterator_draws_nothing_from_the_global_stream():
    dataset = TensorDataset(torch.arange(40))
    for wrap in (lambda d: resumable(StatefulDataLoader(d, batch_size=4, sampler=_sampler(d))).loader,
                 lambda d: ResumableLoader(DataLoader(d, batch_size=4, sampler=_sampler(d)))):
        source = wrap(dataset)
        before = torch.get_rng_state()
        for _ in range(3):
            next(iter(source))
        assert torch.equal(before, torch.get_rng_state())


def test_a_plain_data_loader_is_refused_with_the_way_out():
    dataset = TensorDataset(torch.arange(8))
    with pytest.raises(TypeError, match="ResumableLoader"):
        resumable(DataLoader(dataset, batch_size=2))
    with pytest.raises(TypeError, match="batch"):
        ResumableLoader(DataLoader(dataset, batch_size=None))

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(8))

    with pytest.raises(TypeError, match="map-style"):
        ResumableLoader(DataLoader(Stream(), batch_size=2))

    class Own(DataLoader):  # a loader of the user's that saves its own position is taken as it is
        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    own = Own(dataset)
    assert resumable(own) is own


@pytest.mark.parametrize("workers,persistent", [(0, False), (1, True)])
def test_a_resumable_loader_resumes_at_the_next_batch_by_skipping_indices(workers, persistent):
    dataset = Counted(40)
    sampler = _sampler(dataset, rank=0)
    data = ResumableLoader(DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=workers,
                                      persistent_workers=persistent))
    batches = iter(data)
    _take(batches, 5)
    assert next(batches, None) is None  # 5 batches of 4 per rank
    sampler.set_epoch(sampler.epoch + 1)
    batches = iter(data)
    _take(batches, 2)
    saved = unpack(pack({"data": data.state_dict()}))["data"]
    assert (saved["epoch"], saved["batches"]) == (1, 2)
    expected = _take(batches, 3)
    data.load_state_dict(saved)  # a rollback: the held iterator goes back
    assert _take(batches, 3) == expected
    assert next(batches, None) is None
    sampler.set_epoch(sampler.epoch + 1)
    epoch2 = _take(iter(data), 5)

    dataset2 = Counted(40)
    sampler2 = _sampler(dataset2, rank=0)
    data2 = ResumableLoader(DataLoader(dataset2, batch_size=4, sampler=sampler2, num_workers=workers,
                                       persistent_workers=persistent))
    data2.load_state_dict(saved)  # a new process
    batches2 = iter(data2)
    assert sampler2.epoch == 1 and _take(batches2, 3) == expected
    if workers == 0:
        assert dataset2.loaded == 12, "the 2 batches before the position are skipped by index, not loaded"
    assert next(batches2, None) is None
    sampler2.set_epoch(sampler2.epoch + 1)
    assert _take(iter(data2), 5) == epoch2, "the next epoch is whole and in the fault-free order"


# ------------------------------------------------------------------ jobs
def _job(tmp, name: str, mode: str, **kwargs):
    env = {"DATA_MODE": mode, "PYTHONWARNINGS": "ignore::UserWarning"}
    return run_job(tmp, name, nproc=2, steps=STEPS, script=SCRIPT, env=env, **kwargs)


def test_a_plain_data_loader_given_as_data_stops_the_job_with_the_way_out_and_nothing_else(tmp_path):
    """Refused on every rank before step 0; the round ends without the
    warning that a node agent is gone (it left because of that refusal;
    before issue 37 the warning followed the refusal)."""
    job = _job(tmp_path, "raw", "raw")
    assert job.rc not in (0, 75), job
    assert "wrap it in trainguard.torch.ResumableLoader" in job.log
    assert "is gone" not in job.log, job


def batches(job) -> dict[int, dict[int, tuple]]:
    """Per rank: step -> (epoch, sample indices) it trained on (the last entry of a redone step)."""
    out: dict[int, dict[int, tuple]] = {}
    for rank in (0, 1):
        steps: dict[int, tuple] = {}
        for line in job.report_path.with_name(f"{job.report_path.name}.trace.rank{rank}").read_text().splitlines():
            step, epoch, indices = json.loads(line)
            steps[step] = (epoch, indices)
        out[rank] = steps
    return out


def finals(job) -> dict:
    """Per rank: model + optimizer, and the random streams (dropout's) at the end."""
    out = {}
    for rank, path in enumerate([job.report_path, job.report_path.with_name(job.report_path.name + ".rank1")]):
        report = json.loads(path.read_text())
        out[rank] = (report["final_state_sha256"], report["rng_sha256"])
    return out


def _reference(tmp_path_factory, mode: str) -> tuple[dict, dict]:
    job = _job(tmp_path_factory.mktemp(f"reference-{mode}"), "reference", mode)
    assert job.rc == 0, job
    seen = batches(job)
    assert sorted(seen[1]) == list(range(STEPS)) and [seen[1][s][0] for s in (5, 6, 11, 12)] == [0, 1, 1, 2]
    assert seen[0][0][1] != seen[1][0][1], "the ranks read different shards"
    return batches(job), finals(job)


@pytest.fixture(scope="module")
def stateful_reference(tmp_path_factory):
    return _reference(tmp_path_factory, "stateful")


@pytest.fixture(scope="module")
def resumable_reference(tmp_path_factory):
    return _reference(tmp_path_factory, "resumable")


def _same_as(job, reference) -> None:
    expected_batches, expected_finals = reference
    got = batches(job)
    for rank in (0, 1):
        wrong = [s for s in range(STEPS) if got[rank].get(s) != expected_batches[rank][s]]
        assert not wrong, (f"rank {rank} trained on other batches from step {wrong[0]}: "
                           f"{got[rank].get(wrong[0])} instead of {expected_batches[rank][wrong[0]]}")
    assert finals(job) == expected_finals, "not bit-identical to the fault-free run"


def _dump_and_relaunch(tmp_path, mode: str):
    first = _job(tmp_path, "job", mode, fault=DUMP, strategies="dump")
    assert first.rc == 75, first
    second = _job(tmp_path, "job", mode, fault=DUMP, strategies="dump", ckpt=first.ckpt)
    assert second.rc == 0, second
    (record,) = second.report["recoveries"]
    assert (record["strategy"], record["step"], record["rank"]) == ("dump", 11, 1)
    return second


def _in_place(tmp_path, mode: str):
    job = _job(tmp_path, "job", mode, fault=IN_PLACE, strategies="recover-in-place,dump",
               extra_args=["--max-restarts", "1"])
    assert job.rc == 0, job
    (record,) = job.report["recoveries"]
    assert (record["strategy"], record["step"]) == ("recover-in-place", 12), record
    assert len(job.report["pids"]["1"]) == 2 and len(job.report["pids"]["0"]) == 1
    return job


@pytest.mark.serial  # two launches (~20 s alone)
def test_a_stateful_loader_goes_on_at_the_next_batch_after_a_dying_gasp(tmp_path, stateful_reference):
    job = _dump_and_relaunch(tmp_path, "stateful")
    _same_as(job, stateful_reference)
    assert job.report["lost_steps"] == 0


@pytest.mark.serial  # ~20 s alone
def test_a_stateful_loader_goes_on_at_the_next_batch_after_a_restart_in_place(tmp_path, stateful_reference):
    job = _in_place(tmp_path, "stateful")
    _same_as(job, stateful_reference)
    assert "took its random streams and data position at step 12" in job.log, "the new rank's own, not rank 0's"


@pytest.mark.serial  # two launches (~20 s alone)
def test_a_resumable_loader_goes_on_at_the_next_batch_after_a_dying_gasp(tmp_path, resumable_reference):
    job = _dump_and_relaunch(tmp_path, "resumable")
    _same_as(job, resumable_reference)


@pytest.mark.slow  # stands for it in CI: test_a_stateful_loader_goes_on_at_the_next_batch_after_a_restart_in_place
def test_a_resumable_loader_goes_on_at_the_next_batch_after_a_restart_in_place(tmp_path, resumable_reference):
    _same_as(_in_place(tmp_path, "resumable"), resumable_reference)


@pytest.mark.slow  # the retry rolls every rank back in its own process, as the survivor of a restart in place
@pytest.mark.parametrize("mode", ["stateful", "resumable"])
def test_a_retried_step_at_the_epoch_boundary_reads_its_batch_again(tmp_path, mode, stateful_reference,
                                                                   resumable_reference):
    job = _job(tmp_path, "job", mode, fault="uce:rank=1,step=12,phase=forward")
    assert job.rc == 0, job
    assert [r["strategy"] for r in job.report["recoveries"]] == ["retry"]
    _same_as(job, stateful_reference if mode == "stateful" else resumable_reference)


# ------------------------------------------------------------------ before
def _differs(job, reference, first_step: int) -> None:
    expected_batches, expected_finals = reference
    got = batches(job)
    wrong = sorted(s for s in range(STEPS) if got[1].get(s) != expected_batches[1][s])
    assert wrong and wrong[0] == first_step, wrong
    assert finals(job) != expected_finals


@pytest.mark.slow  # what the Guard did before issue 27: shows the tests above catch it
def test_before_a_stateful_loaders_own_state_loses_the_epoch(tmp_path, tmp_path_factory):
    reference = _reference(tmp_path_factory, "stateful-raw")
    job = _dump_and_relaunch(tmp_path, "stateful-raw")
    _differs(job, reference, 11)  # step 11 read epoch 0's permutation: set_epoch(1) was not saved
    assert batches(job)[1][11][0] == 0
    (tmp_path / "in-place").mkdir()
    job = _in_place(tmp_path / "in-place", "stateful-raw")
    _differs(job, reference, 12)


@pytest.mark.slow  # what a script had to do before issue 27: leave its plain DataLoader out
def test_before_a_plain_loader_left_out_starts_over(tmp_path, tmp_path_factory):
    reference = _reference(tmp_path_factory, "bare")
    job = _dump_and_relaunch(tmp_path, "bare")
    _differs(job, reference, 11)  # the relaunch reads epoch 0's first batch at step 11
    assert batches(job)[1][11][0] == 0
