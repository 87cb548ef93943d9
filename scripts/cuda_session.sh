#!/bin/bash
# The checks of one lent GPU session (issue 38), in one command on the device machine, from the repository root:
#   bash scripts/cuda_session.sh            (writes under $OUT, else results/cuda_session)
# Wheels the machine lacks (transformers at the pinned version) travel in .whl (ignored; see docs/benchmarks.md).
# Each step has its own time limit, so a slow one leaves the others their time; what finished is under $OUT.
# A shorter session: LENGTHS=16k,128k ROUNDS=2 TOKENS=16 BIAS_LENGTHS=16k T5_LENGTHS=16k bash scripts/cuda_session.sh
# STEPS picks steps by name (tests, flex, biases, methods, t5; default all, in that order).
set -u
OUT=${OUT:-results/cuda_session}
LENGTHS=${LENGTHS:-16k,32k,64k,128k} ROUNDS=${ROUNDS:-3} TOKENS=${TOKENS:-24}
BIAS_LENGTHS=${BIAS_LENGTHS:-16k,32k} T5_LENGTHS=${T5_LENGTHS:-8k,16k} STEPS=${STEPS:-tests,flex,biases,methods,t5}
LIMITS=(${LIMITS:-200 180 120 230 60})  # (seconds: the tests, flex options, the biases' benchmark, the methods', T5's)
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PWD
fi
log="$OUT/session.log"
step() { local limit=$1; shift; echo "== $(date -u +%T) $*" | tee -a "$log"; timeout "$limit" "$@" 2>&1 | tee -a "$log" | tail -n 40; \
         echo "== exit ${PIPESTATUS[0]} after step: $*" | tee -a "$log"; }
{ python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, \
torch.cuda.get_device_name(), torch.cuda.get_device_capability())"; \
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4")  # (pytest-xdist, where installed)
has() { [[ ",$STEPS," == *",$1,"* ]]; }
has tests && step ${LIMITS[0]} python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py $workers \
    --junitxml "$OUT/test_cuda.xml" -rfE
has flex && step ${LIMITS[1]} env OUT="$OUT" python3 scripts/flex_configs.py
has biases && step ${LIMITS[2]} python3 scripts/bench_attention_cuda.py --methods alibi,kerple --lengths "$BIAS_LENGTHS" \
    --rounds "$ROUNDS" --decode-length 16k --decode-tokens 16 --decode-batches 1 --profile "$OUT/profile_bias.json" \
    --out "$OUT/bench_bias_cuda.json"
has methods && step ${LIMITS[3]} python3 scripts/bench_attention_cuda.py --lengths "$LENGTHS" --rounds "$ROUNDS" \
    --decode-length 32k --decode-tokens "$TOKENS" --decode-batches 1,8 --profile "$OUT/profile.json" \
    --out "$OUT/bench_attention_cuda.json"
has t5 && step ${LIMITS[4]} python3 scripts/bench_attention_cuda.py --model t5 --methods t5_bucket_scale:factor=1 \
    --lengths "$T5_LENGTHS" --rounds "$ROUNDS" --decode-tokens 0 --out "$OUT/bench_t5_cuda.json"
echo "== $(date -u +%T) done" | tee -a "$log"
