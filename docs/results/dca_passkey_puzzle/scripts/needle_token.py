"""Where do the needle tokens' own queries attend (the tokens whose keys the induction heads later look for)?

Per layer, for the extra captured prefill queries (the needle's ' ' after ' is' first): attention mass (mean over
heads) on the own chunk (rel' = true distance), the previous chunk (exact here: i mod s < local_window),
chunk 0 (DCA's older region: folded onto rel' 1025..8192, the previous chunk's range) without token 0, and token
0 (the sink); and the relative change of the layer's attention output when chunk 0 minus the sink is masked.
The 8k reference: own-chunk-equivalent distances (rel <= i mod s), the rest, token 0.
Usage: needle_token.py DCA_RUN REF_RUN
"""
import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
import torch

torch.set_num_threads(1)
import frozen_import  # noqa: F401
from rope_ext.attention.reference import remapped_rope_scores

W = "/tmp/dca_puzzle_work/runs"
d = torch.load(f"{W}/{sys.argv[1]}.pt", weights_only=False)
r = torch.load(f"{W}/{sys.argv[2]}.pt", weights_only=False)
m = d["method"]
s = m.chunk
for x in range(2):
    i = d["layers"][0]["xq_pos"][x]
    ri = r["layers"][0]["xq_pos"][x]
    print(f"\nquery DCA {i} (i mod s = {i % s}) / reference {ri} (same distance to the needle and the question)")
    print("layer | DCA: own  prev  chunk0-rest  sink | out change w/o chunk0-rest | ref: near  rest  sink")
    tot = [0.0] * 4
    for li in range(30):
        c, rc = d["layers"][li], r["layers"][li]
        g = c["q"].shape[0] // c["k"].shape[0]
        q = c["xq"][:, x]
        j = torch.arange(i + 1)
        rel = m.relative(torch.tensor([[i]]), j[None])
        sc = remapped_rope_scores(q[None, :, None], c["k"][None, :, : i + 1].repeat_interleave(g, 1), rel[None],
                                  d["inv_freq"], d["attention_factor"])[0, :, 0] * c["scaling"]
        sc = sc * float(m.query_scale(torch.tensor([i]), d["original"])[0])
        w = torch.softmax(sc, -1)
        ci = i // s
        own = w[:, ci * s :].sum(-1).mean()
        prev = w[:, (ci - 1) * s : ci * s].sum(-1).mean()
        rest0 = w[:, 1 : (ci - 1) * s].sum(-1).mean()
        sink = w[:, 0].mean()
        v = c["v"][:, : i + 1].repeat_interleave(g, 0).double()
        o = (w[:, None] @ v)[:, 0]
        keep = torch.ones(i + 1, dtype=torch.bool)
        keep[1 : (ci - 1) * s] = False
        w2 = torch.softmax(sc.masked_fill(~keep, float("-inf")), -1)
        o2 = (w2[:, None] @ v)[:, 0]
        change = float((o - o2).norm() / o.norm())
        rq = rc["xq"][:, x].double()
        rs = (rq[:, None] @ rc["k"][:, : ri + 1].repeat_interleave(g, 0).double().transpose(1, 2))[:, 0] * rc["scaling"]
        rw = torch.softmax(rs, -1)
        near = rw[:, ri - (i % s) :].sum(-1).mean()
        rsink = rw[:, 0].mean()
        print(f"{li:5d} | {own:.3f} {prev:.3f} {rest0:.3f} {sink:.3f} | {change:.3f} | {near:.3f} {1 - near - rsink:.3f} {rsink:.3f}")
        for t, val in enumerate((own, prev, rest0, sink)):
            tot[t] += float(val) / 30
    print(f" mean | {tot[0]:.3f} {tot[1]:.3f} {tot[2]:.3f} {tot[3]:.3f}")
