"""Every local file the README and the pages under docs/ link to (links and pictures) is tracked by git, so a
fresh clone shows it. A page's links are relative to the page's own folder, as GitHub resolves them."""

from __future__ import annotations

import os
import posixpath
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_INLINE = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+[\"'][^)]*)?\)")  # [text](path "title"), ![alt](path)
_REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)  # [label]: path
_REMOTE = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^//")  # http:, https:, mailto:, ...
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)  # code blocks hold no links
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]


def readme_local_links(text: str) -> list[str]:
    text = _FENCE.sub("", text)
    links = _INLINE.findall(text) + _REFERENCE.findall(text)
    paths = (link.split("#", 1)[0] for link in links if not link.startswith("#") and not _REMOTE.match(link))
    return sorted({path for path in paths if path})


def page_links(page: str, root: Path = ROOT) -> list[tuple[str, str]]:
    """(link as written, path from the repository root) for every local link of ``page``."""
    folder = posixpath.dirname(page)
    links = readme_local_links((root / page).read_text())
    return [(link, posixpath.normpath(posixpath.join(folder, link))) for link in links]


def test_readme_local_links_are_found():
    text = "![plot](docs/a.png) [b](docs/b.md#part) [c](https://x.org/c.png) [d](#anchor)\n[e]: ./e.txt\n"
    assert readme_local_links(text) == ["./e.txt", "docs/a.png", "docs/b.md"]
    assert readme_local_links("```\n[x](not/a/link.md)\n```\n[y](y.md)\n") == ["y.md"]


def test_page_links_resolve_from_the_page_folder(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "p.md").write_text("[r](../README.md#x) ![i](results/a.png) [q](./q.md)\n")
    assert page_links("docs/p.md", tmp_path) == [
        ("../README.md", "README.md"), ("./q.md", "docs/q.md"), ("results/a.png", "docs/results/a.png")
    ]


def test_the_docs_pages_are_checked():
    """The pages checked are the README and every ``docs/*.md`` on disk (listed here by ``os.scandir``, apart from
    the glob that built ``PAGES``), and each page with a local link has its links among the parametrized cases."""
    on_disk = sorted(f"docs/{entry.name}" for entry in os.scandir(ROOT / "docs")
                     if entry.is_file() and entry.name.endswith(".md"))
    assert "docs/testing.md" in on_disk and (ROOT / "README.md").is_file()
    assert PAGES == ["README.md", *on_disk], f"pages checked {PAGES}; on disk: README.md and {on_disk}"
    (cases,) = [mark.args[1] for mark in test_readme_link_is_tracked_by_git.pytestmark if mark.name == "parametrize"]
    checked = {page for page, _, _ in cases}
    for page in ["README.md", *on_disk]:
        assert page in checked or not page_links(page), f"{page} has local links that no case checks"


def _in_git_checkout() -> bool:
    try:
        found = subprocess.run(["git", "rev-parse", "--is-inside-work-tree"], cwd=ROOT, capture_output=True, text=True)
    except FileNotFoundError:
        return False
    return found.returncode == 0 and found.stdout.strip() == "true"


@pytest.mark.parametrize(("page", "link", "path"), [(page, *pair) for page in PAGES for pair in page_links(page)])
def test_readme_link_is_tracked_by_git(page, link, path):
    if not _in_git_checkout():
        pytest.skip("not inside a git checkout")
    assert not path.startswith("../"), f"{page} links to {link}, outside the repository"
    tracked = subprocess.run(["git", "ls-files", "--error-unmatch", "--", path], cwd=ROOT, capture_output=True)
    assert tracked.returncode == 0, f"{page} links to {link} ({path}): git does not track it (ignored, not committed?)"
