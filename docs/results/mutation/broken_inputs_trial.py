"""Broken inputs for tests/test_trial.py::test_a_window_covering_the_sequence_is_the_unpatched_model_in_every_family,
applied in a copy of the repository at /tmp/mut; run once with the test before issue #34 (`old`) and once after (`new`)."""
import subprocess, sys
ROOT = "/tmp/mut"; PY = sys.executable
env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
ANCHOR = "    ids = input_ids(L - 2, batch=2)\n    base = logits(model, ids)\n"
CASES = [
    ("llama given a softcap it lacks: refused for a reason it should not have", "llama",
     '    if family == "llama":\n        model.config.attn_logit_softcapping = 30.0\n'),
    ("glm4 given a softcap: refused for another reason than its own", "glm4",
     '    if family == "glm4":\n        model.config.attn_logit_softcapping = 30.0\n'),
    ("glm4 no longer refused (the rotation probe disabled in the copy)", "glm4", "LIB"),
]
import sys
version = sys.argv[1]
path = f"{ROOT}/tests/test_trial.py"
src = open(path).read()
assert src.count(ANCHOR) == 1
for name, family, inject in CASES:
    lib = f"{ROOT}/rope_ext/families/attention.py"; lib_src = open(lib).read()
    if inject == "LIB":
        open(lib, "w").write(lib_src.replace("    modeling = sys.modules.get(cls.__module__)", "    return None\n    modeling = sys.modules.get(cls.__module__)"))
    else:
        open(path, "w").write(src.replace(ANCHOR, inject + ANCHOR))
    try:
        r = subprocess.run([PY, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", f"tests/test_trial.py::test_a_window_covering_the_sequence_is_the_unpatched_model_in_every_family[{family}]"], cwd=ROOT, env=env, capture_output=True, text=True)
    finally:
        open(path, "w").write(src); open(lib, "w").write(lib_src)
    lines = r.stdout.splitlines()
    print(f"[{version}] {name}: {'RED' if r.returncode else 'green'} ({lines[-1]})")
    for e in [l for l in lines if l.startswith("E ")][:2]:
        print("    ", e[:250])
