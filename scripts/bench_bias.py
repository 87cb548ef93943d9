"""Speed and memory of an additive bias on the default model (``scripts/bench_attention.py`` with the bias
methods): whole-model prefill time and the prefill's own added memory at each length for plain causal SDPA
(unpatched), ALiBi on rope_ext's blockwise path (the bias computed per block of queries, never ``[heads, n, n]``),
and ALiBi materialised whole into one float mask as BLOOM and MPT do (up to ``--materialised-max``); interleaved
rounds, ratios to the same round's SDPA with their spread. No decode by default (``--decode-tokens 32`` adds it).

With ``--model t5``, T5's relative bias: a T5 of t5-small's shape (random weights), its prefill the encoder over
each length and 128 decoder tokens, unpatched (transformers' bias, a ``(batch, heads, q, k)`` float mask under
SDPA in every layer) against a bucket method on rope_ext's blockwise path (``rope_ext.attention.relative``);
``--child-memory-gb`` caps each measuring process (transformers' T5 adds about 16 GiB at 16k).

    python scripts/bench_bias.py [--lengths 2k,4k,8k,16k] [--methods alibi] [--materialised-max 8192]
        [--rounds 3] [--memory-rounds 2] [--out results/bench_bias.json] [--overwrite]
    python scripts/bench_bias.py --model t5 --methods t5_bucket_scale:factor=1 --child-memory-gb 21
        --out results/bench_bias_t5.json
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_attention import main  # noqa: E402

DEFAULTS = ["--methods", "alibi", "--materialised-max", "8192", "--decode-tokens", "0", "--out", "results/bench_bias.json"]

if __name__ == "__main__":
    sys.exit(main([*DEFAULTS, *sys.argv[1:]]))
