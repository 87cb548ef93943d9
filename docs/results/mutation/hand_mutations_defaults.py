"""Hand mutations in a copy of the tree (/tmp/mut): apply, run tests, restore."""
import subprocess, sys, time
ROOT = "/tmp/mut"
PY = sys.executable
B = "rope_ext/methods/biases.py"
P = "rope_ext/train/pose.py"
MUTATIONS = [
    ("K1 kerple log r1 scale 2 -> 3", B, "scales = (2.0, 1.0) if", "scales = (3.0, 1.0) if"),
    ("K2 kerple log r2 scale 1 -> 2", B, "scales = (2.0, 1.0) if", "scales = (2.0, 2.0) if"),
    ("K3 kerple log scales swapped", B, "scales = (2.0, 1.0) if", "scales = (1.0, 2.0) if"),
    ("K4 kerple power r1 scale 1 -> 2", B, 'else (1.0, 2.0)', 'else (2.0, 2.0)'),
    ("K5 kerple power r2 scale 2 -> 3", B, 'else (1.0, 2.0)', 'else (1.0, 3.0)'),
    ("K6 kerple form test flipped", B, 'if self.form == "log" else (1.0, 2.0)', 'if self.form != "log" else (1.0, 2.0)'),
    ("K7 kerple eps 1e-2 -> 2e-2", B, "eps: float = option(1e-2,", "eps: float = option(2e-2,"),
    ("K8 kerple eps 1e-2 -> 1e-3", B, "eps: float = option(1e-2,", "eps: float = option(1e-3,"),
    ("K9 kerple init clamp dropped", B, "_uniform(heads, s, generator).clamp(min=self.eps)", "_uniform(heads, s, generator)"),
    ("K10 uniform * scale -> / scale", B, "generator=generator, dtype=torch.float32) * scale", "generator=generator, dtype=torch.float32) / scale"),
    ("F1 fire c 0.1 -> 1.1", B, "c: float = option(0.1,", "c: float = option(1.1,"),
    ("F2 fire c 0.1 -> 0.2", B, "c: float = option(0.1,", "c: float = option(0.2,"),
    ("F3 fire threshold 512 -> 513", B, "threshold: float = option(512.0,", "threshold: float = option(513.0,"),
    ("F4 fire threshold 512 -> 1024", B, "threshold: float = option(512.0,", "threshold: float = option(1024.0,"),
    ("F5 fire threshold 512 -> 256", B, "threshold: float = option(512.0,", "threshold: float = option(256.0,"),
    ("P1 pose (W+1)//2 -> W//2", P, "(window + 1) // 2 + 1", "window // 2 + 1"),
    ("P2 pose top length excluded", P, "(window + 1) // 2 + 1", "(window + 1) // 2"),
    ("P3 pose (W+1)//2 -> (W+2)//2", P, "(window + 1) // 2 + 1", "(window + 2) // 2 + 1"),
    ("P4 pose (W+1)//2 -> (W-1)//2", P, "(window + 1) // 2 + 1", "(window - 1) // 2 + 1"),
    ("P5 pose shortest first chunk 1 -> 2", P, "torch.randint(1, (window + 1) // 2 + 1", "torch.randint(2, (window + 1) // 2 + 1"),
    ("P6 pose (W+1)//2 -> (W+1)/2 rounded down by int()", P, "torch.randint(1, (window + 1) // 2 + 1", "torch.randint(1, int((window + 1) / 2) + 1"),
]
OLD = {
    "K": ["tests/test_biases.py::test_kerple_log_and_power_at_known_r1_r2", "tests/test_biases.py::test_kerple_clamp_passes_the_gradient_through"],
    "F": ["tests/test_biases.py::test_fire_bias_at_hand_computed_points"],
    "P": ["tests/test_positions.py::test_pose_position_ids_follow_the_reference_scheme",
          "tests/test_finetune.py::test_pose_batches_increase_stay_below_the_target_and_do_not_depend_on_the_batching"],
}
env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}

def run(tests):
    t = time.time()
    r = subprocess.run(["nice", "-n", "19", PY, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                       cwd=ROOT, env=env, capture_output=True, text=True)
    last = [l for l in r.stdout.splitlines() if l.strip()][-1]
    failed = [l for l in r.stdout.splitlines() if l.startswith("FAILED")]
    return r.returncode, last, failed, time.time() - t

only = sys.argv[1:]
for name, path, old, new in MUTATIONS:
    if only and name.split()[0] not in only:
        continue
    full = f"{ROOT}/{path}"
    src = open(full).read()
    assert src.count(old) == 1, (name, src.count(old))
    open(full, "w").write(src.replace(old, new))
    try:
        rc_old, last_old, _, _ = run(OLD[name[0]])
        rc_new, last_new, failed, dt = run(["tests/test_pinned_defaults.py"])
    finally:
        open(full, "w").write(src)
    print(f"{name}\n  {path}: {old!r} -> {new!r}\n  earlier tests: {'RED' if rc_old else 'green'} ({last_old})"
          f"\n  test_pinned_defaults.py: {'RED (killed)' if rc_new else 'GREEN (SURVIVED)'} ({last_new})")
    for f in failed:
        print("   ", f)
    sys.stdout.flush()
