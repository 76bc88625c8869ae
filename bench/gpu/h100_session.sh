#!/usr/bin/env bash
# One device-tool call on a GPU machine: attention alone, the default model end to end, the
# launch-shape variants, then the GPU tests on the Triton cache the benchmarks filled. Prepared
# here (bench/README.md, "The H100 session"), run there from the repository root; every step
# has its own time limit (the tests whatever is left of TOTAL_S, within the call's 560 s) and
# writes as it goes, so a step cut short keeps what it measured and the next one still runs.
# Results land in $OUT (the device tool's folder; bench/out/gpu elsewhere); here,
# `python -m clusterserve.bench.gpu.summary` turns them into the session's one committed record.
# Nothing is installed there: the checkout's folders are linked into one `clusterserve` package
# (setup.py's layout) in a temporary folder on PYTHONPATH.
set -u
OUT=${OUT:-bench/out/gpu}
STEM=${STEM:-$(date +%F)-h100}
mkdir -p "$OUT"
PACKAGE=$(mktemp -d)
mkdir "$PACKAGE/clusterserve"
ln -s "$PWD"/clusterserve/*.py "$PACKAGE/clusterserve/"
for folder in kernels models service bench; do ln -s "$PWD/$folder" "$PACKAGE/clusterserve/$folder"; done
export PYTHONPATH=$PACKAGE PYTHONUNBUFFERED=1 GPU_TEST_MODEL=bench/out/model
export GPU_TEST_LENGTHS=${GPU_TEST_LENGTHS:-"4096 16384"}
{
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    test -d /usr/share/common-licenses || cp -r bench/out/model/common-licenses /usr/share/
    python3 -m clusterserve.bench.gpu.pack_model --fill bench/out/nomic-embed-text-v1.5
    timeout "${ATTENTION_S:-150}" python3 -m clusterserve.bench.gpu.speed --model bench/out/model --head-dims 64 \
        --lengths ${LENGTHS:-4096 16384 65536} --profile-lengths ${PROFILE_LENGTHS:-4096 16384 65536} \
        --e2e-lengths --out "$OUT" --name "$STEM"
    echo "attention: rc=$?"
    timeout "${E2E_S:-100}" python3 -m clusterserve.bench.gpu.speed --model bench/out/nomic-embed-text-v1.5 --lengths \
        --e2e-lengths ${E2E_LENGTHS:-2048 8192 16384} --e2e-dtype bfloat16 --no-stages \
        --graph-max-length "${GRAPH_MAX_LENGTH:-16384}" --profile-lengths ${E2E_PROFILE_LENGTHS:-16384} \
        --out "$OUT" --name "$STEM-nomic-e2e"
    echo "end to end: rc=$?"
    timeout "${SHAPES_S:-90}" python3 -m clusterserve.bench.gpu.shapes --model bench/out/model --lengths ${SHAPE_LENGTHS:-4096 16384} \
        --out "$OUT" --name "$STEM"
    echo "shapes: rc=$?"
    # The tests take what the call has left (TOTAL_S in all): the steps above rarely use their limits.
    tests_s=${TESTS_S:-$(( ${TOTAL_S:-540} - SECONDS ))}
    timeout "$(( tests_s > 30 ? tests_s : 30 ))" python3 -m pytest -m gpu tests/gpu -rA -p no:cacheprovider \
        -n "${TEST_WORKERS:-3}" --dist load --junitxml="$OUT/$STEM-tests.xml"
    echo "tests: rc=$?"
} 2>&1 | tee "$OUT/$STEM-console.log"
# The device tool brings back 8 files a call: every result but the console log travels in one archive.
(cd "$OUT" && files=$(ls | grep -v -e '-console\.log$' -e '\.tar\.gz$') && [ -n "$files" ] &&
    tar -czf "$STEM-results.tar.gz" $files && rm -f $files)
