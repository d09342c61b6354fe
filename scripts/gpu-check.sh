#!/usr/bin/env bash
# The GPU checks in one command: run it first whenever a CUDA GPU is at hand.
#
#   scripts/gpu-check.sh [--tests-only | --bench-only | --rehearse-only] [--out DIR]
#
# 1. bench/checkpoint.py --gpu-only (snapshots of GPU state: blocked time per checkpoint against
#    torch.save and DCP async_save, take()'s device-to-host copy against one flat pinned copy), alone;
# 2. then side by side: the tests marked `gpu` (pytest -m gpu, several at once: each job's ranks share
#    the GPU over gloo) and `trainguard rehearse --quick` of the ResNet-50 example on CUDA (two ranks
#    sharing GPU 0 over gloo, the process restart path: retry,recover-in-place,dump,exit, --max-restarts 3);
# then one summary, also written as DIR/gpu-check.json (the card, the commit, pass/fail per item, the
# figures with their baselines). Exit 0 only when no test failed, every benchmark goal was met and every
# rehearsal case ended bit-identical.
#
# Needs a CUDA build of torch (a GPU image's own will do) and this repository's other dependencies.
# What is missing -- megatron-core, a protobuf new enough for the generated protocol code, hydra-core,
# omegaconf and antlr4-python3-runtime for the examples -- is
# installed offline from wheels in $TRAINGUARD_WHEELS (default .whl) into a private directory.
# tests/test_gpu.py needs two GPUs (NCCL refuses two ranks on one device): skipped on one.
# Results go to DIR (default /tmp/trainguard-gpu-check): gpu-tests.xml, gpu-tests.log,
# checkpoint-gpu.json, checkpoint-gpu.log, rehearse-resnet50-gpu.json, rehearse.log, gpu-check.json.
# About 7 minutes on one H100.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
out=/tmp/trainguard-gpu-check tests=1 bench=1 rehearse=1
while [ $# -gt 0 ]; do
    case $1 in
        --tests-only) bench=0 rehearse=0 ;;
        --bench-only) tests=0 rehearse=0 ;;
        --rehearse-only) tests=0 bench=0 ;;
        --out) out=$2; shift ;;
        *) echo "usage: $0 [--tests-only | --bench-only | --rehearse-only] [--out DIR]" >&2; exit 2 ;;
    esac
    shift
done
mkdir -p "$out" && out=$(cd "$out" && pwd)  # absolute: the rehearsal runs in a directory of its own
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

rc_tests=0 rc_bench=0 rc_rehearse=0
if [ $bench = 1 ]; then  # alone: a bandwidth measure
    timeout 220 "$py" bench/checkpoint.py --gpu-only --out "$out/checkpoint-gpu.json" 2>&1 |
        tee "$out/checkpoint-gpu.log"
    rc_bench=${PIPESTATUS[0]}
fi

if [ $rehearse = 1 ]; then  # beside the tests: the GPU has room for both
    (
        work=$(mktemp -d /tmp/trainguard-gpu-rehearse-XXXX)
        cd "$work" && timeout 340 "$py" -m trainguard.cli rehearse --quick --json "$out/rehearse-resnet50-gpu.json" \
            --strategies retry,recover-in-place,dump,exit --nproc-per-node 2 --max-restarts 3 \
            "$root/examples/resnet50/train.py" steps=12 save_every=4 device=cuda backend=gloo checkpoint_dir=ckpt
        echo "rehearse rc $?"
    ) >"$out/rehearse.log" 2>&1 &
    rehearsing=$!
fi

if [ $tests = 1 ]; then
    start=$(date +%s)
    timeout 340 "$py" -m pytest -m gpu -n "${GPU_CHECK_WORKERS:-4}" -p no:cacheprovider -q -rfEs --durations=0 \
        --junitxml="$out/gpu-tests.xml" tests 2>&1 | tee "$out/gpu-tests.log"
    rc_tests=${PIPESTATUS[0]}
    echo "gpu tests: rc $rc_tests in $(( $(date +%s) - start )) s" | tee -a "$out/gpu-tests.log"
fi
if [ $rehearse = 1 ]; then
    wait "$rehearsing"
    rc_rehearse=$(sed -n 's/^rehearse rc //p' "$out/rehearse.log" | tail -1)
    tail -25 "$out/rehearse.log"
