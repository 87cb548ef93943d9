"""Every local file the README links to (links and pictures) is tracked by git, so a fresh clone shows it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_INLINE = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+[\"'][^)]*)?\)")  # [text](path "title"), ![alt](path)
_REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)  # [label]: path
_REMOTE = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^//")  # http:, https:, mailto:, ...


def readme_local_links(text: str) -> list[str]:
    links = _INLINE.findall(text) + _REFERENCE.findall(text)
    paths = (link.split("#", 1)[0] for link in links if not link.startswith("#") and not _REMOTE.match(link))
    return sorted({path for path in paths if path})


def test_readme_local_links_are_found():
    text = "![plot](docs/a.png) [b](docs/b.md#part) [c](https://x.org/c.png) [d](#anchor)\n[e]: ./e.txt\n"
    assert readme_local_links(text) == ["./e.txt", "docs/a.png", "docs/b.md"]


def _in_git_checkout() -> bool:
    try:
        found = subprocess.run(["git", "rev-parse", "--is-inside-work-tree"], cwd=ROOT, capture_output=True, text=True)
    except FileNotFoundError:
        return False
    return found.returncode == 0 and found.stdout.strip() == "true"


@pytest.mark.parametrize("path", readme_local_links((ROOT / "README.md").read_text()))
def test_readme_link_is_tracked_by_git(path):
    if not _in_git_checkout():
        pytest.skip("not inside a git checkout")
    tracked = subprocess.run(["git", "ls-files", "--error-unmatch", "--", path], cwd=ROOT, capture_output=True)
    assert tracked.returncode == 0, f"README.md links to {path}, which git does not track (ignored or not committed?)"
