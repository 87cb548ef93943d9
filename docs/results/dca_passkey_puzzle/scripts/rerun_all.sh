#!/bin/bash
# Reproduces everything (sequential, 1 torch thread; ~25 min on one core). Needs the frozen worktree:
#   git -C /work/main worktree add /tmp/dca_puzzle c4daf92
# rope_ext AND rope_ext.patches are imported from /tmp/dca_puzzle (frozen_import.py; the editable install would
# otherwise map rope_ext.patches to the live /work/main/patches).
set -e
export HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/dca_puzzle OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
PY=/work/main/.venv/bin/python
cd /tmp/dca_puzzle_work && mkdir -p logs runs
$PY positions.py > logs/positions.txt 2>&1
$PY -c "exec(open('positions_compare.py').read())" > logs/positions_compare.txt 2>&1
./queue2.sh
./queue3.sh
$PY counterfactual.py dca8192 --ref none8k_samedist > logs/dca8192.counterfactual.txt 2>&1
$PY crosscheck.py > logs/crosscheck.txt 2>&1
$PY needle_token.py dca8192_xq none8k_xq > logs/needle_token.txt 2>&1
$PY compare.py dca8192 dca8192_nomscale dca8192_chunkllama_mscale dca8192_no_older dca8192_older_sink_only yarn4 none8k_samedist > logs/compare.txt 2>&1
