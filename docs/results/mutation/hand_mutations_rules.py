import subprocess, os
os.chdir("/tmp/hm")
R = "rope_ext/attention/rules.py"
M = [
 (R, "band_start = max(0, q0 - w + 1)", "band_start = max(0, q0 - w + 2)", "window band starts one key late (cache)"),
 (R, "if method.far_key_is_position and far_keys > 0:", "if method.far_key_is_position and far_keys > 1:", "window far keys kept at position: one far key"),
 (R, "if far_keys <= 0 or m - 1 < w:", "if far_keys <= 1 or m - 1 < w:", "window far region skipped with one far key"),
 (R, "b = min(n, start + s - q0)", "b = min(n, start + s + q0)", "DCA block end with a cache"),
 (R, "            out_offset=a, bias=bias,\n", "            out_offset=a, bias=None,\n", "window band drops a bias term"),
 (R, "span.start, bias=block_bias)", "span.start, bias=None)", "DCA earlier chunks drop a bias term"),
 (R, "start, out_offset=a, bias=bias)", "start, out_offset=a, bias=None)", "DCA own chunk drops a bias term"),
]
env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": "/tmp/hm"}
for path, old, new, name in M:
    src = open(path).read()
    if src.count(old) != 1:
        print(name, "PATTERN COUNT", src.count(old), flush=True); continue
    open(path, "w").write(src.replace(old, new))
    try:
        r = subprocess.run(["/work/main/.venv/bin/python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                            "tests/test_program.py", "tests/test_positions.py", "tests/test_attention.py", "tests/test_formulas.py"],
                           capture_output=True, text=True, env=env)
        failed = [l.split(" ")[1] for l in r.stdout.splitlines() if l.startswith("FAILED")]
        print(f"{name:48s} rc={r.returncode} caught by: {failed}", flush=True)
    finally:
        open(path, "w").write(src)
