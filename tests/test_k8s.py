"""Kubernetes: the pod-annotations file and where strategies come from
(trainguard.core.annotations, both launchers), and the manifests in
deploy/k8s/ -- valid against the pinned API schemas offline, a broken copy
refused, and mounting what trainguard reads."""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainguard.core import ConfigError
from trainguard.core import annotations as ann
from trainguard.core.api import Strategy
from trainguard.core.config import ENV, parse_strategies

pytest.importorskip("jsonschema", reason="the manifests' schemas (the dev extra; a GPU image lacks it)")

from k8s_files import (DEPLOY, MANIFESTS, by_kind, containers, env_of, expand, flag, jobs, kubelet_file,
                       manifest_docs, mounted, mutations, validate)


@pytest.fixture
def no_default_file(monkeypatch, tmp_path):
    """The default path points nowhere, whatever this machine has at /etc/podinfo."""
    monkeypatch.setattr(ann, "DEFAULT_PATH", str(tmp_path / "absent" / "annotations"))


# --------------------------------------------------------------- the file

def test_parses_what_the_kubelet_writes():
    text = ('kubernetes.io/config.seen="2026-11-26T21:00:00.123456789Z"\n'
            'kubernetes.io/config.source="api"\n'
            'note="say \\"hi\\"\\\\ \\a\\b\\f\\n\\r\\t\\v \\x00\\x7f \\u2028 \\U0001f600 é 😀 \\101\\xc3\\xa9"\n'
            'recover-strategy="retry,recover-in-place,dump,exit"\n'
            'volcano.sh/job-name="mindspore-resnet50"')  # the kubelet trims the last newline
    got = ann.parse_annotations(text)
    assert got == {
        "kubernetes.io/config.seen": "2026-11-26T21:00:00.123456789Z",
        "kubernetes.io/config.source": "api",
        "note": 'say "hi"\\ \a\b\f\n\r\t\v \x00\x7f \u2028 \U0001f600 é 😀 Aé',
        "recover-strategy": "retry,recover-in-place,dump,exit",
        "volcano.sh/job-name": "mindspore-resnet50",
    }
    assert ann.parse_annotations(text + "\n") == got  # a hand-written copy may end in a newline
    assert ann.parse_annotations("") == {}  # a pod without annotations


_keys = st.from_regex(r"(?:[a-z0-9]{1,8}(?:\.[a-z0-9]{1,8}){0,2}/)?[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,10}[A-Za-z0-9])?",
                      fullmatch=True)


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(_keys, st.text(st.characters(exclude_categories=("Cs",)), max_size=40), max_size=6))
def test_any_annotations_round_trip(annotations):
    assert ann.parse_annotations(kubelet_file(annotations)) == annotations


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from('ab-./="\\\nxu0179fé\r '), max_size=30))
def test_any_text_parses_or_is_a_config_error(text):
    try:
        ann.parse_annotations(text)
    except ConfigError:
        pass


@pytest.mark.parametrize("text, message", [
    ("recover-strategy=retry", "line 1: the value is not a double-quoted string"),
    ('recover-strategy="retry', "not a double-quoted string"),
    ('recover-strategy="re"try"', "an unescaped '\"'"),
    ('recover-strategy "retry"', 'line 1: expected key="value"'),
    ('="retry"', "is not an annotation key"),
    ('bad key="x"', "is not an annotation key"),
    ('-bad="x"', "is not an annotation key"),
    ('a="1"\n\nb="2"', 'line 2: expected key="value"'),
    ('a="1"\r\nb="2"', "line 1: the value is not a double-quoted string"),
    ('a="1"\na="2"', "line 2: an annotation is given twice"),
    ('a="\\q"', "an escape Go does not know"),
    ('a="\\x4"', "\\x needs 2 hex digits"),
    ('a="\\u12"', "\\u needs 4 hex digits"),
    ('a="\\ud800"', "not a Unicode code point"),
    ('a="\\400"', "octal escape"),
    ('a="\\xff"', "not UTF-8"),
    ('a="x\\"', "ends in a lone backslash"),
])
def test_a_malformed_file_is_an_error_naming_file_and_line(text, message):
    with pytest.raises(ConfigError) as e:
        ann.parse_annotations(text, "/etc/podinfo/annotations")
    assert "/etc/podinfo/annotations line" in str(e.value) and message in str(e.value), str(e.value)


