import subprocess, os
os.chdir("/tmp/hm")
M = [
 ("rope_ext/attention/rules.py", "torch.clamp(within + s, max=size)", "torch.clamp(within + s, max=size - 1)", "fast DCA successive query clamp size-1"),
 ("rope_ext/attention/rules.py", "torch.full_like(within, float(size))", "torch.full_like(within, float(size - 1))", "fast DCA older query size-1"),
 ("rope_ext/attention/rules.py", "first = max(0, w - q0)", "first = max(0, w - q0 + 1)", "fast window: first far query +1"),
 ("rope_ext/attention/rules.py", "acc, q_std, k_band, v[:, :, band_start:], scale, q0 + a, 0, w - 1, band_start", "acc, q_std, k_band, v[:, :, band_start:], scale, q0 + a, 0, w - 2, band_start", "fast window: band one key short"),
 ("rope_ext/attention/rules.py", "    return None if product is None else product.float()", "    return None", "query scales dropped in the fast path"),
]
env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": "/tmp/hm"}
for path, old, new, name in M:
    src = open(path).read()
    assert src.count(old) == 1, (name, src.count(old))
    open(path, "w").write(src.replace(old, new))
    try:
        r = subprocess.run(["/work/main/.venv/bin/python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                            "tests/test_attention.py::test_fast_path_matches_reference[dca-llama]", "tests/test_attention.py::test_fast_path_matches_reference[rerope-llama]",
                            "tests/test_attention.py::test_fast_path_matches_reference[logn-llama]", "tests/test_attention.py::test_fast_path_matches_reference[self_extend-llama]"],
                           capture_output=True, text=True, env=env)
        failed = [l.split(" ")[1] for l in r.stdout.splitlines() if l.startswith("FAILED")]
        print(f"{name:45s} rc={r.returncode} caught by: {failed}", flush=True)
    finally:
        open(path, "w").write(src)
