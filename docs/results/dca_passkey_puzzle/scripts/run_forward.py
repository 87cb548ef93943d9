"""One passkey prompt through the default model: greedy answer + teacher-forced answer, with per-layer captures.

Captures, per layer, what the attention function received: keys/values of the whole teacher-forced sequence
(prompt + the correct answer's first tokens), the queries of the last prompt position and of the forced answer
tokens, and the attention output the model used for those queries (fast path).  For rope_ext attention methods
q/k are unrotated (the hook rotates them); for sdpa (unpatched, frequency methods) they arrive rotated.

Usage: run_forward.py NAME --method SPEC|none --length N [--needle-start P] [--trial T] [--variant V]
Variants (process-local monkeypatches, no package file touched):
  chunkllama_mscale : DCA's mscale as ChunkLlama applies it: one factor (0.05 ln(n/L)+1)^2 for every query,
                      n = the current key count (ChunkLlama rebuilds its cos/sin cache for seq_len > L)
  no_older          : DCA without the older-chunks region (queries see their own and the previous chunk)
  older_sink_only   : DCA whose older-chunks region keeps only token 0 (the attention sink): chunk 0's other keys,
                      folded by DCA onto rel' 1025..8192 (the previous chunk's range), are masked
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time

os.environ["HF_HUB_OFFLINE"] = "1"
import torch

torch.set_num_threads(1)
torch.set_num_interop_threads(1)

import frozen_import  # noqa: E402,F401  (rope_ext and rope_ext.patches from /tmp/dca_puzzle)
import rope_ext  # noqa: E402
from rope_ext.eval.passkey import NEEDLE, QUESTION, TASK, FILLER, _encode, passkey_prompt, trial_key  # noqa: E402
from transformers import AttentionInterface  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("name")
p.add_argument("--method", default="none")
p.add_argument("--length", type=int, default=16384)
p.add_argument("--depth", type=float, default=0.9)
p.add_argument("--trial", type=int, default=0)
p.add_argument("--needle-start", type=int, default=None, help="put the needle at this token index instead")
p.add_argument("--key", default=None)
p.add_argument("--variant", default=None)
p.add_argument("--greedy", type=int, default=8)
p.add_argument("--no-capture", action="store_true")
p.add_argument("--extra-q", default=None, help="comma-separated absolute positions whose prefill queries are captured too")
args = p.parse_args()

WORK = "/tmp/dca_puzzle_work"
print("rope_ext from", rope_ext.__file__, "patches from", rope_ext.patches.__file__, flush=True)
assert rope_ext.__file__.startswith("/tmp/dca_puzzle/"), rope_ext.__file__

model, tok = rope_ext.load_default_model()
key = args.key or trial_key(0, args.length, args.depth, args.trial)
if args.needle_start is None:
    ids = passkey_prompt(tok, args.length, args.depth, key)[0].tolist()
else:  # the protocol's prompt with the needle at an explicit token index
    task, needle, question = (_encode(tok, t) for t in (TASK, NEEDLE.format(key=key), QUESTION))
    budget = args.length - len(task) - len(needle) - len(question)
    unit = _encode(tok, FILLER)
    filler = (unit * (budget // len(unit) + 1))[:budget]
    split = args.needle_start - len(task)
    ids = task + filler[:split] + needle + filler[split:] + question
assert len(ids) == args.length
needle_ids = _encode(tok, NEEDLE.format(key=key))
n0 = next(i for i in range(len(ids)) if ids[i : i + len(needle_ids)] == needle_ids)
answer_ids = _encode(tok, " " + key)  # [' ', d, d, d, d, d]
print(f"key {key} needle [{n0}, {n0 + len(needle_ids)}) answer tokens {answer_ids}", flush=True)

if args.method != "none":
    rope_ext.patch(model, args.method)
from rope_ext.hooks.attention import AttentionHook, installed_hooks  # noqa: E402

hooks = list(installed_hooks(model))
L = 8192
if args.variant == "chunkllama_mscale":
    def const_mscale(self, q_pos):
        n = float(q_pos[-1]) + 1
        f = (0.05 * math.log(n / L) + 1) ** 2 if n > L else 1.0
        return torch.full_like(q_pos, f)
    for h in hooks:
        h._query_multiplier = const_mscale.__get__(h)
elif args.variant == "no_older":
    from rope_ext.attention import kernels
    from rope_ext.hooks.attention import rotate
    def _dual_chunk(self, acc, method, q, k, v, scale, q0, q_pos, keys):
        s, size = method.chunk, method.chunk_size
        inv_freq, attention_factor = keys.inv_freq, keys.attention_factor
        k_rot = keys.at(("chunk", method), k, lambda j: torch.remainder(j, s))
        a = 0
        while a < q.shape[2]:
            p0 = q0 + a
            start = (p0 // s) * s
            b = min(q.shape[2], start + s - q0)
            qc, within = q[:, :, a:b], torch.remainder(q_pos[a:b], s)
            span = slice(start, q0 + b)
            kernels.region(acc, rotate(qc, within, inv_freq, attention_factor), k_rot[:, :, span], v[:, :, span], scale, p0, 0, None, start, out_offset=a)
            if start >= s:
                span = slice(start - s, start)
                q_s = rotate(qc, torch.clamp(within + s, max=size), inv_freq, attention_factor)
                acc.attend(a, b, q_s, k_rot[:, :, span], v[:, :, span], scale, span.start)
            a = b
    AttentionHook._dual_chunk = _dual_chunk
elif args.variant == "older_sink_only":
    from rope_ext.attention import kernels
    from rope_ext.hooks.attention import rotate
    def _dual_chunk(self, acc, method, q, k, v, scale, q0, q_pos, keys):
        s, size = method.chunk, method.chunk_size
        inv_freq, attention_factor = keys.inv_freq, keys.attention_factor
        k_rot = keys.at(("chunk", method), k, lambda j: torch.remainder(j, s))
        a = 0
        while a < q.shape[2]:
            p0 = q0 + a
            start = (p0 // s) * s
            b = min(q.shape[2], start + s - q0)
            qc, within = q[:, :, a:b], torch.remainder(q_pos[a:b], s)
            span = slice(start, q0 + b)
            kernels.region(acc, rotate(qc, within, inv_freq, attention_factor), k_rot[:, :, span], v[:, :, span], scale, p0, 0, None, start, out_offset=a)
            if start >= s:
                span = slice(start - s, start)
                q_s = rotate(qc, torch.clamp(within + s, max=size), inv_freq, attention_factor)
                acc.attend(a, b, q_s, k_rot[:, :, span], v[:, :, span], scale, span.start)
            if start >= 2 * s:
                span = slice(0, 1)  # the sink only
                q_o = rotate(qc, torch.full_like(within, float(size)), inv_freq, attention_factor)
                acc.attend(a, b, q_o, k_rot[:, :, span], v[:, :, span], scale, span.start)
            a = b
    AttentionHook._dual_chunk = _dual_chunk
elif args.variant is not None:
    raise SystemExit(f"unknown variant {args.variant}")

impl = model.config._attn_implementation
inner = ALL_ATTENTION_FUNCTIONS[impl]
NQ = 1
cap: dict[int, dict[str, list]] = {}
state = {"on": not args.no_capture}


def wrapper(module, query, key_, value, attention_mask, scaling=None, dropout=0.0, **kw):
    out, w = inner(module, query, key_, value, attention_mask, scaling=scaling, dropout=dropout, **kw)
    if state["on"]:
        c = cap.setdefault(module.layer_idx, {"q": [], "o": [], "k": [], "v": []})
        n, m = query.shape[2], key_.shape[2]
        c["q"].append(query[0, :, -NQ if n > 1 and m == n else 0 :].detach().clone())
        c["o"].append(out[0, -NQ if n > 1 and m == n else 0 :].transpose(0, 1).detach().clone())  # [h, n, d]
        if m == n:  # prefill: all keys
            c["k"].append(key_[0].detach().clone()); c["v"].append(value[0].detach().clone())
        else:  # the keys this call appended
            c["k"].append(key_[0, :, -n:].detach().clone()); c["v"].append(value[0, :, -n:].detach().clone())
        c["scaling"] = scaling
        if m == n and args.extra_q:
            c["xq"] = query[0, :, [int(x) for x in args.extra_q.split(",")]].detach().clone()
            c["xq_pos"] = [int(x) for x in args.extra_q.split(",")]
    return out, w


AttentionInterface.register(impl, wrapper)
ALL_ATTENTION_FUNCTIONS[impl] = wrapper

from transformers import DynamicCache  # noqa: E402

prompt = torch.tensor([ids])
t0 = time.perf_counter()
with torch.no_grad():
    cache = DynamicCache(config=model.config)
    out = model(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
    t_prefill = time.perf_counter() - t0
    logits0 = out.logits[0, -1].double()
    state["on"] = False
    # greedy answer (the protocol's: 8 new tokens)
    gen = [int(logits0.argmax())]
    for _ in range(args.greedy - 1):
        o = model(torch.tensor([[gen[-1]]]), past_key_values=cache, use_cache=True)
        gen.append(int(o.logits[0, -1].argmax()))
    greedy = tok.decode(gen, skip_special_tokens=True)
    cache.crop(-(cache.get_seq_length() - len(ids)))
    assert cache.get_seq_length() == len(ids)
    state["on"] = not args.no_capture
    forced = model(torch.tensor([answer_ids[:-1]]), past_key_values=cache, use_cache=True)
    logits = torch.cat([logits0[None], forced.logits[0].double()])  # predicts answer_ids[0..5]
elapsed = time.perf_counter() - t0
lp = torch.log_softmax(logits, -1)
steps = []
for t, a in enumerate(answer_ids):
    rank = int((lp[t] > lp[t, a]).sum())
    top = lp[t].topk(3)
    steps.append({"target": tok.decode([a]), "logprob": float(lp[t, a]), "rank": rank,
                  "top": [(tok.decode([int(i)]), round(float(v), 3)) for v, i in zip(top.values, top.indices)]})
res = {"name": args.name, "method": args.method, "variant": args.variant, "length": args.length, "key": key,
       "needle": [n0, n0 + len(needle_ids)], "answer_ids": answer_ids, "greedy": greedy,
       "correct": greedy.strip().startswith(key), "forced_steps": steps, "prefill_s": t_prefill, "total_s": elapsed}
print(json.dumps(res, indent=1), flush=True)
os.makedirs(f"{WORK}/runs", exist_ok=True)
json.dump(res, open(f"{WORK}/runs/{args.name}.json", "w"), indent=1)
if not args.no_capture:
    layers = {}
    for li, c in sorted(cap.items()):
        layers[li] = {x: torch.cat(c[x], dim=1) for x in ("q", "o", "k", "v")}
        layers[li]["scaling"] = c["scaling"]
        if "xq" in c:
            layers[li]["xq"], layers[li]["xq_pos"] = c["xq"], c["xq_pos"]
    extra = {}
    if hooks:
        h = hooks[0]
        inv_freq, af = h.rotary.frequencies(torch.tensor([[len(ids) - 1]]), h.layer_type, torch.device("cpu"))
        extra = {"inv_freq": inv_freq.clone(), "attention_factor": float(af), "method": h.method,
                 "original": h.original, "paths": sorted({hh.path for hh in hooks})}
    torch.save({"meta": res, "layers": layers, **extra}, f"{WORK}/runs/{args.name}.pt")
    print("saved", f"{WORK}/runs/{args.name}.pt", flush=True)
