"""Check Kubernetes manifests offline against the API's schemas; no cluster.

    python deploy/k8s/validate.py [FILE.yaml ...]     # default: every deploy/k8s/*.yaml

* Built-in kinds (Secret, ConfigMap, ...) against the Kubernetes
  ``KUBERNETES_VERSION`` schema shipped by the pinned ``kubernetes-validate``
  package (its "strict" variant: an unknown field is an error, as with
  ``kubectl apply --validate=strict``).
* ``PyTorchJob`` (kubeflow.org/v1) and Volcano's ``Job``
  (batch.volcano.sh/v1alpha1) against the openAPIV3Schema of the operators'
  own CRDs, vendored beside this file (``schemas/``, sources in its README),
  made strict the same way; their ``metadata`` and every pod template
  against the built-in ``ObjectMeta`` / ``PodTemplateSpec``.
* What those schemas leave as free strings: the operators' enumerations
  (replica types, restart and clean-pod policies, Volcano's actions and
  plugins), and a volume mount naming no volume.

Exit status 1 with one line per problem; 0 when every document passes.
"""

from __future__ import annotations

import copy
import functools
import json
import sys
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import yaml

HERE = Path(__file__).resolve().parent
SCHEMAS = HERE / "schemas"
#: The Kubernetes version whose built-in schemas the manifests are checked against.
KUBERNETES_VERSION = "1.31"
CRDS = {
    ("kubeflow.org/v1", "PyTorchJob"): "kubeflow.org_v1_pytorchjob.json",
    ("batch.volcano.sh/v1alpha1", "Job"): "batch.volcano.sh_v1alpha1_job.json",
}
# Go enumerations the CRD schemas leave as plain strings (the operators' API types, same versions as schemas/).
KUBEFLOW_REPLICA_TYPES = {"Master", "Worker"}
KUBEFLOW_RESTART_POLICIES = {"Always", "OnFailure", "Never", "ExitCode"}
KUBEFLOW_CLEAN_POD_POLICIES = {"All", "Running", "None"}
VOLCANO_ACTIONS = {"AbortJob", "RestartJob", "RestartTask", "RestartPod", "RestartPartition", "TerminateJob",
                   "CompleteJob", "ResumeJob"}
VOLCANO_PLUGINS = {"ssh", "env", "svc", "tensorflow", "mpi", "pytorch", "hcclrank", "ray"}


