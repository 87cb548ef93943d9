"""Same captured q/k (one run), other position maps / key sets: where does the needle's attention go?

For the DCA run's captures (q/k unrotated), per layer, for the last prompt token (step 0) and answer step 1:
the needle mass / the induction target's mass (the needle's ' ' after ' is') under
  dca        : rope_ext's DCA as run (mscale on)
  no_mscale  : the same without mscale
  no_older   : chunk 0 (rel' 1025..8192, duplicating chunk 1's range) masked
  no_prev    : chunk 1 (the previous chunk, saturated: rel' 1025..8192) masked
  intra_only : only the question's own chunk (plain RoPE, rel' 0..2047)
Also (per layer, the head with the most target mass in the 8k reference, if given) the raw score of the target
key and the log-sum-exp of each region's scores: the competition the target faces.
Usage: counterfactual.py RUN [--ref none8k_samedist]
"""
from __future__ import annotations

import argparse
import json
import math
import os

os.environ["HF_HUB_OFFLINE"] = "1"
import torch

torch.set_num_threads(1)
import frozen_import  # noqa: E402,F401
from rope_ext.attention.reference import remapped_rope_scores  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("run")
p.add_argument("--ref", default=None)
p.add_argument("--layers", default="14,15,17,18,20,21,22,23")
a = p.parse_args()
W = "/tmp/dca_puzzle_work/runs"
d = torch.load(f"{W}/{a.run}.pt", weights_only=False)
method = d["method"]
s = method.chunk
n0, n1 = d["meta"]["needle"]
target = n0 + 4
ref = torch.load(f"{W}/{a.ref}.pt", weights_only=False) if a.ref else None

out = []
print(f"{a.run}: needle [{n0},{n1}), induction target (needle ' ' after ' is') at {target}")
hdr = "variant      " + " ".join(f"L{li:>2s}".rjust(12) for li in a.layers.split(","))
for step in (0, 1):
    print(f"\nstep {step}: [needle mass (max over heads) / target mass (max over heads)]")
    print(hdr)
    table = {}
    for li in map(int, a.layers.split(",")):
        c = d["layers"][li]
        q, k = c["q"], c["k"]
        h = q.shape[0]
        g = h // k.shape[0]
        M = k.shape[1]
        i = M - q.shape[1] + step
        j = torch.arange(i + 1)
        rel = method.relative(torch.tensor([[i]]), j[None])
        sc = remapped_rope_scores(q[None, :, step : step + 1], k[None, :, : i + 1].repeat_interleave(g, 1), rel[None],
                                  d["inv_freq"], d["attention_factor"])[0, :, 0] * c["scaling"]  # [h, keys]
        ms = float(method.query_scale(torch.tensor([i]), d["original"])[0])
        ci = i // s
        regions = {"intra": j >= ci * s, "prev": (j >= (ci - 1) * s) & (j < ci * s), "older": j < (ci - 1) * s}
        variants = {
            "dca": (sc * ms, torch.ones_like(j, dtype=torch.bool)),
            "no_mscale": (sc, torch.ones_like(j, dtype=torch.bool)),
            "no_older": (sc * ms, ~regions["older"]),
            "no_prev": (sc * ms, ~regions["prev"]),
            "intra_only": (sc * ms, regions["intra"]),
        }
        for name, (scores, keep) in variants.items():
            w = torch.softmax(scores.masked_fill(~keep, -math.inf), -1)
            table.setdefault(name, []).append((float(w[:, n0:n1].sum(-1).max()), float(w[:, target].max())))
        # competition for the reference's strongest target head
        if ref is not None:
            rc = ref["layers"][li]
            rq, rk = rc["q"], rc["k"]
            rM = rk.shape[1]
            ri = rM - rq.shape[1] + step
            rn0 = ref["meta"]["needle"][0]
            rs = (rq[:, step, None].double() @ rk[:, : ri + 1].repeat_interleave(g, 0).double().transpose(1, 2))[:, 0] * rc["scaling"]
            rw = torch.softmax(rs, -1)
            hh = int(rw[:, rn0 + 4].argmax()) if step == 0 else int(rw[:, rn0 + 5 : rn0 + 10].sum(-1).argmax())
            tgt = target if step == 0 else n0 + 5
            rtgt = rn0 + 4 if step == 0 else rn0 + 5
            rj = torch.arange(ri + 1)
            near = rj >= ri - (i - ci * s)  # the same distances as the DCA query's own chunk
            x = sc[hh] * ms
            row = {"layer": li, "step": step, "head": hh,
                   "dca_target_score": float(x[tgt]), "ref_target_score": float(rs[hh, rtgt]),
                   "dca_lse_intra": float(torch.logsumexp(x[regions["intra"]], 0)),
                   "dca_lse_prev": float(torch.logsumexp(x[regions["prev"]], 0)),
                   "dca_lse_older": float(torch.logsumexp(x[regions["older"]], 0)),
                   "dca_lse_older_wo_first": float(torch.logsumexp(x[1 : (ci - 1) * s], 0)),
                   "dca_first": float(x[0]),
                   "ref_lse_near": float(torch.logsumexp(rs[hh][near], 0)),
                   "ref_lse_far": float(torch.logsumexp(rs[hh][~near], 0)),
                   "ref_lse_far_wo_first": float(torch.logsumexp(rs[hh][1:][~near[1:]], 0)), "ref_first": float(rs[hh, 0]),
                   "dca_target_w": float(torch.softmax(x, -1)[tgt]), "ref_target_w": float(rw[hh, rtgt])}
            out.append(row)
    for name, vals in table.items():
        print(f"{name:12s} " + " ".join(f"{v[0]:.3f}/{v[1]:.3f}".rjust(12) for v in vals))
if out:
    print("\nthe reference's strongest head per layer (step 0: target = needle ' '; step 1: target = first key digit):")
    print("layer step head | target score DCA / ref | DCA lse intra prev older(first tok, rest) | ref lse near far(first, rest) | target weight DCA / ref")
    for r in out:
        print(f"{r['layer']:5d} {r['step']:4d} {r['head']:4d} | {r['dca_target_score']:6.2f} / {r['ref_target_score']:6.2f} | "
              f"{r['dca_lse_intra']:6.2f} {r['dca_lse_prev']:6.2f} {r['dca_lse_older']:6.2f} ({r['dca_first']:6.2f}, {r['dca_lse_older_wo_first']:6.2f}) | "
              f"{r['ref_lse_near']:6.2f} {r['ref_lse_far']:6.2f} ({r['ref_first']:6.2f}, {r['ref_lse_far_wo_first']:6.2f}) | {r['dca_target_w']:.3f} / {r['ref_target_w']:.3f}")
json.dump({"run": a.run, "ref": a.ref, "competition": out}, open(f"{W}/{a.run}.counterfactual.json", "w"), indent=0)
