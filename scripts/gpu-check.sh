#!/usr/bin/env bash
# The GPU checks in one command: run it first whenever a CUDA GPU is at hand.
#
#   scripts/gpu-check.sh [--tests-only | --bench-only] [--out DIR]
#
# 1. bench/checkpoint.py --gpu-only (snapshots of GPU state: blocked time per checkpoint against
#    torch.save and DCP async_save, take()'s device-to-host copy against one flat pinned copy);
# 2. the tests marked `gpu` (pytest -m gpu, several at once: each job's ranks share the GPU over gloo);
# then one summary. Exit 0 only when no test failed and every benchmark goal was met.
#
# Needs a CUDA build of torch (a GPU image's own will do) and this repository's other dependencies.
# What is missing -- megatron-core, a protobuf new enough for the generated protocol code, hydra-core,
# omegaconf and antlr4-python3-runtime for the examples -- is
# installed offline from wheels in $TRAINGUARD_WHEELS (default .whl) into a private directory.
# tests/test_gpu.py needs two GPUs (NCCL refuses two ranks on one device): skipped on one.
# Results go to DIR (default /tmp/trainguard-gpu-check): gpu-tests.xml, gpu-tests.log,
# checkpoint-gpu.json, checkpoint-gpu.log. About 5 minutes on one H100.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
out=/tmp/trainguard-gpu-check tests=1 bench=1
while [ $# -gt 0 ]; do
    case $1 in
        --tests-only) bench=0 ;;
        --bench-only) tests=0 ;;
        --out) out=$2; shift ;;
        *) echo "usage: $0 [--tests-only | --bench-only] [--out DIR]" >&2; exit 2 ;;
    esac
    shift
done
mkdir -p "$out"
py=${PYTHON:-python3}
"$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' ||
    { echo "gpu-check: no CUDA device visible to $py (torch.cuda.is_available() is False)" >&2; exit 2; }

wheels=${TRAINGUARD_WHEELS:-.whl}
site=/tmp/trainguard-gpu-site
missing=$("$py" - <<'EOF'
import importlib.util
need = []
if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    need.append("megatron_core")
if importlib.util.find_spec("hydra") is None:  # the examples' configuration (pure Python)
    need += ["hydra_core", "omegaconf", "antlr4_python3_runtime"]
try:
    from google.protobuf import __version__ as v
    if tuple(int(x) for x in v.split(".")[:2]) < (7, 35):
        need.append("protobuf")
except ImportError:
    need.append("protobuf")
print(" ".join(need))
EOF
)
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "$missing" ]; then
    files=()
    for name in $missing; do files+=("$wheels"/"$name"-*.whl); done
    if ls "${files[@]}" >/dev/null 2>&1; then
        "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${files[@]}" ||
            { echo "gpu-check: cannot install ${files[*]}" >&2; exit 2; }
        export PYTHONPATH="$site:$PYTHONPATH"
    else
        echo "gpu-check: missing $missing and no wheel of it in $wheels (its tests are skipped)" >&2
    fi
fi

rc_tests=0 rc_bench=0
if [ $bench = 1 ]; then
    timeout 240 "$py" bench/checkpoint.py --gpu-only --out "$out/checkpoint-gpu.json" 2>&1 |
        tee "$out/checkpoint-gpu.log"
    rc_bench=${PIPESTATUS[0]}
fi

if [ $tests = 1 ]; then
    start=$(date +%s)
    timeout 360 "$py" -m pytest -m gpu -n "${GPU_CHECK_WORKERS:-4}" -p no:cacheprovider -q -rfEs --durations=0 \
        --junitxml="$out/gpu-tests.xml" tests 2>&1 | tee "$out/gpu-tests.log"
    rc_tests=${PIPESTATUS[0]}
    echo "gpu tests: rc $rc_tests in $(( $(date +%s) - start )) s" | tee -a "$out/gpu-tests.log"
fi
"$py" - "$out" "$tests" "$bench" "$rc_tests" "$rc_bench" <<'EOF'
import json, subprocess, sys, xml.etree.ElementTree as ET
from pathlib import Path
out, tests, bench, rc_tests, rc_bench = Path(sys.argv[1]), *map(int, sys.argv[2:])
import torch
print(f"\n== gpu-check on {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'}, torch {torch.__version__}, "
      f"commit {subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True).stdout.strip()}")
ok = True
if tests:
    xml = out / "gpu-tests.xml"
    if xml.exists():
        counts = {"passed": 0, "failed": 0, "skipped": 0}
        for case in ET.parse(xml).iter("testcase"):
            kind = "failed" if case.find("failure") is not None or case.find("error") is not None else \
                "skipped" if case.find("skipped") is not None else "passed"
            counts[kind] += 1
            if kind != "passed":
                reason = next(e for e in (case.find(t) for t in ("failure", "error", "skipped")) if e is not None)
                why = (reason.get("message") or "")[:120]
                print(f"  {kind.upper():7} {case.get('classname')}::{case.get('name')}  {why}")
        print(f"tests: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped (pytest rc {rc_tests})")
    else:
        print(f"tests: no report (pytest rc {rc_tests}; see {out}/gpu-tests.log)")
    ok &= rc_tests == 0
if bench:
    path = out / "checkpoint-gpu.json"
    if path.exists() and rc_bench == 0:
        for g in json.loads(path.read_text())["goals"]:
            print(f"  [{'met' if g['met'] else 'NOT met'}] {g['name']}: {g['measured']:.4g} {g['unit']} (target {g['target']})")
            ok &= bool(g["met"])
    else:
        print(f"bench: failed (rc {rc_bench}; see {out}/checkpoint-gpu.log)")
        ok = False
print("gpu-check:", "PASSED" if ok else "FAILED")
sys.exit(0 if ok else 1)
EOF
