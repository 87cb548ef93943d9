"""What the benchmark scripts share: their checks of ``--methods`` and ``--decode-tokens``, and the T5 they measure.
Imports nothing of rope_ext's evaluation (``scripts/bench_attention_cuda.py`` runs where its dependencies, datasets
and matplotlib, are not installed; ``rope_ext.cli.options`` needs neither, tests/test_layers.py)."""

from __future__ import annotations


def spec_list(text: str) -> list[str]:
    """Comma-separated specs, each checked now (not in a child process that loaded the model first)."""
    from rope_ext.methods import make_configs
    from rope_ext.methods.spec import split_spec

    specs = [spec.strip() for spec in split_spec(text, ",") if spec.strip()]
    for spec in specs:
        if spec == "sdpa" or spec == "none":
            raise ValueError(f"{spec!r}: unpatched SDPA is always measured; list the methods to compare with it")
        make_configs(spec)
    return specs


def decode_tokens(text: str) -> int:
    value = int(text)
    if value < 0 or value == 1:
        raise ValueError(f"must be 0 (no decode) or at least 2 (a first step and a steady one), got {value}")
    return value


#: the T5 measured with ``--model t5``: t5-small's shape (6 + 6 layers, 8 heads of 64, d_model 512), random weights
T5_SHAPE = dict(vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_decoder_layers=6, num_heads=8,
                relative_attention_num_buckets=32, relative_attention_max_distance=128, decoder_start_token_id=0,
                pad_token_id=0, eos_token_id=1, dropout_rate=0.0)
#: decoder tokens of a T5 prefill (the targets of a span-corruption window of a few hundred tokens)
T5_DECODER_TOKENS = 128
