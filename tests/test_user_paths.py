"""What a new user reads and runs does what the docs say: the README's loop, the names and commands
the docs give (TaskD's API, ``trainguard rehearse --help``, ``trainguard ckpt verify`` on each layout,
``trainguard run --framework mindspore``'s flags), the CPU install line, FSDP's refusal. Cheap: no
training job is launched."""

from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def first_loop(text: str) -> str:
    """The page's whole training loop: its first Python block that runs ``guard.steps``."""
    loops = [b for b in python_blocks(text) if "guard.steps(" in b]
    assert loops, "the page shows no training loop"
    return loops[0]


def free_names(code: str) -> set[str]:
    """Names a snippet reads that it neither imports nor assigns (nor are builtins)."""
    tree = ast.parse(code)
    bound = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return used - bound


def declared_yours(text: str) -> set[str]:
    """The placeholders a page declares as the user's: "(`net`, `batch` ... are yours.)"."""
    out: set[str] = set()
    for line in re.findall(r"\(([^()]*) (?:is|are) yours\.\)", text):
        out.update(re.findall(r"`(\w+)`", line))
    return out


@pytest.mark.parametrize("page", [README, DOCS / "torch.md"], ids=lambda p: p.name)
def test_the_training_loop_a_page_shows_names_nothing_it_does_not_import_or_declare(page):
    text = page.read_text()
    code = first_loop(text)
    missing = free_names(code) - declared_yours(text)
    assert not missing, f"{page.name}'s loop uses {sorted(missing)}: a NameError when a user runs it"


@pytest.mark.parametrize("page", [README, DOCS / "torch.md"], ids=lambda p: p.name)
def test_the_loop_users_copy_keeps_an_evaluation_out_of_the_hang_watchdog(page):
    assert 'guard.section("evaluation")' in first_loop(page.read_text())


def test_the_taskd_package_exports_the_names_the_docs_give_it():
    import trainguard.compat.taskd as taskd
    from trainguard.compat.taskd import api

    named = re.search(r"`trainguard\.compat\.taskd`: (.*?)\)", " ".join(README.read_text().split())).group(1)
    names = re.findall(r"`(\w+)`", named)
    assert names == ["init_taskd_manager", "start_taskd_manager", "init_taskd_worker", "start_taskd_worker"]
    for name in names:
        assert name in taskd.__all__ and getattr(taskd, name) is getattr(api, name)


def test_rehearse_help_is_rehearses_own_and_runs_nothing(capsys):
    from trainguard.cli import main

    assert main(["rehearse", "--help"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("usage: trainguard rehearse [--quick]") and "--kinds" in out
    assert "fault-free" not in err and not err.strip(), err


@pytest.mark.parametrize("naming, name, tracker", [
    ("MINDSPORE", "rank_0/ttp_rank_0-0_6.ckpt", "latest_tft_step.txt"),
    ("MEGATRON", "mp_rank_00/model_optim_rng.pt", "latest_checkpointed_iteration.txt"),
    ("TORCH", "shard_k0_r0.pt", "latest_step.txt"),
])
def test_ckpt_verify_finds_each_layout_by_itself(tmp_path, capsys, naming, name, tracker):
    import trainguard.core as core
    from trainguard.cli import main

    store = core.CheckpointStore(tmp_path, getattr(core, naming))
    info = store.write_path(6, name, lambda p: p.write_bytes(b"weights"))
    store.finalize(6, [info], layout={"world_size": 1, "shards": [
        {"kind": 0, "copies": [0], "full": True, "saved_by": 0, "files": [name]}]})
    assert (tmp_path / tracker).exists()
    assert main(["ckpt", "verify", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("ok ")
    broken = next(p for p in tmp_path.rglob("*") if p.is_file() and p.name == Path(name).name)
    broken.write_bytes(b"weightz")
    assert main(["ckpt", "verify", str(tmp_path)]) == 1
    assert "BROKEN" in capsys.readouterr().out


def test_the_cpu_install_lines_take_the_cpu_wheel():
    """PyPI's torch 2.13.0 for Linux x86_64 is the CUDA build (it requires cuda-toolkit and nvidia-*
    wheels): only the local version 2.13.0+cpu, from PyTorch's CPU index, is the CPU one. The pin makes
    pip without that index stop (ResolutionImpossible) instead of downloading the CUDA build."""
    pins = [line.split("#")[0].strip() for line in (ROOT / "constraints-cpu.txt").read_text().splitlines()]
    assert "torch==2.13.0+cpu" in pins
    text = README.read_text()
    installs = [line for line in text.splitlines() if "-c constraints-cpu.txt" in line and "[torch" in line
                and "ci:" not in line]
    user_lines = [line for line in installs if "pytest" not in line]  # CI's own line: its machines hold the wheel
    assert user_lines and all("--extra-index-url https://download.pytorch.org/whl/cpu" in line
                              for line in user_lines), user_lines


def test_fsdp_is_named_as_refused_where_users_look_and_the_guard_refuses_it():
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel

    from trainguard.adapters.torch.sharding import refuse_unsupported
    from trainguard.core import ConfigError

    text = (DOCS / "torch.md").read_text()
    assert "FSDP" in text and "refused" in text.split("FSDP", 1)[1][:400]

    class Wrapped(FullyShardedDataParallel):  # an instance without a process group
        def __init__(self):
            torch.nn.Module.__init__(self)

    with pytest.raises(ConfigError, match="FSDP"):
        model = torch.nn.Sequential(torch.nn.Linear(2, 2), Wrapped())
        refuse_unsupported(model, torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize("given, expected", [
    (["--nproc-per-node", "2", "train.py", "--lr", "1"],
     ["--local_worker_num=2", "--worker_num=2", "train.py", "--lr", "1"]),
    (["--nproc_per_node=4", "--nnodes", "2", "--node-rank=1", "--master-addr", "h", "t.py"],
     ["--local_worker_num=4", "--node_rank=1", "--master_addr=h", "--worker_num=8", "t.py"]),
    (["--worker_num=2", "--local_worker_num=2", "--join=True", "t.py"],
     ["--worker_num=2", "--local_worker_num=2", "--join=True", "t.py"]),
])
def test_trainguard_run_for_mindspore_takes_torchruns_worker_count_as_well_as_msruns(given, expected):
    from trainguard.launcher.msrun import msrun_argv

    assert msrun_argv(given) == expected


@pytest.mark.parametrize("given", [["--nproc-per-node", "2", "--local_worker_num", "2", "t.py"],
                                   ["--nnodes", "2", "t.py"], ["--nproc-per-node", "1:2", "t.py"]])
def test_trainguard_run_for_mindspore_refuses_conflicting_counts(given):
    from trainguard.core import TrainguardError
    from trainguard.launcher.msrun import msrun_argv

    with pytest.raises(TrainguardError):
        msrun_argv(given)


def test_the_launchers_page_names_mindsporess_flags_and_default():
    text = (DOCS / "launchers.md").read_text()
    assert "--framework mindspore" in text and "--nproc-per-node" in text.split("--framework mindspore", 1)[1]
    assert "8 workers" in text
