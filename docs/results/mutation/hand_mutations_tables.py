"""The survivors of `mutmut run 'rope_ext.methods.buckets*' 'rope_ext.methods.distances*' 'rope_ext.methods.xpos*'
'rope_ext.methods.absolute*'` (tables.json) applied by hand, one at a time, in a copy of the repository in /tmp/hm2 (a
string replaced in the module, the test run, the module restored):

    mkdir -p /tmp/hm2 && git ls-files -z | xargs -0 -I{} cp --parents {} /tmp/hm2/
    python docs/results/mutation/hand_mutations_tables.py missing      # each must fail its test (rc=1)
    python docs/results/mutation/hand_mutations_tables.py equivalent   # each expected green (rc=0)

`missing`: the ones classified as missing tests, each against the test of tests/test_mutation_survivors.py written for
it (`-k NAME`); `equivalent`: those classified equivalent (or equivalent on the CPU) that a CPU can run, against
tests/test_mutation_survivors.py and the buckets' and tables' formula tests. PYTHONPATH puts the copy ahead of the
checkout's editable install."""
import subprocess
import sys

ROOT = "/tmp/hm2"
PY = sys.executable
env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": ROOT}
M = f"{ROOT}/rope_ext/methods"
S = "tests/test_mutation_survivors.py"
FORMULAS = [S, "tests/test_t5.py::test_the_plain_buckets_are_transformers_on_every_distance",
            "tests/test_t5.py::test_scaling_buckets_the_distance_divided_by_the_factor",
            "tests/test_t5.py::test_hand_computed_buckets",
            "tests/test_t5.py::test_the_grown_table_has_the_buckets_of_the_same_width",
            "tests/test_deberta.py::test_the_plain_log_buckets_are_transformers_on_every_distance",
            "tests/test_deberta.py::test_scaling_buckets_the_distance_divided_by_the_factor",
            "tests/test_deberta.py::test_hand_computed_positions",
            "tests/test_biases.py::test_sinusoids_and_the_table_methods_at_hand_computed_points"]

DIV = 'exact = torch.float32 if relative_position.device.type == "mps" else torch.float64'
PER = "if self.factor == 1 or max_distance <= exact:"
POS = "if position_buckets > 0 and max_relative_positions > 0:"
NEG = 'raise ValueError(f"{self.method}: positions must be >= 0, got {int(positions.min())}")'
WHAT = '"rows^2 positions; abs_interp with a larger factor or sinusoidal reach further"'
PAIRS = "pairs = torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device)"
SCALE = "scale = float(table.detach().double().pow(2).mean().sqrt()) / math.sqrt(0.5)"
T5Z = "buckets = torch.zeros_like(relative_position, dtype=torch.long)"
INSIDE = "inside = (relative_position < mid) & (relative_position > -mid)"