def test_a_file_that_is_not_utf8_is_an_error(tmp_path):
    path = tmp_path / "annotations"
    path.write_bytes(b'a="\xff"')
    with pytest.raises(ConfigError, match="cannot read the pod annotations file"):
        ann.read_annotations(path)


# ------------------------------------------------------------ precedence

def _file(tmp_path, **annotations) -> str:
    path = tmp_path / "annotations"
    path.write_text(kubelet_file({k.replace("_", "-"): v for k, v in annotations.items()}))
    return str(path)


def test_order_is_flag_env_annotation_default(tmp_path, no_default_file):
    path = _file(tmp_path, recover_strategy="recover-in-place,dump")
    env = {"TRAINGUARD_ANNOTATIONS": path, "TRAINGUARD_STRATEGIES": "retry,exit"}
    flag = ann.resolve_strategies("elastic-training,exit", env)
    assert (flag.text, flag.source) == ("elastic-training,exit", "--strategies")
    from_env = ann.resolve_strategies(None, env)
    assert (from_env.text, from_env.source) == ("retry,exit", "TRAINGUARD_STRATEGIES")
    del env["TRAINGUARD_STRATEGIES"]
    annotation = ann.resolve_strategies(None, env)
    assert annotation.strategies == (Strategy.RECOVER_IN_PLACE, Strategy.DUMP)
    assert annotation.source == f"annotation file {path}"
    assert annotation.describe() == f"strategies recover-in-place,dump (from annotation file {path})"
    default = ann.resolve_strategies(None, {})
    assert (default.text, default.source) == ("retry,dump,exit", "default")


def test_the_default_path_is_read_only_when_it_exists(tmp_path, monkeypatch):
    monkeypatch.setattr(ann, "DEFAULT_PATH", str(tmp_path / "annotations"))
    assert ann.resolve_strategies(None, {}).source == "default"
    path = _file(tmp_path, recover_strategy="dump,exit")
    choice = ann.resolve_strategies(None, {})
    assert (choice.text, choice.source) == ("dump,exit", f"annotation file {path}")


def test_a_file_without_the_annotation_gives_the_default(tmp_path, no_default_file):
    path = _file(tmp_path, other="x")
    assert ann.resolve_strategies(None, {"TRAINGUARD_ANNOTATIONS": path}).source == "default"


@pytest.mark.parametrize("content, message", [
    ('recover-strategy="retry,reboot"', "annotation file {path}: unknown recover strategy 'reboot'; valid: retry,"),
    ('recover-strategy=""', "annotation file {path}: the recover-strategy list is empty"),
    ('recover-strategy="dump,dump"', "annotation file {path}: recover strategy 'dump' is listed twice"),
    ("recover-strategy=dump", "{path} line 1: the value is not a double-quoted string"),
])
def test_a_bad_annotation_is_an_error(tmp_path, no_default_file, content, message):
    path = tmp_path / "annotations"
    path.write_text(content)
    with pytest.raises(ConfigError) as e:
        ann.resolve_strategies(None, {"TRAINGUARD_ANNOTATIONS": str(path)})
    assert message.format(path=path) in str(e.value), str(e.value)


def test_a_named_file_must_exist_and_the_flag_needs_no_file(tmp_path, no_default_file):
    env = {"TRAINGUARD_ANNOTATIONS": str(tmp_path / "missing")}
    with pytest.raises(ConfigError, match="TRAINGUARD_ANNOTATIONS=.*missing: no such file"):
        ann.resolve_strategies(None, env)
    assert ann.resolve_strategies("dump", env).source == "--strategies"  # the file is not consulted


def test_the_variable_is_a_known_setting():
    assert ann.ENV_VAR in ENV and "/etc/podinfo/annotations" in ENV[ann.ENV_VAR].default


