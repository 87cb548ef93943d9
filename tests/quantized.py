"""A quantized model patched (tests/test_foundation.py runs this in a process of its own, torchao on its path): prints
one JSON line of what it checked, or fails on an assertion."""

from __future__ import annotations

import copy
import json

import torch
from tiny import ORIGINAL_CONTEXT, input_ids, logits, native_model, tiny_model
from torchao.quantization import Int8WeightOnlyConfig, quantize_

import rope_ext

SPECS = ["yarn:factor=4", "rerope:w=8", "alibi"]


def main() -> None:
    ids = input_ids(3 * ORIGINAL_CONTEXT)
    floating = tiny_model("llama")
    model = copy.deepcopy(floating)
    quantize_(model, Int8WeightOnlyConfig())
    quantized = type(model.model.layers[0].self_attn.q_proj.weight).__module__.startswith("torchao.")
    base = logits(model, ids)
    noise = (base - logits(floating, ids)).abs().max().item()
    assert noise > 0
    native_equal = False
    for spec in SPECS:
        with rope_ext.patched(floating, spec):
            expected = logits(floating, ids)
        with rope_ext.patched(model, spec):
            patched = logits(model, ids)
            assert model.generate(ids[:, :10], max_new_tokens=4, do_sample=False).shape == (1, 14)
            if spec.startswith("yarn"):
                native = native_model("llama", {"rope_type": "yarn", "factor": 4.0}, floating)
                quantize_(native, Int8WeightOnlyConfig())
                native_equal = torch.equal(patched, logits(native, ids))
        distance = (patched - expected).abs().max().item()
        assert distance <= 2 * noise and not torch.equal(patched, base), (spec, distance, noise)
        assert torch.equal(logits(model, ids), base), spec
    print(json.dumps({"quantized": quantized, "yarn_native_equal": native_equal, "specs": SPECS}))


if __name__ == "__main__":
    main()
