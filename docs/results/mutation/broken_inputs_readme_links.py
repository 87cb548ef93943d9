"""Broken inputs for the three strengthened tests, applied in the copy /tmp/mut; each run with the old and the new test."""
import subprocess, sys, shutil
ROOT = "/tmp/mut"; PY = sys.executable
env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
CASES = [
    ("readme: PAGES a stale hand list (testing.md missing)", "tests/test_readme_links.py",
     'PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]',
     'PAGES = ["README.md", "docs/benchmarks.md", "docs/biases.md", "docs/cache.md", "docs/evaluation.md", "docs/finetune.md", "docs/methods.md", "docs/results.md"]',
     "tests/test_readme_links.py::test_the_docs_pages_are_checked"),
    ("readme: PAGES from a narrower glob", "tests/test_readme_links.py",
     '(ROOT / "docs").glob("*.md")', '(ROOT / "docs").glob("[a-m]*.md")',
     "tests/test_readme_links.py::test_the_docs_pages_are_checked"),
    ("readme: the parametrization drops the last page", "tests/test_readme_links.py",
     '[(page, *pair) for page in PAGES for pair in page_links(page)]', '[(page, *pair) for page in PAGES[:-1] for pair in page_links(page)]',
     "tests/test_readme_links.py::test_the_docs_pages_are_checked"),
]
for name, path, old, new, test in CASES:
    full = f"{ROOT}/{path}"; src = open(full).read()
    assert src.count(old) == 1, name
    open(full, "w").write(src.replace(old, new))
    try:
        r = subprocess.run([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", test], cwd=ROOT, env=env, capture_output=True, text=True)
    finally:
        open(full, "w").write(src)
    lines = r.stdout.splitlines()
    err = [l for l in lines if l.startswith("E ")][:2]
    print(f"{name}: {'RED' if r.returncode else 'green'} ({lines[-1]})"); [print("   ", e[:230]) for e in err]
