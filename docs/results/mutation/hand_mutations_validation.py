import subprocess, os
os.chdir("/tmp/hm")
F = "rope_ext/methods/frequency.py"; B = "rope_ext/methods/base.py"; W = "rope_ext/methods/windows.py"
M = [
 (F, '"factor": float(self.factor),\n            "original_max_position_embeddings": spec.original', '"XXfactorXX": float(self.factor),\n            "original_max_position_embeddings": spec.original', "_native_yarn factor key"),
 (F, 'params.update(mscale=float(self.mscale), mscale_all_dim=float(self.mscale_all_dim))', 'params.update(mscale_all_dim=float(self.mscale_all_dim))', "yarn native drops mscale"),
 (F, 'if spec.original_max_position_embeddings != max_position_embeddings:', 'if spec.original_max_position_embeddings == max_position_embeddings:', "dynamic native condition"),
 (F, 'check_positive(self.method, "attention_factor", self.attention_factor, allow_none=True)\n        check_positive(self.method, "mscale"', 'check_positive(self.method, "attention_factor", None, allow_none=True)\n        check_positive(self.method, "mscale"', "yarn attention_factor unchecked"),
 (F, 'check_context_length(self.method, self.original_max_position_embeddings)', 'check_context_length(None, self.original_max_position_embeddings)', "context length message"),
 (B, 'own = cls.__dict__.get("__post_init__")', 'own = None', "plain values first skipped"),
 (W, 'if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:', 'if isinstance(value, bool) and not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:', "window check or->and"),
 ("rope_ext/methods/attention.py", '_check_int(self.method, "W", self.W, 1)\n        _check_int(self.method, "G"', '_check_int(self.method, "W", None, 1)\n        _check_int(self.method, "G"', "self_extend W unchecked"),
]
env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": "/tmp/hm"}
for path, old, new, name in M:
    src = open(path).read()
    if src.count(old) != 1:
        print(name, "PATTERN COUNT", src.count(old)); continue
    open(path, "w").write(src.replace(old, new))
    try:
        r = subprocess.run(["/work/main/.venv/bin/python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "tests/test_methods.py", "tests/test_windows.py"], capture_output=True, text=True, env=env)
        failed = [l.split(" ")[1] for l in r.stdout.splitlines() if l.startswith("FAILED")]
        print(f"{name:35s} rc={r.returncode} caught by: {failed}", flush=True)
    finally:
        open(path, "w").write(src)
