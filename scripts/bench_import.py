"""Start-up cost of ``import rope_ext``: seconds over ``import transformers.modeling_utils`` (which any use of
rope_ext needs anyway), each in a fresh interpreter, interleaved with the baseline (the order reversed every other
round), with the modeling modules the import pulls in. Writes JSON (``--out``);
``python -X importtime -c "import rope_ext"`` shows the breakdown.

    python scripts/bench_import.py --rounds 7 --out docs/results/bench_import.json
    python scripts/bench_import.py --rounds 7 --pythonpath /tmp/oldpkg --out docs/results/bench_import_c4daf92.json
(the second with a copy of commit c4daf92's ``rope_ext/`` and ``patches/`` as ``/tmp/oldpkg/rope_ext``)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

_CHILD = """
import sys, time
began = time.perf_counter()
import transformers.modeling_utils
base = time.perf_counter()
{extra}
done = time.perf_counter()
models = sorted(m for m in sys.modules if m.startswith("transformers.models.") and ".modeling_" in m)
print(base - began, done - base, len(models))
"""


def _run(extra: str, path: str | None) -> tuple[float, float, int]:
    env = None if path is None else {**os.environ, "PYTHONPATH": path}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD.format(extra=extra)], capture_output=True, text=True, check=True, env=env,
        cwd=path or None,
    )
    base, rest, models = out.stdout.split()
    return float(base), float(rest), int(models)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--pythonpath", help="import rope_ext from this folder instead (an older checkout's copy)")
    args = parser.parse_args()
    rows = []
    for round_ in range(args.rounds):  # interleaved: the cost of rope_ext on top, and of nothing on top
        if round_ % 2 == 0:  # (every other round in the reverse order: neither always runs first)
            _, rope_ext_seconds, models = _run("import rope_ext", args.pythonpath)
            _, nothing_seconds, _ = _run("", args.pythonpath)
        else:
            _, nothing_seconds, _ = _run("", args.pythonpath)
            _, rope_ext_seconds, models = _run("import rope_ext", args.pythonpath)
        rows.append({"rope_ext_s": rope_ext_seconds, "nothing_s": nothing_seconds, "modeling_modules": models})
    costs = sorted(r["rope_ext_s"] - r["nothing_s"] for r in rows)
    summary = {
        "python": sys.version.split()[0],
        "pythonpath": args.pythonpath,
        "rounds": rows,
        "median_s": statistics.median(costs),
        "min_s": costs[0],
        "max_s": costs[-1],
        "modeling_modules_imported": rows[0]["modeling_modules"],
    }
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "rounds"}))


if __name__ == "__main__":
    main()
