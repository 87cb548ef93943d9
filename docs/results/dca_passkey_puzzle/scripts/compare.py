"""Side-by-side per-layer tables of the runs' analyses (runs/NAME.analysis.json) + their answers.
Usage: compare.py NAME... [--metric needle_mean] [--step 0]"""
import argparse
import json

p = argparse.ArgumentParser()
p.add_argument("names", nargs="+")
p.add_argument("--metrics", default="needle_mean,needle_max,space_after_is_max,digits_max,first_tok_mean")
p.add_argument("--steps", default="0,1")
a = p.parse_args()
W = "/tmp/dca_puzzle_work/runs"
data = {n: json.load(open(f"{W}/{n}.analysis.json")) for n in a.names}
for n, d in data.items():
    m = d["meta"]
    s0 = m["forced_steps"][0]
    print(f"{n:28s} greedy {m['greedy']!r:42s} step0 logp(' ')={s0['logprob']:.3f} rank {s0['rank']} top {s0['top']}; "
          f"digits logp {[round(s['logprob'], 2) for s in m['forced_steps'][1:]]}")
for step in map(int, a.steps.split(",")):
    for metric in a.metrics.split(","):
        print(f"\nstep {step} ({'last prompt token' if step == 0 else f'answer step {step}'}), {metric}")
        print("layer " + " ".join(f"{n[:14]:>14s}" for n in data))
        nl = max(r["layer"] for r in next(iter(data.values()))["rows"]) + 1
        for li in range(nl):
            vals = []
            for d in data.values():
                r = next(r for r in d["rows"] if r["layer"] == li and r["step"] == step)
                vals.append(r.get(metric, float("nan")))
            print(f"{li:5d} " + " ".join(f"{v:14.4f}" for v in vals))
        sums = []
        for d in data.values():
            sums.append(sum(r.get(metric, 0.0) for r in d["rows"] if r["step"] == step))
        print("  sum " + " ".join(f"{v:14.3f}" for v in sums))
