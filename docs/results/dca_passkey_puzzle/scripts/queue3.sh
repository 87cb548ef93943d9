#!/bin/bash
export HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/dca_puzzle OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
PY=/work/main/.venv/bin/python
cd /tmp/dca_puzzle_work
run() { name=$1; shift; /usr/bin/time -v $PY run_forward.py $name "$@" > logs/$name.log 2>&1; $PY analyze.py $name > logs/$name.analysis.txt 2>&1; }
run dca8192_older_sink_only --method dca:chunk_size=8192 --variant older_sink_only
run none8k_xq --method none --length 8192 --needle-start 6523 --key 94662 --extra-q 6527,6529,8190
run dca8192_xq --method dca:chunk_size=8192 --extra-q 14719,14721,16382
