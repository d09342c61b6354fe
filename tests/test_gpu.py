"""The CUDA / NCCL path (needs two GPUs; skipped elsewhere, CI included)."""

import pytest

from conftest import run_job

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices for a 2-rank NCCL job"),
]
CUDA = {"TINY_DEVICE": "cuda"}


def test_nccl_comm_failure_is_retried_and_a_uce_is_dumped(tmp_path):
    ref = run_job(tmp_path, "ref", nproc=2, env=CUDA)
    assert ref.rc == 0, ref
    comm = run_job(tmp_path, "comm", nproc=2, env=CUDA, fault="comm:rank=1,step=4,phase=backward")
    assert comm.rc == 0, comm
    assert comm.report["final_state_sha256"] == ref.report["final_state_sha256"]
    assert comm.report["recoveries"][0]["strategy"] == "retry"
    # A real UCE poisons the CUDA context: no in-process repair. The controller ends that rank's process
    # (exit 76) and, without a restart budget (run_job's --max-restarts 0), the job is dumped and resumed.
    uce = run_job(tmp_path, "uce", nproc=2, env=CUDA, fault="uce:rank=1,step=4,phase=backward")
    assert uce.rc == 75, uce
    assert "this rank's device cannot be repaired in the process" in uce.log
    again = run_job(tmp_path, "uce", nproc=2, env=CUDA, fault="uce:rank=1,step=4,phase=backward", ckpt=uce.ckpt)
    assert again.rc == 0, again
    assert again.report["final_state_sha256"] == ref.report["final_state_sha256"]
