import os, sys, json
os.environ["HF_HUB_OFFLINE"]="1"
import torch; torch.set_num_threads(1)
import frozen_import  # noqa: F401
import rope_ext
print("rope_ext from", rope_ext.__file__)
from rope_ext.eval.passkey import passkey_prompt, trial_key, NEEDLE, QUESTION, _encode
from rope_ext.models import load_default_model
from transformers import AutoTokenizer
from rope_ext.models import default_model_path
folder, name = default_model_path()
tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
def locate(length, depth, key):
    ids = passkey_prompt(tok, length, depth, key)[0].tolist()
    needle = _encode(tok, NEEDLE.format(key=key))
    n0 = next(p for p in range(len(ids)) if ids[p:p+len(needle)] == needle)
    keyids = _encode(tok, key)
    # positions of key digits inside needle (both occurrences)
    occ = [p for p in range(n0, n0+len(needle)) if ids[p:p+len(keyids)] == keyids]
    return ids, n0, len(needle), occ, len(keyids)
out = {}
for trial in range(3):
    key = trial_key(0, 16384, 0.9, trial)
    ids, n0, nl, occ, kl = locate(16384, 0.9, key)
    print("trial", trial, "key", key, "len", len(ids), "needle", n0, n0+nl, "key occurrences", occ, "key toks", kl,
          [tok.decode([t]) for t in ids[n0:n0+nl]])
    out[trial] = dict(key=key, needle=[n0, n0+nl], key_occ=occ, key_len=kl)
print("question tokens", [tok.decode([t]) for t in _encode(tok, QUESTION)])
print("answer toks", [tok.decode([t]) for t in _encode(tok, " 94662.")])
json.dump(out, open("/tmp/dca_puzzle_work/needle_positions.json","w"), indent=1)