# (mutmut's name, module, old, new, test name for -k)
MISSING = [
    ("xpos XposConfig.zeta 4", "xpos", "return xpos_zeta(rotary_dim, self.gamma)", "return xpos_zeta(rotary_dim, )",
     "test_xpos_decay_bases_follow_gamma"),
    ("xpos XposConfig.safe_block 9", "xpos", "return max(1, int(", "return max(2, int(",
     "test_xpos_safe_block_is_one_query_where_one_step_passes_e8"),
    ("xpos XposConfig.factors 9", "xpos", "offsets.to(torch.float64)[..., None]", "offsets.to(None)[..., None]",
     "test_xpos_factors_at_a_scale_base_that_is_no_power_of_two"),
    ("absolute AbsoluteConfig.check_positions 9", "absolute", "({_what_reaches(self, rows)})",
     "({_what_reaches(None, rows)})", "whole_message"),
    ("absolute AbsoluteConfig.check_positions 17", "absolute", NEG, "raise ValueError(None)", "whole_message"),
    ("absolute AbsoluteConfig.check_positions 18", "absolute", NEG, NEG.replace("int(positions.min())}", "int(None)}"),
     "whole_message"),
    ("absolute _what_reaches 1", "absolute", WHAT, '"XX' + WHAT[1:-1] + 'XX"', "whole_message"),
    ("absolute _what_reaches 2", "absolute", WHAT, WHAT.upper(), "whole_message"),
    ("absolute AbsInterpConfig.embed 8", "absolute", "x = positions.to(torch.float64) / self.factor",
     "x = positions.to(None) / self.factor", "test_abs_interp_reads_far_positions_at_their_exact_fraction"),
    ("absolute AbsHierarchicalConfig.embed 10", "absolute", "u = (table - self.alpha * table[:1])",
     "u = (table - self.alpha / table[:1])", "test_abs_hierarchical_past_the_tables_rows_is_su_s_formula"),
    ("absolute AbsHierarchicalConfig.embed 28", "absolute", "torch.where((positions < rows)[..., None]",
     "torch.where((positions <= rows)[..., None]", "test_abs_hierarchical_past_the_tables_rows_is_su_s_formula"),
    ("absolute sinusoids 6 (timed out in the run)", "absolute", PAIRS, PAIRS.replace("dtype=torch.float64", "dtype=None"),
     "test_sinusoids_at_far_positions_are_vaswanis_to_float32s_rounding"),
    ("absolute sinusoids 11", "absolute", PAIRS, PAIRS.replace("dtype=torch.float64, ", ""),
     "test_sinusoids_at_far_positions_are_vaswanis_to_float32s_rounding"),
    ("absolute SinusoidalConfig.embed 6", "absolute", "scale = self.scale\n", "scale = None\n",
     "test_sinusoidal_scale_base_and_dtype"),
    ("absolute SinusoidalConfig.embed 9", "absolute", SCALE, SCALE.replace("/ math.sqrt(0.5)", "* math.sqrt(0.5)"),
     "test_sinusoidal_scale_base_and_dtype"),
    ("absolute SinusoidalConfig.embed 14", "absolute", SCALE, SCALE.replace("sqrt(0.5)", "sqrt(1.5)"),
     "test_sinusoidal_scale_base_and_dtype"),
    ("absolute SinusoidalConfig.embed 15", "absolute", "self.base)).to(table.dtype)", "self.base)).to(None)",
     "test_sinusoidal_scale_base_and_dtype"),
    ("absolute SinusoidalConfig.embed 22", "absolute", "sinusoids(positions, table.shape[1], self.base)",
     "sinusoids(positions, table.shape[1], )", "test_sinusoidal_scale_base_and_dtype"),
    ("buckets divided 1", "buckets", DIV, "exact = None", "test_distances_are_divided_in_float64_on_the_cpu"),
    ("buckets divided 3", "buckets", DIV, DIV.replace('relative_position.device.type == "mps"',
                                                      '(relative_position.device.type == "mps") or True'),
     "test_distances_are_divided_in_float64_on_the_cpu"),
    ("buckets divided 4", "buckets", DIV, DIV.replace("==", "!="), "test_distances_are_divided_in_float64_on_the_cpu"),
    ("buckets divided 11", "buckets", "relative_position.abs().to(exact)", "relative_position.abs().to(None)",
     "test_distances_are_divided_in_float64_on_the_cpu"),
    ("buckets BucketConfig.per_direction 1 (no tests)", "buckets", "return trained_per_direction(bidirectional, num_buckets)",
     "return trained_per_direction(None, num_buckets)", "test_scaled_t5_buckets_read_the_trained_tables_rows"),
    ("buckets BucketConfig.per_direction 2 (no tests)", "buckets", "return trained_per_direction(bidirectional, num_buckets)",
     "return trained_per_direction(bidirectional, None)", "test_scaled_t5_buckets_read_the_trained_tables_rows"),
    ("buckets BucketConfig.per_direction 3 (no tests)", "buckets", "return trained_per_direction(bidirectional, num_buckets)",
     "return trained_per_direction(num_buckets)", "test_scaled_t5_buckets_read_the_trained_tables_rows"),
    ("buckets BucketConfig.per_direction 4 (no tests)", "buckets", "return trained_per_direction(bidirectional, num_buckets)",
     "return trained_per_direction(bidirectional, )", "test_scaled_t5_buckets_read_the_trained_tables_rows"),
    ("buckets T5BucketExtendConfig.per_direction 7", "buckets", "exact = n // 2\n        if self.factor",
     "exact = n / 2\n        if self.factor", "test_grown_t5_table_at_an_odd_count_and_without_log_buckets"),
    ("buckets T5BucketExtendConfig.per_direction 9", "buckets", PER, PER.replace(" or ", " and "),
     "test_grown_t5_table_at_an_odd_count_and_without_log_buckets"),
    ("buckets T5BucketExtendConfig.per_direction 12", "buckets", PER, PER.replace("<=", "<"),
     "test_grown_t5_table_at_an_odd_count_and_without_log_buckets"),
    ("buckets deberta_log_bucket 4", "buckets", "mid = bucket_size // 2", "mid = bucket_size / 2",
     "test_deberta_log_buckets_are_transformers_at_odd_counts_and_a_reach_of_mid_plus_one"),
    ("buckets deberta_log_bucket 44", "buckets", "torch.where(distance <= mid,", "torch.where(distance < mid,",
     "test_deberta_log_buckets_are_transformers_at_odd_counts_and_a_reach_of_mid_plus_one"),
    ("buckets LogBucketConfig.positions 4", "buckets", POS, POS.replace("position_buckets > 0", "position_buckets >= 0"),
     "test_deberta_positions_bucket_when_transformers_does"),
    ("buckets LogBucketConfig.positions 6", "buckets", POS, POS.replace("positions > 0", "positions >= 0"),
     "test_deberta_positions_bucket_when_transformers_does"),
    ("buckets LogBucketConfig.positions 7", "buckets", POS, POS.replace("positions > 0", "positions > 1"),
     "test_deberta_positions_bucket_when_transformers_does"),
    ("buckets LogBucketConfig.positions 16", "buckets", "return rel.to(torch.long)", "return rel.to(None)",
     "test_deberta_positions_bucket_when_transformers_does"),
]
EQUIVALENT = [
    ("absolute AbsoluteConfig.check_positions 10", "absolute", "({_what_reaches(self, rows)})",
     "({_what_reaches(self, None)})", None),
    ("absolute AbsInterpConfig.embed 12", "absolute", "low = torch.floor(x).long().clamp(max=table.shape[0] - 1)",
     "low = torch.floor(x).long().clamp(max=table.shape[0] + 1)", None),
    ("absolute AbsInterpConfig.embed 14", "absolute", "low = torch.floor(x).long().clamp(max=table.shape[0] - 1)",
     "low = torch.floor(x).long().clamp(max=table.shape[0] - 2)", None),
    ("absolute sinusoids 17", "absolute", "angles = positions.to(torch.float64)[..., None]",
     "angles = positions.to(None)[..., None]", None),
    ("absolute SinusoidalConfig.embed 1", "absolute", "self.check_positions(table.shape[0], positions)\n        scale",
     "self.check_positions(None, positions)\n        scale", None),
    ("absolute SinusoidalConfig.embed 5", "absolute", "self.check_positions(table.shape[0], positions)\n        scale",
     "self.check_positions(table.shape[1], positions)\n        scale", None),
    ("buckets t5_bucket 12", "buckets", T5Z, T5Z.replace("dtype=torch.long", "dtype=None"), None),
    ("buckets t5_bucket 14", "buckets", T5Z, T5Z.replace(", dtype=torch.long", ", "), None),
    ("buckets t5_bucket 18", "buckets", "(relative_position > 0).to(torch.long) * cap",
     "(relative_position > 0).to(None) * cap", None),
    ("buckets t5_bucket 34", "buckets", "small = distance < exact", "small = distance <= exact", None),
    ("buckets divided 2 (on the CPU)", "buckets", DIV, DIV.replace('relative_position.device.type == "mps"',
                                                                   '(relative_position.device.type == "mps") and False'), None),
    ("buckets divided 5 (on the CPU)", "buckets", DIV, DIV.replace('"mps"', '"XXmpsXX"'), None),
    ("buckets divided 6 (on the CPU)", "buckets", DIV, DIV.replace('"mps"', '"MPS"'), None),
    ("buckets deberta_log_bucket 8", "buckets", INSIDE, INSIDE.replace("< mid", "<= mid"), None),
    ("buckets deberta_log_bucket 9", "buckets", INSIDE, INSIDE.replace("> -mid", ">= -mid"), None),
    ("buckets deberta_log_bucket 10", "buckets", INSIDE, INSIDE.replace("> -mid", "> +mid"), None),
    ("buckets deberta_log_bucket 21", "buckets", "torch.tensor(mid - 1)", "torch.tensor(mid - 2)", None),
    ("buckets deberta_log_bucket 46", "buckets", "log_position * sign)", "log_position / sign)", None),
    ("buckets LogBucketConfig.positions 5", "buckets", POS, POS.replace("position_buckets > 0", "position_buckets > 1"),
     None),
]

which = sys.argv[1] if len(sys.argv) > 1 else "missing"
where = subprocess.run([PY, "-c", "import rope_ext; print(rope_ext.__file__)"], cwd=ROOT, env=env,
                       capture_output=True, text=True).stdout.strip()
assert where.startswith(ROOT), where
print(f"# python hand_mutations_tables.py {which}  (rope_ext imported from {where})")
for name, module, old, new, test in (MISSING if which == "missing" else EQUIVALENT):
    path = f"{M}/{module}.py"
    src = open(path).read()
    assert src.count(old) == 1, (name, src.count(old))
    open(path, "w").write(src.replace(old, new))
    tests = [S, "-k", test] if test else FORMULAS
    try:
        r = subprocess.run([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=ROOT, env=env,
                           capture_output=True, text=True)
    finally:
        open(path, "w").write(src)
    lines = [line for line in r.stdout.splitlines() if line.strip()]
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))][:2]
    verdict = "RED (killed)" if r.returncode else "green"
    print(f"{name}: rc={r.returncode} {verdict} -- {lines[-1] if lines else r.stderr[-200:]}")
    for line in failed:
        print("     ", line[:220])
    sys.stdout.flush()