def test_msrun_order_is_env_ms_enable_tft_annotation(tmp_path, no_default_file):
    from trainguard.launcher.msrun import strategies_from_env, strategy_choice

    env = {"TRAINGUARD_ANNOTATIONS": _file(tmp_path, recover_strategy="dump,exit")}
    assert strategy_choice(env).describe() == f"strategies dump,exit (from annotation file {tmp_path}/annotations)"
    env["MS_ENABLE_TFT"] = "{UCE:1,TTP:1}"
    assert strategy_choice(env).describe() == "strategies retry,dump,exit (from MS_ENABLE_TFT)"
    env["TRAINGUARD_STRATEGIES"] = "exit"
    assert strategy_choice(env).describe() == "strategies exit (from TRAINGUARD_STRATEGIES)"
    assert strategy_choice({}) is None and strategies_from_env({}) is None  # a patched msrun stays plain msrun


class _Manager:  # the parts of msrun's _ProcessManager that MsrunPlugin reads before starting anything
    worker_num, local_worker_num, master_port = 2, 2, 10970


def test_msrun_logs_where_its_strategies_came_from_first(tmp_path, monkeypatch, no_default_file, caplog):
    from trainguard.launcher import msrun

    monkeypatch.setenv("TRAINGUARD_ANNOTATIONS", _file(tmp_path, recover_strategy="retry,dump,exit"))
    monkeypatch.delenv("TRAINGUARD_STRATEGIES", raising=False)
    monkeypatch.delenv("MS_ENABLE_TFT", raising=False)
    monkeypatch.setenv("PATH", os.environ["PATH"])  # attach puts the interpreter's directory first
    manager = _Manager()
    monkeypatch.setitem(sys.modules, _Manager.__module__, type(sys)("fake"))
    assert msrun.attach(manager, force=True)

    class Stop(Exception):
        pass

    def stop():
        raise Stop

    monkeypatch.setattr(manager.handler, "_start_controller", stop)
    with caplog.at_level(logging.INFO, logger="trainguard"), pytest.raises(Stop):
        manager.handler.run()
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("trainguard")]
    assert lines == [f"strategies retry,dump,exit (from annotation file {tmp_path}/annotations)"]
    assert manager.handler.config.strategies == parse_strategies("retry,dump,exit")


def test_msrun_refuses_a_malformed_annotations_file(tmp_path, monkeypatch, no_default_file, capsys):
    from trainguard.launcher import msrun

    bad = tmp_path / "annotations"
    bad.write_text("recover-strategy=retry")
    monkeypatch.setenv("TRAINGUARD_ANNOTATIONS", str(bad))
    monkeypatch.delenv("TRAINGUARD_STRATEGIES", raising=False)
    monkeypatch.delenv("MS_ENABLE_TFT", raising=False)
    with pytest.raises(SystemExit) as e:
        msrun.attach(_Manager(), force=True)
    assert e.value.code == 2
    assert f"trainguard msrun: {bad} line 1: the value is not a double-quoted string" in capsys.readouterr().err


# ------------------------------------------------------ trainguard run

def _run(tmp_path, env, *args):
    full = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    full.update(env)
    script = tmp_path / "hello.py"
    script.write_text("import pathlib; pathlib.Path('ran').write_text('yes')\n")
    return subprocess.run([sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", "1", *args,
                           str(script)], capture_output=True, text=True, env=full, cwd=tmp_path, timeout=120)


def test_run_refuses_a_malformed_annotations_file_before_any_worker(tmp_path):
    bad = tmp_path / "annotations"
    bad.write_text('recover-strategy="retry"\nrecover-strategy="dump"')
    out = _run(tmp_path, {"TRAINGUARD_ANNOTATIONS": str(bad)})
    assert out.returncode == 2, out.stderr
    assert f"trainguard run: {bad} line 2: an annotation is given twice" in out.stderr
    assert not (tmp_path / "ran").exists()
    out = _run(tmp_path, {"TRAINGUARD_ANNOTATIONS": str(bad)}, "--strategies", "retry,reboot")
    assert out.returncode == 2 and "--strategies: unknown recover strategy 'reboot'" in out.stderr, out.stderr


def test_run_says_first_where_its_strategies_came_from(tmp_path):
    path = _file(tmp_path, recover_strategy="dump,exit")
    out = _run(tmp_path, {"TRAINGUARD_ANNOTATIONS": path})
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "ran").read_text() == "yes"
    ours = [line for line in out.stderr.splitlines() if line.startswith("[trainguard")]
    assert ours and ours[0].startswith("[trainguard launcher INFO"), out.stderr
    assert ours[0].endswith(f"] strategies dump,exit (from annotation file {path})"), out.stderr


