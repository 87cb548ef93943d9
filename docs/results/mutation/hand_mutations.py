import subprocess, sys, os
os.chdir("/tmp/hm")
M = [
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
]
for path, old, new, name in M:
    src = open(path).read()
    assert src.count(old) == 1, (name, src.count(old))
    open(path, "w").write(src.replace(old, new))
    try:
        r = subprocess.run(["/work/main/.venv/bin/python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "tests/test_formulas.py"],
                           capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": "/tmp/hm"})
        failed = [l.split(" ")[1] for l in r.stdout.splitlines() if l.startswith("FAILED")]
        print(f"{name:45s} rc={r.returncode} caught by: {failed}", flush=True)
    finally:
        open(path, "w").write(src)
