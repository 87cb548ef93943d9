"""rope_ext's DCA positions (rope_ext.methods.windows.dca_positions) beside ChunkLlama's
(HKUNLP/ChunkLlama chunkllama_attn_replace.py @ 2add4d7, re-implemented from its cos/sin tables and the
index arithmetic of its forward) on the 16k depth-0.9 passkey prompt, chunk_size 8192, local_window 1024."""
import json
import math

import torch
import frozen_import  # noqa: F401

from rope_ext.methods import DualChunkConfig

L, N = 8192, 16384
cfg = DualChunkConfig(chunk_size=8192).resolved(L)
size, lw, s = cfg.chunk_size, cfg.local_window, cfg.chunk
pos = json.load(open("/tmp/dca_puzzle_work/needle_positions.json"))["0"]
n0, n1 = pos["needle"]

# ChunkLlama's tables: q_t[p] = p, qc_t[p] = min(p + s, chunk_size), k_t[j] = j % s  (scaling_factor 1)
q_t = lambda p: p
qc_t = lambda p: min(p + s, size)
k_t = lambda j: j % s


def chunkllama_rel(i, j, prefill):
    """ChunkLlama's query position minus key position for query i, key j (which call covers the pair)."""
    if prefill:  # forward(), not has_kv_cache: chunk of i = [begin, end), k_states_prev = the chunk before
        c = i // s
        if j >= c * s:
            return q_t(i % s) - k_t(j), "intra (causal flash)"
        if j >= (c - 1) * s:
            return qc_t(i % s) - k_t(j), "succ (qc_cos at position_ids % chunk_len)"
        return qc_t(s - 1) - k_t(j), "inter (qc_cos at chunk_len - 1)"
    c = i // s  # decode: chunk_num_curr = (kv_seq_len - 1) // chunk_len
    if j >= c * s:
        return q_t(i % s) - k_t(j), "intra"
    if j >= (c - 1) * s:
        return qc_t(i % s) - k_t(j), "succ"
    return qc_t(s - 1) - k_t(j), "inter (q at chunk_len - 1 of qc)"


keys = {"first token (0)": 0, "start of chunk 1 (7168)": 7168, "last of chunk 1 (14335)": 14335,
        "start of chunk 2 (14336)": 14336, "needle start": n0, "key digit 1 (1st copy)": n0 + 5,
        "key digit 1 (2nd copy)": n0 + 15, "needle end": n1 - 1, "question start": N - 11}
queries = {"last prompt token (16383, predicts ' ')": (16383, True), "answer step 1 (16384, predicts digit 1)": (16384, False),
           "answer step 5 (16388)": (16388, False)}
print(f"chunk_size {size}, local_window {lw}, chunk s {s}; chunks [0,{s}) [{s},{2*s}) [{2*s},{3*s})")
print(f"needle [{n0},{n1}) -> chunk {n0 // s} (question's chunk {16383 // s}); key at j mod s = {(n0+5) % s}")
rows = []
for qn, (i, prefill) in queries.items():
    print(f"\nquery {qn}: i mod s = {i % s} ({'> local_window: successive q saturates at chunk_size' if i % s + s > size else 'unsaturated'}); "
          f"q positions rope_ext intra {i % s}, succ {min(i % s + s, size)}, older {size}")
    for kn, j in keys.items():
        r_ext = int(cfg.relative(torch.tensor([[i]]), torch.tensor([[j]]))[0, 0])
        r_cl, region = chunkllama_rel(i, j, prefill)
        rows.append({"query": i, "key": kn, "j": j, "true_rel": i - j, "rope_ext": r_ext, "chunkllama": r_cl, "region": region})
        print(f"  {kn:28s} j={j:5d} true {i-j:5d}  rope_ext {r_ext:5d}  ChunkLlama {r_cl:5d}  [{region}]")
# exhaustive agreement over all keys for the analysed queries
for i, prefill in [(16383, True)] + [(x, False) for x in range(16384, 16390)]:
    jj = torch.arange(i + 1)
    ext = cfg.relative(torch.tensor([[i]]), jj[None])[0]
    cl = torch.tensor([chunkllama_rel(i, int(j), prefill)[0] for j in jj])
    assert torch.equal(ext, cl), i
print("\nrope_ext == ChunkLlama rel' for every key of queries 16383..16389: True")
# how many keys sit nearer (smaller rel') than the key digits for the last prompt token
i = 16383
rel = cfg.relative(torch.tensor([[i]]), torch.arange(i + 1)[None])[0]
rk = int(rel[n0 + 5])
print(f"keys with rel' < {rk} (the key's): {int((rel < rk).sum())} (with true distances: {rk}); "
      f"from the previous chunk: {int((rel[s:2*s] < rk).sum())}, from chunk 0: {int((rel[:s] < rk).sum())}")
counts = torch.bincount(rel, minlength=size + 1)
print(f"keys per rel' value for query 16383: rel' 0..1024: {sorted(set(counts[:1025].tolist()))}, 1025..2047: "
      f"{sorted(set(counts[1025:2048].tolist()))}, 2048..8191: {sorted(set(counts[2048:8192].tolist()))}, 8192: {int(counts[8192])} "
      f"(own chunk exact; chunk 1 saturated and chunk 0 both onto 1025..8192)")
ms_ext = lambda p: max(1.0, 0.05 * math.log((p + 1) / L) + 1) ** 2
print(f"mscale (score multiplier): ChunkLlama at a 16384-token prefill, every query: {(0.05*math.log(N/L)+1)**2:.4f}; "
      f"rope_ext per query: needle tokens (i~{n0}) {ms_ext(n0):.4f}, query 16383 {ms_ext(16383):.4f}, query 7000 {ms_ext(7000):.4f} "
      f"(ChunkLlama {(0.05*math.log(N/L)+1)**2:.4f})")
json.dump(rows, open("/tmp/dca_puzzle_work/positions_table.json", "w"), indent=1)

# every (query, key) pair of the 16k prefill: ChunkLlama's prefill loop, vectorised, against dca_positions
def chunkllama_prefill_rel(i, j):
    c = i // s
    intra = (i % s) - (j % s)
    succ = torch.clamp(i % s + s, max=size) - (j % s)
    inter = min(s - 1 + s, size) - (j % s)  # qc_t[chunk_len - 1]
    return torch.where(j >= c * s, intra, torch.where(j >= (c - 1) * s, succ, inter))


jj = torch.arange(N)[None]
for a in range(0, N, 1024):
    ii = torch.arange(a, a + 1024)[:, None]
    causal = jj <= ii
    assert torch.equal(cfg.relative(ii, jj)[causal], chunkllama_prefill_rel(ii, jj)[causal]), a
print("rope_ext == ChunkLlama rel' for all causal (query, key) pairs of the 16384-token prefill: True")