# ------------------------------------------------------------ manifests

def test_the_manifests_are_there():
    kinds = sorted((d["apiVersion"], d["kind"]) for docs in manifest_docs().values() for d in docs)
    assert kinds == [("batch.volcano.sh/v1alpha1", "Job"), ("kubeflow.org/v1", "PyTorchJob"),
                     ("v1", "ConfigMap"), ("v1", "ConfigMap"), ("v1", "Secret")]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_manifest_is_valid_against_the_pinned_schemas(path):
    assert validate.check_file(path) == []


@pytest.mark.parametrize("mutation", list(mutations()))
@pytest.mark.parametrize("job", ["pytorchjob.yaml", "mindspore-vcjob.yaml"])
def test_a_broken_copy_is_refused(job, mutation):
    [doc] = validate.load(DEPLOY / job)
    assert validate.problems(doc) == []
    change, message = mutations()[mutation]
    broken = copy.deepcopy(doc)
    change(broken)
    found = validate.problems(broken)
    assert any(message in p for p in found), found


@pytest.mark.parametrize("edit, message", [
    (("kubeflow.org/v1", "restartPolicy: OnFailure", "restartPolicy: OnFail"), "'OnFail' not in"),
    (("kubeflow.org/v1", "Worker:\n", "Workers:\n"), "not a PyTorchJob replica type"),
    (("batch.volcano.sh", "action: AbortJob", "action: Abort"), "'Abort' not in"),
    (("batch.volcano.sh", "event: PodEvicted", "event: PodGone"), "'PodGone' is not one of"),
    (("batch.volcano.sh", "    svc: []", "    service: []"), "not a Volcano job plugin"),
    (("v1", "stringData:", "stringdata:"), "'stringdata' was unexpected"),
    (("v1", "kind: ConfigMap", "kind: ConfigMapp"), "no schema for v1 ConfigMapp"),
])
def test_a_broken_file_is_refused_by_the_command(tmp_path, edit, message):
    api, old, new = edit
    source = next(p for p in MANIFESTS if f"apiVersion: {api}" in p.read_text() and old in p.read_text())
    broken = tmp_path / source.name
    broken.write_text(source.read_text().replace(old, new, 1))
    out = subprocess.run([sys.executable, str(DEPLOY / "validate.py"), str(broken)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1 and message in out.stdout, out.stdout + out.stderr


def test_the_command_passes_the_shipped_manifests():
    ok = subprocess.run([sys.executable, str(DEPLOY / "validate.py")], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and f"{len(MANIFESTS)} file(s) checked" in ok.stdout, ok.stdout + ok.stderr


@pytest.mark.parametrize("name, job", jobs(), ids=lambda x: x if isinstance(x, str) else x["kind"])
def test_the_jobs_mount_what_trainguard_reads(name, job):
    from trainguard.compat.taskd.api.taskd_worker_api import TASKD_SWITCH
    from trainguard.core.profiling import ProfilingConfig
    from trainguard.core.profiling.switch import parse_switch
    from trainguard.core.secret import MIN_SECRET_CHARS

    job_name = job["metadata"]["name"]
    secrets, config_maps = by_kind("Secret"), by_kind("ConfigMap")
    for where, template in validate.pod_templates(job):
        for c in containers(template):
            env = env_of(c)
            # the pod's annotations, where trainguard reads them by default
            annotations = mounted(template, c, lambda v: [i["path"] for i in v.get("downwardAPI", {}).get("items", [])
                                                          if i.get("fieldRef", {}).get("fieldPath")
                                                          == "metadata.annotations"])
            assert annotations == [ann.DEFAULT_PATH], where
            assert env.get("TRAINGUARD_ANNOTATIONS", ann.DEFAULT_PATH) == ann.DEFAULT_PATH
            # the data-trace ConfigMap's profilingSwitch, where the profiling recorder reads it
            switches = mounted(template, c, lambda v: [i["path"] for i in v.get("configMap", {}).get("items", [])
                                                       if v["configMap"]["name"] == f"data-trace-{job_name}"
                                                       and i["key"] == "profilingSwitch"])
            assert len(switches) == 1, where
            profiling = ProfilingConfig.from_env(rank=0, started_at=0.0, environ={
                k: v for k, v in env.items() if k.startswith("TRAINGUARD_PROFILING_")})
            assert profiling is not None and str(profiling.switch_path) == switches[0] == TASKD_SWITCH
            parse_switch(config_maps[f"data-trace-{job_name}"]["data"]["profilingSwitch"])
            # the job secret, from the Secret manifest
            token_file = flag(c, "--token-file") or env.get("TRAINGUARD_TOKEN_FILE")
            tokens = mounted(template, c, lambda v: [i["path"] for i in v.get("secret", {}).get("items", [])
                                                     if v["secret"]["secretName"] in secrets
                                                     and i["key"] == "token"])
            assert tokens == [token_file], where
            [secret] = secrets.values()
            assert len(secret["stringData"]["token"]) >= MIN_SECRET_CHARS
            # the controller's port is declared, the same one trainguard binds
            port = flag(c, "--controller-port") or env.get("TRAINGUARD_PORT")
            assert {"name": "trainguard", "containerPort": int(port), "protocol": "TCP"} in c["ports"]
            assert env["TRAINGUARD_HOST"] == "$(POD_IP)"


@pytest.mark.parametrize("name, job", jobs(), ids=lambda x: x if isinstance(x, str) else x["kind"])
def test_the_strategy_annotation_reaches_trainguard(tmp_path, no_default_file, name, job):
    for where, template in validate.pod_templates(job):
        meta = template["metadata"]
        value = meta["annotations"][ann.STRATEGY_KEY]
        assert value == job["metadata"]["annotations"][ann.STRATEGY_KEY], "the job's copy and the pod's differ"
        assert meta["labels"]["fault-scheduling"] == job["metadata"]["labels"]["fault-scheduling"] == "grace"
        # the file the kubelet writes for this pod (with what the operators add), read as trainguard reads it
        path = tmp_path / "annotations"
        path.write_text(kubelet_file({**meta["annotations"], "kubernetes.io/config.source": "api",
                                      "volcano.sh/job-name": job["metadata"]["name"]}))
        choice = ann.resolve_strategies(None, {"TRAINGUARD_ANNOTATIONS": str(path)})
        assert choice.strategies == parse_strategies(value) and choice.source == f"annotation file {path}"


def test_the_pytorchjob_command_is_one_trainguard_run_accepts():
    from trainguard.launcher.run import parser

    [job] = by_kind("PyTorchJob").values()
    for name, replica in job["spec"]["pytorchReplicaSpecs"].items():
        [c] = containers(replica["template"])
        assert c["name"] == "pytorch" and c["command"] == ["trainguard", "run"]
        assert any(p["name"] == "pytorchjob-port" for p in c["ports"])  # the operator's MASTER_PORT
        args = parser().parse_args(expand(c["args"]))
        assert args.rdzv_backend == "c10d" and args.max_restarts >= 1 and args.token_file


def test_the_volcano_job_command_is_one_msrun_accepts():
    if importlib.util.find_spec("mindspore") is None:
        pytest.skip("needs MindSpore")
    [job] = by_kind("Job").values()
    [task] = job["spec"]["tasks"]
    [c] = containers(task["template"])
    assert c["command"] == ["trainguard", "run", "--framework", "mindspore"]
    # msrun's own parser, in a process of its own (as the other tests run MindSpore)
    code = ("import json, sys; from mindspore.parallel.cluster.run import get_args; "
            "sys.argv = ['msrun', *json.loads(sys.argv[1])]; print(json.dumps(vars(get_args())))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(expand(c["args"]))], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    args = json.loads(out.stdout.strip().splitlines()[-1])
    assert args["worker_num"] == task["replicas"] * args["local_worker_num"]
    assert args["master_addr"] == f"{job['metadata']['name']}-{task['name']}-0.{job['metadata']['name']}"
    assert args["node_rank"] == 0 and args["task_script"] == "/job/code/train.py"
    assert {"svc", "env"} <= set(job["spec"]["plugins"])
