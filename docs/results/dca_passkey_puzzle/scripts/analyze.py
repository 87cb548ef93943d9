"""Per-layer attention weights of the captured queries (last prompt position + forced answer steps).

For rope_ext DCA runs the weights come from the plain reference formula (rope_ext.attention.reference:
remapped_rope_scores at rel' = method.relative(i, j), float64, with the query multiplier), and the output
weights @ v is compared with what the fast path returned during the forward; method_reference itself is
also called on these queries.  For sdpa runs (unpatched, yarn) q/k were captured rotated: plain softmax.

Usage: analyze.py NAME [--variant-mscale chunkllama]  -> runs/NAME.analysis.json
"""
from __future__ import annotations

import json
import math
import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
import torch

torch.set_num_threads(1)
import frozen_import  # noqa: E402,F401  (rope_ext and rope_ext.patches from /tmp/dca_puzzle)
import rope_ext  # noqa: E402
from rope_ext.attention.reference import method_reference, remapped_rope_scores  # noqa: E402

assert rope_ext.__file__.startswith("/tmp/dca_puzzle/")
WORK = "/tmp/dca_puzzle_work"
name = sys.argv[1]
d = torch.load(f"{WORK}/runs/{name}.pt", weights_only=False)
meta = d["meta"]
method = d.get("method")
variant = meta.get("variant")
n0, n1 = meta["needle"]
digits = [n0 + 5 + t for t in range(5)] + [n0 + 15 + t for t in range(5)]  # the key's two occurrences
L = 8192


def multiplier(i):
    if method is None or not getattr(method, "mscale", False):
        return torch.ones_like(i, dtype=torch.float64)
    if variant == "chunkllama_mscale":
        n = float(i.max()) + 1  # (queries share the current length: close enough for the analysis' 6 queries)
        return torch.full_like(i, (0.05 * math.log(n / L) + 1) ** 2 if n > L else 1.0, dtype=torch.float64)
    return method.query_scale(i, d["original"])


rows = []
for li, c in sorted(d["layers"].items()):
    q, k, v, o = c["q"], c["k"], c["v"], c["o"]
    h, nq, hd = q.shape
    M = k.shape[1]
    groups = h // k.shape[0]
    kk = k.repeat_interleave(groups, 0).double()
    vv = v.repeat_interleave(groups, 0).double()
    scale = c["scaling"] if c["scaling"] is not None else hd ** -0.5
    i = torch.arange(M - nq, M)
    j = torch.arange(M)
    per_q = []
    for t in range(nq):
        jj = j[: i[t] + 1]
        if method is None:
            s = (q[:, t, None].double() @ kk[:, : i[t] + 1].transpose(1, 2))[:, 0] * scale  # [h, keys]
        else:
            rel = method.relative(i[t : t + 1, None], jj[None])  # [1, keys]
            s = remapped_rope_scores(q[None, :, t : t + 1], k[None, :, : i[t] + 1].repeat_interleave(groups, 1),
                                     rel[None], d["inv_freq"], d["attention_factor"])[0, :, 0] * scale
            s = s * multiplier(i[t : t + 1]).double()
        w = torch.softmax(s, -1)  # [h, keys]
        out = (w[:, None, :] @ vv[:, : i[t] + 1])[:, 0]  # [h, d]
        err = float((out.float() - o[:, t]).abs().max())
        info = {
            "layer": li, "step": t, "query": int(i[t]),
            "needle_mean": float(w[:, n0:n1].sum(-1).mean()), "needle_max": float(w[:, n0:n1].sum(-1).max()),
            "digits_mean": float(w[:, digits].sum(-1).mean()), "digits_max": float(w[:, digits].sum(-1).max()),
            "first_tok_mean": float(w[:, 0].mean()),
            "space_after_is_mean": float(w[:, n0 + 4].mean()), "space_after_is_max": float(w[:, n0 + 4].max()),
            "fast_vs_formula_maxabs": err, "out_maxabs": float(o[:, t].abs().max()),
            "needle_per_head": [round(float(x), 4) for x in w[:, n0:n1].sum(-1)],
        }
        if method is not None and hasattr(method, "chunk"):
            sz = method.chunk
            ci = int(i[t]) // sz
            info["intra_mean"] = float(w[:, ci * sz :].sum(-1).mean())
            info["prev_mean"] = float(w[:, (ci - 1) * sz : ci * sz].sum(-1).mean()) if ci >= 1 else 0.0
            info["older_mean"] = float(w[:, : (ci - 1) * sz].sum(-1).mean()) if ci >= 2 else 0.0
            info["first_of_chunks_mean"] = float(w[:, [x for x in range(0, int(i[t]) + 1, sz)]].sum(-1).mean())
        per_q.append(info)
    if method is not None and variant is None and li in (0, 10, 20, 29):  # the package's own reference, on these queries
        ref = method_reference(q[None], k[None], v[None], method=method, query_scale=None, original=d["original"],
                               inv_freq=d["inv_freq"], attention_factor=d["attention_factor"], scaling=scale)[0]
        # method_reference queries are the last nq keys: the captured ones
        for t in range(nq):
            per_q[t]["method_reference_vs_fast_maxabs"] = float((ref[:, t] - o[:, t]).abs().max())
    rows.extend(per_q)
json.dump({"meta": meta, "rows": rows}, open(f"{WORK}/runs/{name}.analysis.json", "w"), indent=0)
errs = [r["fast_vs_formula_maxabs"] for r in rows]
refs = [r["method_reference_vs_fast_maxabs"] for r in rows if "method_reference_vs_fast_maxabs" in r]
print(name, "greedy:", repr(meta["greedy"]), "correct:", meta["correct"])
print("fast vs formula max |diff| over layers/queries:", max(errs), "(max |out|", max(r["out_maxabs"] for r in rows), ")")
if refs:
    print("method_reference vs fast max |diff| (layers 0,10,20,29):", max(refs))
for t in range(2):
    print(f"step {t}: layer needle_mean needle_max digits_mean digits_max first_tok" + (" intra prev older" if "intra_mean" in rows[0] else ""))
    for r in rows:
        if r["step"] == t:
            extra = f" {r['intra_mean']:.3f} {r['prev_mean']:.3f} {r['older_mean']:.3f}" if "intra_mean" in r else ""
            print(f"  {r['layer']:2d} {r['needle_mean']:.4f} {r['needle_max']:.4f} {r['digits_mean']:.4f} {r['digits_max']:.4f} {r['first_tok_mean']:.3f}{extra}")
