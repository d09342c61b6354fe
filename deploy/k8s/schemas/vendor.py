"""Make a vendored schema from an operator's CustomResourceDefinition.

    python deploy/k8s/schemas/vendor.py CRD.yaml VERSION OUT.json --source TEXT

Takes ``spec.versions[name == VERSION].schema.openAPIV3Schema`` of the CRD,
drops every ``description`` (half the size, no meaning for validation) and
writes it as JSON with the CRD's group, kind and version and ``--source``
(where the CRD came from) beside it. deploy/k8s/validate.py reads the result.
"""

from __future__ import annotations

import argparse
import json
import sys

import yaml


def strip(node):
    if isinstance(node, dict):
        return {k: strip(v) for k, v in node.items() if not (k == "description" and isinstance(v, str))}
    if isinstance(node, list):
        return [strip(v) for v in node]
    return node


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("crd")
    p.add_argument("version")
    p.add_argument("out")
    p.add_argument("--source", required=True, help="repository, tag, commit and path of the CRD")
    a = p.parse_args(argv)
    with open(a.crd) as f:
        crd = yaml.safe_load(f)
    spec = crd["spec"]
    [version] = [v for v in spec["versions"] if v["name"] == a.version]
    out = {
        "source": a.source,
        "apiVersion": f"{spec['group']}/{a.version}",
        "kind": spec["names"]["kind"],
        "schema": strip(version["schema"]["openAPIV3Schema"]),
    }
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