def strict(schema: Any) -> Any:
    """A copy of an OpenAPI schema in which an object with declared
    properties admits no other key (unless it says it keeps unknown fields)."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@functools.lru_cache(maxsize=None)
def _crd_schema(filename: str) -> dict:
    return strict(json.loads((SCHEMAS / filename).read_text())["schema"])


@functools.lru_cache(maxsize=None)
def _core_definitions() -> dict:
    import importlib.resources

    import kubernetes_validate.utils as kv

    version = [v for v in kv.all_versions() if kv.major_minor(v) == KUBERNETES_VERSION][-1]
    path = importlib.resources.files("kubernetes_validate").joinpath(
        f"kubernetes-json-schema/v{version}-local-strict/_definitions.json")
    return json.loads(path.read_text())


def _core(where: str, definition: str, value: Any) -> Iterator[str]:
    """Problems of ``value`` (at ``where``) against a built-in definition (strict)."""
    schema = {"$ref": f"#/$defs/{definition}", "$defs": _core_definitions()["$defs"]}
    validator = jsonschema.Draft202012Validator(schema)
    for error in validator.iter_errors(value):
        yield f"{_path(error, where)}: {error.message}"


def _path(error: jsonschema.ValidationError, where: str = "") -> str:
    return ".".join([where] * bool(where) + [str(p) for p in error.absolute_path]) or "(top)"


def pod_templates(doc: dict) -> Iterator[tuple[str, dict]]:
    """``(where, template)`` for every pod template of a PyTorchJob or Volcano Job."""
    spec = doc.get("spec") or {}
    if doc.get("kind") == "PyTorchJob":
        for name, replica in (spec.get("pytorchReplicaSpecs") or {}).items():
            yield f"spec.pytorchReplicaSpecs.{name}.template", (replica or {}).get("template") or {}
    elif doc.get("kind") == "Job" and str(doc.get("apiVersion", "")).startswith("batch.volcano.sh/"):
        for i, task in enumerate(spec.get("tasks") or []):
            yield f"spec.tasks.{i}.template", (task or {}).get("template") or {}


def _semantics(doc: dict) -> Iterator[str]:
    spec = doc.get("spec") or {}
    if doc["kind"] == "PyTorchJob":
        for name, replica in (spec.get("pytorchReplicaSpecs") or {}).items():
            if name not in KUBEFLOW_REPLICA_TYPES:
                yield f"spec.pytorchReplicaSpecs.{name}: not a PyTorchJob replica type {sorted(KUBEFLOW_REPLICA_TYPES)}"
            policy = (replica or {}).get("restartPolicy")
            if policy is not None and policy not in KUBEFLOW_RESTART_POLICIES:
                yield (f"spec.pytorchReplicaSpecs.{name}.restartPolicy: {policy!r} not in "
                       f"{sorted(KUBEFLOW_RESTART_POLICIES)}")
        clean = (spec.get("runPolicy") or {}).get("cleanPodPolicy")
        if clean is not None and clean not in KUBEFLOW_CLEAN_POD_POLICIES:
            yield f"spec.runPolicy.cleanPodPolicy: {clean!r} not in {sorted(KUBEFLOW_CLEAN_POD_POLICIES)}"
    else:
        policies = [("spec.policies", i, p) for i, p in enumerate(spec.get("policies") or [])]
        policies += [(f"spec.tasks.{t}.policies", i, p) for t, task in enumerate(spec.get("tasks") or [])
                     for i, p in enumerate((task or {}).get("policies") or [])]
        for where, i, policy in policies:
            action = (policy or {}).get("action")
            if action not in VOLCANO_ACTIONS:
                yield f"{where}.{i}.action: {action!r} not in {sorted(VOLCANO_ACTIONS)}"
        for name in spec.get("plugins") or {}:
            if name not in VOLCANO_PLUGINS:
                yield f"spec.plugins.{name}: not a Volcano job plugin {sorted(VOLCANO_PLUGINS)}"
    for where, template in pod_templates(doc):
        pod = template.get("spec") or {}
        volumes = {v.get("name") for v in pod.get("volumes") or []}
        for kind in ("initContainers", "containers"):
            for c in pod.get(kind) or []:
                for m in c.get("volumeMounts") or []:
                    if m.get("name") not in volumes:
                        yield (f"{where}.spec.{kind}[{c.get('name')}].volumeMounts: {m.get('name')!r} "
                               f"names no volume of the pod")


def problems(doc: Any) -> list[str]:
    """Every problem of one manifest document (empty: it passes)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("apiVersion"), str) or not isinstance(doc.get("kind"), str):
        return ["not a Kubernetes object (apiVersion and kind are needed)"]
    key = (doc["apiVersion"], doc["kind"])
    if key in CRDS:
        validator = jsonschema.Draft7Validator(_crd_schema(CRDS[key]))
        out = [f"{_path(e)}: {e.message}" for e in validator.iter_errors(doc)]
        out += _core("metadata", "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta", doc.get("metadata", {}))
        for where, template in pod_templates(doc):
            out += _core(where, "io.k8s.api.core.v1.PodTemplateSpec", template)
        if not out:
            out += _semantics(doc)
        return list(dict.fromkeys(out))  # the CRD's copy of a pod's schema and the built-in one may both object
    import kubernetes_validate

    try:
        kubernetes_validate.validate(copy.deepcopy(doc), KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        return [f"no schema for {doc['apiVersion']} {doc['kind']} (Kubernetes {KUBERNETES_VERSION} or schemas/)"]
    except kubernetes_validate.ValidationError as e:
        return [f"{_path(e)}: {e.message}"]
    return []


def load(path: str | Path) -> list[dict]:
    """The documents of a YAML file (empty documents left out)."""
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def check_file(path: str | Path) -> list[str]:
    """``FILE: KIND/NAME: problem`` lines for every problem in a file."""
    try:
        docs = load(path)
    except yaml.YAMLError as e:
        return [f"{path}: not YAML: {e}"]
    out = []
    for doc in docs:
        name = f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}" if isinstance(doc, dict) else "?"
        out += [f"{path}: {name}: {p}" for p in problems(doc)]
    return out


def main(argv: list[str] | None = None) -> int:
    files = (sys.argv[1:] if argv is None else argv) or sorted(str(p) for p in HERE.glob("*.yaml"))
    bad = [line for f in files for line in check_file(f)]
    for line in bad:
        print(line)
    print(f"{len(files)} file(s) checked against Kubernetes {KUBERNETES_VERSION} and schemas/: "
          f"{'OK' if not bad else f'{len(bad)} problem(s)'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
