"""The survivors of `mutmut run "rope_ext.methods.biases*"` classified as missing tests, applied by hand in the copy
/tmp/mut, each run against tests/test_mutation_survivors.py (KeyOnlyBias: tests/test_floor1.py, now selected); and the
ones classified equivalent, run too (expected green)."""
import subprocess, sys
ROOT = "/tmp/mut"; PY = sys.executable
env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
S = ["tests/test_mutation_survivors.py"]
F = ["tests/test_floor1.py::test_declaring_a_key_only_form_without_key_bias_is_refused_when_the_class_is_defined"]
TIF = "if self.table.shape[0] <= longest or self.table.device != device:"
SIZE = "size = max(2 * self.table.shape[0], longest + 1, 1024)"
INV = "inv_freq = 1.0 / self.base ** (2 * torch.arange(1, self.dim // 2 + 1, dtype=torch.float64) / self.dim)"
TAB = "self.table = table.to(device=device, dtype=torch.float32)"
TF = "table = self._table(int(d.max()) if d.numel() else 0, q_pos.device)"
KB = "slopes = self.slopes.to(device=k_pos.device, dtype=torch.float32)"
CB = 'self.register_buffer("compression", compression, persistent=False)'
TB = 'self.register_buffer("table", torch.zeros(0), persistent=False)'
W = "layer.weight.copy_(torch.rand(layer.weight.shape, generator=generator) * 2 * bound - bound)"
BB = "layer.bias.copy_(torch.rand(layer.bias.shape, generator=generator) * 2 * bound - bound)"
FM = "return FireBias(heads, self.width, self.c, self.threshold, self.eps, generator)"
MISSING = [
    ("KeyOnlyBias.__init_subclass__ 1", "if cls.key_bias is KeyOnlyBias.key_bias:", "if cls.key_bias is not KeyOnlyBias.key_bias:", F),
    ("KeyOnlyBias.__init_subclass__ 2", 'raise TypeError(f"{cls.__name__} declares a key-only bias (KeyOnlyBias) but defines no key_bias(c, k_pos)")', "raise TypeError(None)", F),
    ("AlibiBias.key_bias 3", KB, "slopes = self.slopes.to(device=k_pos.device, dtype=None)", S),
    ("AlibiBias.key_bias 5", KB, "slopes = self.slopes.to(device=k_pos.device, )", S),
    ("FireBias.__init__ 21", "bound = 1 / math.sqrt(layer.in_features)", "bound = 1 * math.sqrt(layer.in_features)", S),
    ("FireBias.__init__ 22", "bound = 1 / math.sqrt(layer.in_features)", "bound = 2 / math.sqrt(layer.in_features)", S),
    ("FireBias.__init__ 25", W, W.replace("* 2 * bound - bound", "* 2 * bound + bound"), S),
    ("FireBias.__init__ 26", W, W.replace("* 2 * bound - bound", "* 2 / bound - bound"), S),
    ("FireBias.__init__ 27", W, W.replace("* 2 * bound - bound", "/ 2 * bound - bound"), S),
    ("FireBias.__init__ 32", W, W.replace("* 2 * bound - bound", "* 3 * bound - bound"), S),
    ("FireBias.__init__ 34", BB, BB.replace("* 2 * bound - bound", "* 2 * bound + bound"), S),
    ("FireBias.__init__ 35", BB, BB.replace("* 2 * bound - bound", "* 2 / bound - bound"), S),
    ("FireBias.__init__ 41", BB, BB.replace("* 2 * bound - bound", "* 3 * bound - bound"), S),
    ("FireBias.forward 25", "x[..., None].to(self.mlp[0].weight.dtype)", "x[..., None].to(None)", S),
    ("FireConfig.module 1", "class FireConfig", None, S),
    ("SandwichBias.__init__ 23", CB, 'self.register_buffer("compression", compression, )', S),
    ("SandwichBias.__init__ 26", CB, 'self.register_buffer("compression", compression, persistent=True)', S),
    ("SandwichBias.__init__ 32", TB, 'self.register_buffer("table", torch.zeros(0), )', S),
    ("SandwichBias.__init__ 37", TB, 'self.register_buffer("table", torch.zeros(0), persistent=True)', S),
    ("SandwichBias._table 3", TIF, TIF.replace("<=", "<"), S),
    ("SandwichBias._table 10", SIZE, "size = max(2 * self.table.shape[0], 1024)", S),
    ("SandwichBias._table 15", SIZE, "size = max(2 * self.table.shape[0], longest - 1, 1024)", S),
    ("SandwichBias._table 27", INV, INV.replace("dtype=torch.float64", "dtype=None"), S),
    ("SandwichBias._table 30", INV, INV.replace(", dtype=torch.float64", ", "), S),
    ("SandwichBias._table 52", TAB, "self.table = table.to(device=device, dtype=None)", S),
    ("SandwichBias._table 54", TAB, "self.table = table.to(device=device, )", S),
    ("SandwichBias.forward 11", TF, "table = self._table(int(d.max()) if (d.numel()) and False else 0, q_pos.device)", S),
    ("SandwichBias.forward 12", TF, "table = self._table(int(d.max()) if (d.numel()) or True else 0, q_pos.device)", S),
    ("SandwichConfig.module 4", "if not dim or dim % 2:", "if not dim and dim % 2:", S),
    ("SandwichConfig.module 8", 'raise ValueError(f"{self.method}: give dim (an even int); the model\'s head dimension is {head_dim!r}")', "raise ValueError(None)", S),
]
EQUIVALENT = [
    ("SandwichBias._table 9", SIZE, "size = max(longest + 1, 1024)", S),
    ("SandwichBias._table 33", INV, INV.replace("self.dim // 2 + 1", "self.dim / 2 + 1"), S),
    ("SandwichBias._table 38", "d = torch.arange(size, dtype=torch.float64)", "d = torch.arange(size, dtype=None)", S),
    ("SandwichBias._table 46", ".sum(-1) - self.dim / 2", ".sum(+1) - self.dim / 2", S),
    ("SandwichBias.__init__ 20", CB, 'self.register_buffer("compression", compression, persistent=None)', S),
    ("SandwichBias.__init__ 36", TB, 'self.register_buffer("table", torch.zeros(1), persistent=False)', S),
    ("SandwichBias.forward 14", TF, "table = self._table(int(d.max()) if d.numel() else 1, q_pos.device)", S),
    ("FireBias.forward 15", "(torch.log1p(c * normaliser) + self.eps)", "(torch.log1p(c * normaliser) - self.eps)",
     S + ["tests/test_pinned_defaults.py", "tests/test_biases.py::test_fire_bias_at_hand_computed_points"]),
    ("FireConfig.module 4", "manual_seed(self.seed * 100_003 + index)\n        return FireBias", "manual_seed(self.seed * 100_003 - index)\n        return FireBias",
     S + ["tests/test_biases.py::test_two_patches_with_one_seed_start_from_the_same_parameters"]),
]
B = f"{ROOT}/rope_ext/methods/biases.py"
which = sys.argv[1] if len(sys.argv) > 1 else "missing"
for name, old, new, tests in (MISSING if which == "missing" else EQUIVALENT):
    src = open(B).read()
    if new is None:  # FireConfig.module's default index 0 -> 1 (the signature line inside FireConfig only)
        head, tail = src.split("class FireConfig", 1)
        sig = "def module(self, heads: int, index: int = 0, head_dim: int | None = None) -> nn.Module:"
        assert tail.count(sig) >= 1
        mutated = head + "class FireConfig" + tail.replace(sig, sig.replace("index: int = 0", "index: int = 1"), 1)
    else:
        assert src.count(old) == 1, (name, src.count(old))
        mutated = src.replace(old, new)
    open(B, "w").write(mutated)
    try:
        r = subprocess.run([PY, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests], cwd=ROOT, env=env, capture_output=True, text=True)
    finally:
        open(B, "w").write(src)
    lines = [l for l in r.stdout.splitlines() if l.strip()]
    failed = [l for l in lines if l.startswith("FAILED") or l.startswith("ERROR")][:1]
    print(f"{name}: {'RED (killed)' if r.returncode else 'green'} -- {lines[-1] if lines else r.stderr[-200:]}")
    for f in failed: print("     ", f[:220])
    sys.stdout.flush()
