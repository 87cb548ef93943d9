"""The house in three floors (docs/methods.md, "Layout"), read from the source with an AST walk: every import,
the lazy ones inside functions included, goes to the importer's floor or one below; nothing imports the CLI; no
module takes another module's underscore name; the definitions never import transformers; no import circle; no
library file above about 400 lines; a plain checkout imports without installing."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rope_ext"

#: (floor, rank inside the floor): an import goes to a lower floor, or to the same floor at the same or a lower rank
LAYERS = {
    "rope_ext.registry": (0, 0),
    "rope_ext.methods": (1, 0),
    "rope_ext.attention": (1, 1),
    "rope_ext.installers": (2, 0),
    "rope_ext.families": (2, 1),
    "rope_ext.saved": (2, 2),
    "rope_ext.guards": (2, 2),
    "rope_ext.core": (2, 3),
    "rope_ext.runs": (3, 0),
    "rope_ext.eval": (3, 1),
    "rope_ext.train": (3, 2),
    "rope_ext.serving": (3, 2),
    "rope_ext.cli": (3, 3),
    "rope_ext": (4, 0),  # the package's __init__: the public API
}
#: what the definitions (floor 1) may never import
FLOOR_ONE_FORBIDDEN = ("transformers", "peft", "accelerate", "datasets")
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def layer(module: str) -> tuple[int, int]:
    best = max((prefix for prefix in LAYERS if module == prefix or module.startswith(prefix + ".")), key=len)
    return LAYERS[best]


def imports(module: str) -> list[tuple[str, list[str], int]]:
    """``(imported module, names taken from it, line)`` for every import statement of ``module``, wherever it is."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [alias.name for alias in node.names]
            submodules = [f"{base}.{name}" for name in names if f"{base}.{name}" in MODULES]
            found.append((base, [n for n in names if f"{base}.{n}" not in MODULES], node.lineno))
            found += [(sub, [], node.lineno) for sub in submodules]
    return found


def internal_edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {module: set() for module in MODULES}
    for module in MODULES:
        for target, _, _ in imports(module):
            if target in MODULES and target != module:
                edges[module].add(target)
    return edges


def test_every_import_goes_down_a_floor_or_stays_on_its_own():
    wrong = []
    for module in MODULES:
        here = layer(module)
        for target, _, line in imports(module):
            if target in MODULES and target != "rope_ext" and layer(target) > here:
                wrong.append(f"{MODULES[module].relative_to(ROOT)}:{line} imports {target} (floor {layer(target)} "
                             f"above {here})")
    assert not wrong, "\n".join(wrong)


def test_nothing_imports_the_cli():
    wrong = [f"{module} imports {target}" for module in MODULES if not module.startswith("rope_ext.cli")
             for target, _, _ in imports(module) if target == "rope_ext.cli" or target.startswith("rope_ext.cli.")]
    assert not wrong, wrong


def test_no_module_imports_another_modules_underscore_name():
    wrong = [f"{MODULES[module].relative_to(ROOT)}:{line} takes {', '.join(private)} from {target}"
             for module in MODULES for target, names, line in imports(module)
             if target.startswith("rope_ext") and target != module
             and (private := [n for n in names if n.startswith("_") and not n.startswith("__")])]
    assert not wrong, "\n".join(wrong)


def test_the_definitions_never_import_transformers():
    wrong = [f"{module} imports {target}" for module in MODULES if layer(module)[0] == 1
             for target, _, _ in imports(module) if target.split(".")[0] in FLOOR_ONE_FORBIDDEN]
    assert not wrong, wrong


def test_no_import_circle_lazy_imports_included():
    edges = internal_edges()
    state: dict[str, int] = {}
    circles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(edges[node]):
            if state.get(target) == 1:
                circles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[node] = 2

    for module in sorted(MODULES):
        if module not in state:
            visit(module, [module])
    assert not circles, "\n".join(circles)


def test_the_guard_sees_lazy_imports_and_circles(tmp_path, monkeypatch):
    """The walk reads an import inside a function, and the circle check finds a two-module circle."""
    fake = {"rope_ext.methods.a": tmp_path / "a.py", "rope_ext.methods.b": tmp_path / "b.py"}
    fake["rope_ext.methods.a"].write_text("def f():\n    from rope_ext.methods.b import g\n")
    fake["rope_ext.methods.b"].write_text("from rope_ext.methods.a import f\nimport transformers\n")
    monkeypatch.setattr(sys.modules[__name__], "MODULES", fake)
    assert [t for t, _, _ in imports("rope_ext.methods.a")] == ["rope_ext.methods.b"]
    with pytest.raises(AssertionError, match="rope_ext.methods.a -> rope_ext.methods.b -> rope_ext.methods.a"):
        test_no_import_circle_lazy_imports_included()
    with pytest.raises(AssertionError, match="transformers"):
        test_the_definitions_never_import_transformers()


def test_no_library_file_above_about_400_lines():
    long = {str(path.relative_to(ROOT)): n for path in MODULES.values()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_a_plain_checkout_imports_without_installing(tmp_path):
    """``PYTHONPATH=. python -c "import rope_ext"`` from a copy of the tree outside any install."""
    import shutil

    shutil.copytree(PACKAGE, tmp_path / "rope_ext", ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    code = ("import sys; sys.path = [p for p in sys.path if 'site-packages' not in p or 'rope_ext' not in p]; "
            "import rope_ext, rope_ext.cli; print(rope_ext.__file__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(tmp_path / "rope_ext" / "__init__.py")


def test_every_package_folder_has_an_init_file():
    """``packages.find`` installs a folder only with its ``__init__.py``: without one a wheel would lack it."""
    missing = [str(d.relative_to(ROOT)) for d in [PACKAGE, *PACKAGE.rglob("*")]
               if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py")) and not (d / "__init__.py").exists()]
    assert not missing, missing


def test_importing_the_package_imports_no_modeling_module_nor_the_training_libraries():
    """What keeps ``import rope_ext`` cheap over ``import transformers.modeling_utils`` (0.04 s, scripts/bench_import.py):
    beyond what that import loads, no family's modeling module, and peft, datasets and matplotlib only when a command
    needs them."""
    code = ("import sys, transformers.modeling_utils; before = set(sys.modules); import rope_ext; "
            "print(' '.join(sorted(m for m in set(sys.modules) - before if '.modeling_' in m or "
            "m.split('.')[0] in ('peft', 'accelerate', 'datasets', 'matplotlib'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"}, check=True)
    assert out.stdout.split() == [], out.stdout


def test_the_cli_parser_and_its_option_types_need_no_evaluation_library():
    """``rope_ext.cli`` builds its parser, and a script imports ``rope_ext.cli.options``, without ``datasets`` or
    ``matplotlib`` (a GPU image may lack them: scripts/bench_attention_cuda.py takes its argparse types from there);
    each verb imports what it needs when it runs."""
    code = ("import sys; sys.modules.update(datasets=None, matplotlib=None); import rope_ext.cli.options, rope_ext.cli; "
            "rope_ext.cli.build_parser().parse_args(['eval', 'ppl', '--lengths', '2k']); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.stdout.strip() == "ok", out.stderr[-2000:]
