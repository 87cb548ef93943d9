import subprocess, os
os.chdir("/tmp/hm")
R = "rope_ext/attention/rules.py"
M = [
 (R, "first = max(0, w - q0)", "first = max(1, w - q0)", "window far region from the second query (x_window__mutmut_125)"),
 (R, "first = max(0, w - q0)", "first = max(0, w + q0)", "window far region start with a cache (x_window__mutmut_126)"),
 (R, "if far_keys <= 0 or m - 1 < w:", "if far_keys <= 0 or m - 1 <= w:", "window far region skipped at m = w + 1 (x_window__mutmut_101)"),
 (R, "if far_keys <= 0 or m - 1 < w:", "if far_keys <= 0 or m - 2 < w:", "window far region skipped at m = w + 1 (x_window__mutmut_100)"),
]
env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": "/tmp/hm"}
for path, old, new, name in M:
    src = open(path).read()
    assert src.count(old) == 1, name
    open(path, "w").write(src.replace(old, new))
    try:
        r = subprocess.run(["/work/main/.venv/bin/python", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "tests/test_attention.py::test_sequences_one_or_two_past_the_window_match_the_reference",
                            "tests/test_attention.py::test_chunked_prefill_and_decode_equal_the_full_forward"],
                           capture_output=True, text=True, env=env)
        failed = [l.split(" ")[1] for l in r.stdout.splitlines() if l.startswith("FAILED")]
        print(f"{name:64s} rc={r.returncode} caught by {len(failed)} tests, e.g. {failed[:2]}", flush=True)
    finally:
        open(path, "w").write(src)
