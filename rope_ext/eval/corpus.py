"""Long public-domain text available offline: the King James Bible from Debian's ``bible-kjv`` packages."""

from __future__ import annotations

import re
import shutil
import subprocess
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from datasets import Dataset

KJV_INSTALL_HINT = (
    "the King James Bible text is not installed: run `make setup` or "
    "`apt-get install bible-kjv bible-kjv-text` (Debian packages)"
)
_BOOK_START = re.compile(r"^(?P<book>.+) 1$")


def kjv_text() -> str:
    """The whole KJV as the ``bible`` command prints it, one verse a line."""
    command = shutil.which("bible")
    if command is None:
        raise FileNotFoundError(KJV_INSTALL_HINT)
    result = subprocess.run([command, "-l0", "gen1:1-rev22:21"], capture_output=True, text=True, check=True)
    return result.stdout


def kjv_books() -> Dataset:
    """One row per book: ``title`` (e.g. ``"Genesis"``) and ``text`` (its chapters and verses)."""
    from datasets import Dataset

    titles: list[str] = []
    texts: list[list[str]] = []
    for line in kjv_text().splitlines():
        match = _BOOK_START.match(line)
        if match and not line.startswith(" "):
            titles.append(match["book"])
            texts.append([])
        if texts:
            texts[-1].append(line)
    return Dataset.from_dict({"title": titles, "text": ["\n".join(lines).strip() + "\n" for lines in texts]})


def kjv_book(title: str) -> str:
    books = kjv_books()
    if title not in books["title"]:
        raise ValueError(f"no KJV book {title!r}; books: {', '.join(books['title'])}")
    return books["text"][books["title"].index(title)]
