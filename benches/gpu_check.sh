#!/usr/bin/env bash
# Everything a machine with an NVIDIA GPU runs in one go: tests/gpu, then the GPU benchmarks,
# with one JSON summary at the end ($OUT/gpu_summary.json).
#
#   benches/gpu_check.sh [tests|bench|all]      (default: all)
#
# Wheels carried in .whl/ (flashinfer, tools/fetch_gpu_wheels.sh) and .gpu/whl/ (packages the
# GPU image lacks, e.g. msgspec) are installed into /tmp/site first. The extension module
# (python/rsgl/_core.abi3.so) must have been built (`make setup`) and carried along. Without
# the embedded model's weights on the machine, the tests run the model directory named by
# RSGL_GPU_TEST_MODEL (config.json + tokenizer; default .gpu/smollm2) with seeded random
# weights; the benchmarks use benches/configs/llama3-8b (random weights, HBM roofline).
set -uo pipefail
cd "$(dirname "$0")/.."
STAGE=${1:-all}
OUT=${OUT:-/tmp/rsgl-gpu-check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

wheels=$(ls .whl/*.whl .gpu/whl/*.whl 2>/dev/null)
if [ -n "$wheels" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site $wheels || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/python:$PWD/tests:$PYTHONPATH
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp}
export MAX_JOBS=${MAX_JOBS:-16}
export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}
if [ -z "${RSGL_GPU_TEST_MODEL:-}" ] && [ -d .gpu/smollm2 ]; then
    export RSGL_GPU_TEST_MODEL=$PWD/.gpu/smollm2 RSGL_GPU_TEST_DUMMY=1
fi

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
$PY -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1

tests_rc=skipped
if [ "$STAGE" = tests ] || [ "$STAGE" = all ]; then
    $PY -m pytest -q -p no:cacheprovider -rs tests/gpu tests/model/test_sampler.py \
        tests/model/test_triton_attention.py tests/model/test_triton_kernels.py --junitxml="$OUT/gpu_tests.xml" 2>&1 \
        | tee "$OUT/gpu_tests.log"
    tests_rc=${PIPESTATUS[0]}
fi

if [ "$STAGE" = bench ] || [ "$STAGE" = all ]; then
    : >"$OUT/one_batch.jsonl"
    for backend in triton flashinfer; do
        $PY -m rsgl bench one-batch --device cuda --load-format dummy \
            --model benches/configs/llama3-8b --batches 1,16,64,256 --input-len 512 \
            --output-len 256 --compare-graphs --attention-backend $backend \
            2> >(tail -5 >&2) | tee -a "$OUT/one_batch.jsonl"
    done
    if [ -n "${RSGL_GPU_TEST_MODEL:-}" ]; then
        $PY -m rsgl bench offline --device cuda --load-format dummy \
            --model-path "$RSGL_GPU_TEST_MODEL" --num-prompts 512 --input-len 128 \
            --output-len 256 --max-running-requests 256 --cuda-graph-max-bs 256 \
            2> >(tail -5 >&2) \
            | tee "$OUT/offline.json"
    fi
fi

$PY - "$OUT" "$tests_rc" <<'EOF'
import json, pathlib, sys
out, tests_rc = pathlib.Path(sys.argv[1]), sys.argv[2]
summary = {"gpu": (out / "gpu.txt").read_text().strip(), "tests_exit_code": tests_rc}
log = out / "gpu_tests.log"
if log.exists():
    summary["tests"] = log.read_text().strip().splitlines()[-1]
rows = out / "one_batch.jsonl"
if rows.exists():
    summary["one_batch"] = [json.loads(x) for x in rows.read_text().splitlines() if x.startswith("{")]
offline = out / "offline.json"
if offline.exists() and offline.read_text().strip():
    summary["offline"] = json.loads(offline.read_text().strip().splitlines()[-1])
(out / "gpu_summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary))
EOF
