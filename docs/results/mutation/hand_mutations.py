"""Mutations applied by hand, one at a time, each followed by a set of tests (see README.md here).

    python docs/results/mutation/hand_mutations.py SET     # SET: formulas, fast_path, validation, rules, rules_2

Each line printed: the mutation, pytest's exit code (1: a test failed, the mutation is caught; 0: none did) and the
tests that failed. The mutations edit a copy of the repository in /tmp/hm (README.md), never the checkout.

The paths and texts are those of the code when these were run, before the three floors (0.2) moved them
(``rope_ext/methods/attention.py`` and ``frequency.py`` became ``position_rules``, ``window_rules``, ``dual_chunk``,
``query_scales`` and a module per frequency method) and declared the options: run it on a checkout of ab59209.
"""
import os
import subprocess
import sys

F, B, W = "rope_ext/methods/frequency.py", "rope_ext/methods/base.py", "rope_ext/methods/windows.py"
R = "rope_ext/attention/rules.py"

#: set name: (tests to run, [(file, text, replacement, name)])
SETS = {
    "formulas": (["-x", "tests/test_formulas.py"], [
 ("rope_ext/methods/attention.py", "0.05 * torch.log((i.to(torch.float64) + 1) / length) + 1", "0.09 * torch.log((i.to(torch.float64) + 1) / length) + 1", "DCA mscale 0.05->0.09"),
 ("rope_ext/methods/attention.py", "0.05 * torch.log((i.to(torch.float64) + 1) / length) + 1", "0.5 * torch.log((i.to(torch.float64) + 1) / length) + 1", "DCA mscale 0.05->0.5"),
 ("rope_ext/methods/attention.py", "min=1.0) ** 2", "min=1.0) ** 1", "DCA mscale not squared"),
 ("rope_ext/methods/attention.py", "/ math.log(length), min=1.0)", "/ math.log(2 * length), min=1.0)", "log-n log L -> log 2L"),
 ("rope_ext/methods/attention.py", "/ math.log(length), min=1.0)", "/ math.log(length) ** 2, min=1.0)", "log-n log L squared"),
 ("rope_ext/methods/attention.py", "max(1, original // 4)", "max(1, original // 3)", "ReRoPE w=L/4 -> L/3"),
 ("rope_ext/methods/attention.py", "k: float = 16.0", "k: float = 8.0", "Leaky k=16 -> 8"),
 ("rope_ext/methods/attention.py", "max(1, original // 8)\n        _check_below(self.method, \"W\"", "max(1, original // 4)\n        _check_below(self.method, \"W\"", "Self-Extend W=L/8 -> L/4"),
 ("rope_ext/methods/attention.py", "G: int = 8", "G: int = 4", "Self-Extend G=8 -> 4"),
 ("rope_ext/methods/attention.py", "max(2, original // 3)", "max(2, original // 4)", "STRING S=L/3 -> L/4"),
 ("rope_ext/methods/attention.py", "min(128, original // 16, S - 1)", "min(256, original // 16, S - 1)", "STRING W=min(128,.) -> min(256,.)"),
 ("rope_ext/methods/attention.py", "max(2, 3 * original // 4)", "max(2, 2 * original // 3)", "DCA chunk 3L/4 -> 2L/3"),
 ("rope_ext/methods/attention.py", "min(original // 8, chunk_size - 1)", "min(original // 16, chunk_size - 1)", "DCA local L/8 -> L/16"),
 ("rope_ext/methods/attention.py", "torch.clamp(torch.remainder(i, self.chunk) + self.chunk, max=self.chunk_size)", "torch.clamp(torch.remainder(i, self.chunk) + self.chunk, max=self.chunk_size - 1)", "DCA regions successive clamp chunk_size-1"),
 ("rope_ext/methods/attention.py", "torch.full_like(i, float(self.chunk_size))", "torch.full_like(i, float(self.chunk_size - 1))", "DCA regions older chunk_size-1"),
 ("rope_ext/methods/windows.py", "successive = torch.clamp(i % s + s, max=chunk_size)", "successive = torch.clamp(i % s + s, max=chunk_size + 1)", "DCA relative successive clamp +1"),
 ("rope_ext/methods/attention.py", "+ (self.W - self.W // self.G)", "+ (self.W - self.W // self.G + 1)", "Self-Extend far query shift +1"),
 ("rope_ext/methods/windows.py", "grouped = (i // group + neighbor_window - neighbor_window // group) - j // group", "grouped = (i // group + neighbor_window) - j // group", "Self-Extend relative without -W//G"),
 ("rope_ext/methods/attention.py", "return i - (self.S - self.W)", "return i - (self.S - self.W) + 1", "STRING far query +1"),
 ("rope_ext/methods/attention.py", "return self.w * (1 - 1 / self.k) + i / self.k", "return self.w * (1 - 1 / self.k) + i / (self.k + 1)", "Leaky far query slope"),
 ("rope_ext/methods/attention.py", "return int(self.w + self.k * (within - 1 - self.w)) + 1", "return int(self.w + self.k * (within - self.w)) + 1", "Leaky intended_length"),
 ("rope_ext/methods/frequency.py", "beta_fast: float = 32.0", "beta_fast: float = 16.0", "beta_fast 32 -> 16"),
 ("rope_ext/methods/frequency.py", "return 0.1 * mscale * math.log(scale) + 1.0", "return 0.2 * mscale * math.log(scale) + 1.0", "YaRN 0.1 ln s -> 0.2 (float)"),
 ("rope_ext/methods/frequency.py", "0.1 * mscale * torch.log(scale) + 1.0", "0.2 * mscale * torch.log(scale) + 1.0", "YaRN 0.1 ln s -> 0.2 (tensor)"),
 ("rope_ext/methods/frequency.py", "high_freq_factor: float = 4.0", "high_freq_factor: float = 2.0", "Llama3 high 4 -> 2"),
 ("rope_ext/methods/frequency.py", "return math.sqrt(1 + math.log(self.factor)", "return (1 + math.log(self.factor)", "LongRoPE without sqrt"),
 ("rope_ext/methods/frequency.py", "return base * factor ** (dim / (dim - 2))", "return base * factor ** (dim / (dim - 1))", "NTK exponent d/(d-1)"),
 ("rope_ext/methods/frequency.py", "seq_len = torch.clamp(seq_len, min=original)\n        return factor * seq_len / original - (factor - 1)", "seq_len = torch.clamp(seq_len, min=original)\n        return factor * seq_len / original - factor", "dynamic scale -(s-1) -> -s (tensor)"),
 ("rope_ext/methods/frequency.py", "high += 0.001", "high += 0.01", "by-parts zero-width ramp 0.001 -> 0.01"),
    ]),
    "fast_path": (["-x"] + [f"tests/test_attention.py::test_fast_path_matches_reference[{m}-llama]" for m in ("dca", "rerope", "logn", "self_extend")], [
 ("rope_ext/attention/rules.py", "torch.clamp(within + s, max=size)", "torch.clamp(within + s, max=size - 1)", "fast DCA successive query clamp size-1"),
 ("rope_ext/attention/rules.py", "torch.full_like(within, float(size))", "torch.full_like(within, float(size - 1))", "fast DCA older query size-1"),
 ("rope_ext/attention/rules.py", "first = max(0, w - q0)", "first = max(0, w - q0 + 1)", "fast window: first far query +1"),
 ("rope_ext/attention/rules.py", "acc, q_std, k_band, v[:, :, band_start:], scale, q0 + a, 0, w - 1, band_start", "acc, q_std, k_band, v[:, :, band_start:], scale, q0 + a, 0, w - 2, band_start", "fast window: band one key short"),
 ("rope_ext/attention/rules.py", "    return None if product is None else product.float()", "    return None", "query scales dropped in the fast path"),
    ]),
    "validation": (["-x", "tests/test_methods.py", "tests/test_windows.py"], [
 (F, '"factor": float(self.factor),\n            "original_max_position_embeddings": spec.original', '"XXfactorXX": float(self.factor),\n            "original_max_position_embeddings": spec.original', "_native_yarn factor key"),
 (F, 'params.update(mscale=float(self.mscale), mscale_all_dim=float(self.mscale_all_dim))', 'params.update(mscale_all_dim=float(self.mscale_all_dim))', "yarn native drops mscale"),
 (F, 'if spec.original_max_position_embeddings != max_position_embeddings:', 'if spec.original_max_position_embeddings == max_position_embeddings:', "dynamic native condition"),
 (F, 'check_positive(self.method, "attention_factor", self.attention_factor, allow_none=True)\n        check_positive(self.method, "mscale"', 'check_positive(self.method, "attention_factor", None, allow_none=True)\n        check_positive(self.method, "mscale"', "yarn attention_factor unchecked"),
 (F, 'check_context_length(self.method, self.original_max_position_embeddings)', 'check_context_length(None, self.original_max_position_embeddings)', "context length message"),
 (B, 'own = cls.__dict__.get("__post_init__")', 'own = None', "plain values first skipped"),
 (W, 'if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:', 'if isinstance(value, bool) and not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:', "window check or->and"),
 ("rope_ext/methods/attention.py", '_check_int(self.method, "W", self.W, 1)\n        _check_int(self.method, "G"', '_check_int(self.method, "W", None, 1)\n        _check_int(self.method, "G"', "self_extend W unchecked"),
    ]),
    "rules": (["-x", "tests/test_program.py", "tests/test_positions.py", "tests/test_attention.py", "tests/test_formulas.py"], [
 (R, "band_start = max(0, q0 - w + 1)", "band_start = max(0, q0 - w + 2)", "window band starts one key late (cache)"),
 (R, "if method.far_key_is_position and far_keys > 0:", "if method.far_key_is_position and far_keys > 1:", "window far keys kept at position: one far key"),
 (R, "if far_keys <= 0 or m - 1 < w:", "if far_keys <= 1 or m - 1 < w:", "window far region skipped with one far key"),
 (R, "b = min(n, start + s - q0)", "b = min(n, start + s + q0)", "DCA block end with a cache"),
 (R, "            out_offset=a, bias=bias,\n", "            out_offset=a, bias=None,\n", "window band drops a bias term"),
 (R, "span.start, bias=block_bias)", "span.start, bias=None)", "DCA earlier chunks drop a bias term"),
 (R, "start, out_offset=a, bias=bias)", "start, out_offset=a, bias=None)", "DCA own chunk drops a bias term"),
    ]),
    "rules_2": (["tests/test_attention.py::test_sequences_one_or_two_past_the_window_match_the_reference", "tests/test_attention.py::test_chunked_prefill_and_decode_equal_the_full_forward"], [
 (R, "first = max(0, w - q0)", "first = max(1, w - q0)", "window far region from the second query (x_window__mutmut_125)"),
 (R, "first = max(0, w - q0)", "first = max(0, w + q0)", "window far region start with a cache (x_window__mutmut_126)"),
 (R, "if far_keys <= 0 or m - 1 < w:", "if far_keys <= 0 or m - 1 <= w:", "window far region skipped at m = w + 1 (x_window__mutmut_101)"),
 (R, "if far_keys <= 0 or m - 1 < w:", "if far_keys <= 0 or m - 2 < w:", "window far region skipped at m = w + 1 (x_window__mutmut_100)"),
    ]),
}


def main(which: str) -> None:
    tests, mutations = SETS[which]
    os.chdir("/tmp/hm")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": "/tmp/hm"}
    for path, old, new, name in mutations:
        src = open(path).read()
        assert src.count(old) == 1, (name, src.count(old))
        open(path, "w").write(src.replace(old, new))
        try:
            r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
                               capture_output=True, text=True, env=env)
            failed = [line.split(" ")[1] for line in r.stdout.splitlines() if line.startswith("FAILED")]
            print(f"{name:48s} rc={r.returncode} caught by: {failed}", flush=True)
        finally:
            open(path, "w").write(src)


if __name__ == "__main__":
    main(sys.argv[1])
