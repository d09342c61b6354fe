"""The Kubernetes files the tests of ``test_k8s.py`` read: the pod-annotations
file as the kubelet writes it (Go-quoted values, :func:`kubelet_file`), and
the manifests in ``deploy/k8s/`` -- loaded with ``deploy/k8s/validate.py``
(:data:`validate`), picked by kind, broken on purpose (:func:`mutations`),
and their pod templates read for mounts, environment and flags."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
MANIFESTS = sorted(DEPLOY.glob("*.yaml"))


def go_quote(value: str) -> str:
    """Go's strconv.Quote (what fmt's %q writes), for the runes these tests use."""
    out = ['"']
    for ch in value:
        r = ord(ch)
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch in "\a\b\f\n\r\t\v":
            out.append({"\a": r"\a", "\b": r"\b", "\f": r"\f", "\n": r"\n", "\r": r"\r", "\t": r"\t",
                        "\v": r"\v"}[ch])
        elif r < 0x20 or r == 0x7F:
            out.append(f"\\x{r:02x}")
        elif ch == " " or ch.isprintable():
            out.append(ch)
        elif r < 0x10000:
            out.append(f"\\u{r:04x}")
        else:
            out.append(f"\\U{r:08x}")
    return "".join(out) + '"'


def kubelet_file(annotations: dict[str, str]) -> str:
    """The Downward API file the kubelet writes (fieldpath.FormatMap)."""
    return "\n".join(f"{k}={go_quote(v)}" for k, v in sorted(annotations.items()))


# ------------------------------------------------------------ manifests

def _validator():
    spec = importlib.util.spec_from_file_location("k8s_validate", DEPLOY / "validate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


validate = _validator()


def manifest_docs() -> dict[str, list[dict]]:
    """Every manifest's documents, by file name."""
    return {p.name: validate.load(p) for p in MANIFESTS}


def jobs():
    """``(file name, document)`` of every document with pod templates."""
    return [(name, d) for name, docs in manifest_docs().items() for d in docs if list(validate.pod_templates(d))]


def by_kind(kind: str) -> dict[str, dict]:
    """The documents of ``kind``, by name."""
    return {d["metadata"]["name"]: d for docs in manifest_docs().values() for d in docs if d["kind"] == kind}


def mutations():
    """Breakages of a job document: name -> (change in place, what the validator must say)."""
    def pod(doc):
        return next(validate.pod_templates(doc))[1]["spec"]

    def container(doc):
        return pod(doc)["containers"][0]

    return {
        "misspelt container field": (
            lambda d: container(d).__setitem__("volumeMount", container(d).pop("volumeMounts")),
            "'volumeMount' was unexpected"),
        "env value not a string": (lambda d: container(d)["env"].append({"name": "TRAINGUARD_PORT", "value": 9601}),
                                   "9601 is not of type 'string'"),
        "port as a string": (lambda d: container(d)["ports"][0].__setitem__("containerPort", "9601"),
                             "'9601' is not of type 'integer'"),
        "misspelt CRD field": (lambda d: d["spec"].__setitem__("runPolice", {}), "'runPolice' was unexpected"),
        "mount without a volume": (lambda d: container(d)["volumeMounts"].append({"name": "nope", "mountPath": "/x"}),
                                   "'nope' names no volume of the pod"),
        "misspelt metadata": (lambda d: d["metadata"].__setitem__("label", {}), "'label' was unexpected"),
    }


def containers(template):
    return template["spec"]["containers"]


def env_of(container) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def mounted(template, container, predicate) -> list[str]:
    """Paths at which ``container`` sees the items of the volumes ``predicate`` picks."""
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    out = []
    for m in container.get("volumeMounts", []):
        volume = volumes[m["name"]]
        for item in predicate(volume):
            assert "subPath" not in m, "a subPath mount is never updated: the switch could not change"
            out.append(f"{m['mountPath'].rstrip('/')}/{item}")
    return out


def flag(container, name):
    values = [a.split("=", 1)[1] for a in container.get("args", []) if a.startswith(f"{name}=")]
    return values[0] if values else None


def expand(args: list[str]) -> list[str]:
    """``args`` with the ``$(VAR)`` references Kubernetes would expand filled in."""
    return [re.sub(r"\$\((\w+)\)", lambda m: {"VC_TASK_INDEX": "0", "MASTER_PORT": "23456"}.get(m[1], "x"), a)
            for a in args]
