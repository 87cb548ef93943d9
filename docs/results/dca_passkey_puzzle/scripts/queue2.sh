#!/bin/bash
# sequential: one job at a time, 1 torch thread each; rope_ext (and rope_ext.patches) from the frozen worktree
export HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/dca_puzzle OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
PY=/work/main/.venv/bin/python
cd /tmp/dca_puzzle_work
run() { name=$1; shift; /usr/bin/time -v $PY run_forward.py $name "$@" > logs/$name.log 2>&1; $PY analyze.py $name > logs/$name.analysis.txt 2>&1; }
mkdir -p logs
run dca8192 --method dca:chunk_size=8192
run none8k_samedist --method none --length 8192 --needle-start 6523 --key 94662
run yarn4 --method yarn:factor=4
run dca8192_chunkllama_mscale --method dca:chunk_size=8192 --variant chunkllama_mscale
run dca8192_nomscale --method dca:chunk_size=8192:mscale=false
run dca8192_no_older --method dca:chunk_size=8192 --variant no_older