fi
"$py" - "$out" "$tests" "$bench" "$rehearse" "$rc_tests" "$rc_bench" "${rc_rehearse:-1}" <<'EOF'
import datetime, json, subprocess, sys, xml.etree.ElementTree as ET
from pathlib import Path
out, tests, bench, rehearse, rc_tests, rc_bench, rc_rehearse = Path(sys.argv[1]), *map(int, sys.argv[2:])
import torch
card = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
dirty = bool(subprocess.run(["git", "status", "--short", "trainguard", "tests", "bench", "examples", "scripts"],
                            capture_output=True, text=True).stdout.strip())
summary = {"card": card, "torch": torch.__version__, "commit": commit + ("+changes" if dirty else ""),
           "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "items": []}
print(f"\n== gpu-check on {card}, torch {torch.__version__}, commit {summary['commit']}")
ok = True
if tests:
    xml = out / "gpu-tests.xml"
    if xml.exists():
        counts = {"passed": 0, "failed": 0, "skipped": 0}
        for case in ET.parse(xml).iter("testcase"):
            kind = "failed" if case.find("failure") is not None or case.find("error") is not None else \
                "skipped" if case.find("skipped") is not None else "passed"
            counts[kind] += 1
            reason = next((e for e in (case.find(t) for t in ("failure", "error", "skipped")) if e is not None), None)
            why = (reason.get("message") or "")[:300] if reason is not None else ""
            summary["items"].append({"item": f"{case.get('classname')}::{case.get('name')}", "result": kind,
                                     "seconds": float(case.get("time") or 0), "why": why})
            if kind != "passed":
                print(f"  {kind.upper():7} {case.get('classname')}::{case.get('name')}  {why[:120]}")
        print(f"tests: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped "
              f"(pytest rc {rc_tests})")
    else:
        print(f"tests: no report (pytest rc {rc_tests}; see {out}/gpu-tests.log)")
        summary["items"].append({"item": "pytest -m gpu", "result": "failed", "why": f"no report (rc {rc_tests})"})
    ok &= rc_tests == 0
if bench:
    path = out / "checkpoint-gpu.json"
    if path.exists() and rc_bench == 0:
        for g in json.loads(path.read_text())["goals"]:
            print(f"  [{'met' if g['met'] else 'NOT met'}] {g['name']}: {g['measured']:.4g} {g['unit']} "
                  f"(target {g['target']})")
            summary["items"].append({"item": g["name"], "result": "met" if g["met"] else "not met",
                                     "measured": g["measured"], "target": g["target"], "unit": g["unit"]})
            ok &= bool(g["met"])
    else:
        print(f"bench: failed (rc {rc_bench}; see {out}/checkpoint-gpu.log)")
        summary["items"].append({"item": "bench/checkpoint.py --gpu-only", "result": "failed", "why": f"rc {rc_bench}"})
        ok = False
if rehearse:
    path = out / "rehearse-resnet50-gpu.json"
    if path.exists():
        got = json.loads(path.read_text())
        for case in got["cases"]:
            result = "skipped" if case["skipped"] else "identical" if case["identical"] else "differs"
            print(f"  rehearse {case['case']:<30} {case['strategy'] or '-':<28} exits {case['exits']}  {result}"
                  f"{': ' + case['reason'] if case['reason'] else ''}")
            summary["items"].append({"item": f"rehearse --quick, ResNet-50 on CUDA: {case['case']}", "result": result,
                                     "strategy": case["strategy"], "exits": case["exits"], "why": case["reason"]})
        print(f"rehearse: {'passed' if got['passed'] else 'FAILED'} (rc {rc_rehearse})")
        ok &= bool(got["passed"]) and rc_rehearse == 0
    else:
        print(f"rehearse: no result (rc {rc_rehearse}; see {out}/rehearse.log)")
        summary["items"].append({"item": "trainguard rehearse --quick (ResNet-50, CUDA)", "result": "failed",
                                 "why": f"no result (rc {rc_rehearse})"})
        ok = False
summary["passed"] = bool(ok)
(out / "gpu-check.json").write_text(json.dumps(summary, indent=1) + "\n")
print("gpu-check:", "PASSED" if ok else "FAILED")
sys.exit(0 if ok else 1)
EOF
