"""Patch the embedded SmolLM2-135M with YaRN, generate from a long prompt, and restore it.

    HF_HUB_OFFLINE=1 .venv/bin/python examples/patch_default_model.py
"""

import torch

import rope_ext
from rope_ext.eval.corpus import kjv_book

model, tokenizer = rope_ext.load_default_model()
prompt = tokenizer(kjv_book("Genesis"), return_tensors="pt").input_ids[:, :10_000]  # beyond the native 8192

with rope_ext.patched(model, "yarn", factor=2.0):
    print("active patch:", rope_ext.get_patch(model))
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=20, do_sample=False)
    print("continuation:", tokenizer.decode(out[0, prompt.shape[-1]:]))

print("restored:", rope_ext.get_patch(model) is None)
