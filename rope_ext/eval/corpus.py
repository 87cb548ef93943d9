"""Long texts available offline, each from Debian packages that the install step fetches by name: the King James
Bible (the default corpus), and texts of other styles for training mixes and held-out reports (``TEXTS``)."""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rope_ext.runs.atomic import written_whole

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


# --- other texts: one source per name, read from the files its Debian package installs ---------------------------


@dataclass(frozen=True)
class Text:
    """A named text: the Debian package that installs it, its licence, what it is, and how its documents are read
    (``read() -> [(title, text), ...]``, raising ``FileNotFoundError`` with the install command when absent)."""

    package: str
    license: str
    about: str
    read: Callable[[], list[tuple[str, str]]]


def texts_root() -> str:
    """Where ``fetch_texts`` unpacks the packages (``$ROPE_EXT_TEXTS``, default ``~/.cache/rope_ext/texts``): one
    folder per package holding its files as installed (``dpkg-deb -x``), so no root, daemon or dependency is
    needed; a package installed system-wide (``apt-get install``) is read from ``/`` as well."""
    return os.path.expanduser(os.environ.get("ROPE_EXT_TEXTS") or "~/.cache/rope_ext/texts")


def _installed(pattern: str, package: str) -> list[str]:
    for root in (os.path.join(texts_root(), package), "/"):
        paths = sorted({os.path.realpath(path) for path in glob.glob(os.path.join(root, pattern.lstrip("/")))})
        if paths:
            return paths
    raise FileNotFoundError(
        f"{pattern} not found (Debian package {package}): run `make setup` or `rope-ext corpus --fetch`"
    )


def fetch_texts(names: list[str] | None = None) -> list[str]:
    """Download and unpack the Debian packages of the named texts (default every one but the KJV, which the
    ``bible`` command reads) into ``texts_root()``; those already there are kept. The packages fetched."""
    fetched = []
    for name in names or [name for name in TEXTS if name != "kjv"]:
        package = TEXTS[name].package
        target = os.path.join(texts_root(), package)
        if name == "kjv" or os.path.isdir(target):
            continue
        os.makedirs(texts_root(), exist_ok=True)
        with tempfile.TemporaryDirectory(dir=texts_root()) as work:  # (a half-unpacked package is never seen)
            download = ["apt-get", "download", package]
            result = subprocess.run(download, cwd=work, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                reason = (result.stderr.strip().splitlines() or ["no message"])[-1]
                raise OSError(f"apt-get download {package} failed ({reason}): `sudo apt-get update` may be needed")
            (deb,) = glob.glob(os.path.join(work, "*.deb"))
            subprocess.run(["dpkg-deb", "-x", deb, os.path.join(work, "root")], check=True, capture_output=True)
            with open(os.path.join(work, "root", "package.json"), "w", encoding="utf-8") as handle:
                json.dump({"package": package, "deb": os.path.basename(deb)}, handle)
            os.replace(os.path.join(work, "root"), target)
        fetched.append(package)
    return fetched


def _gzip_text(path: str) -> str:
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return handle.read()


def _info(path: str) -> str:
    """An Info manual as running text: node separators and the closing tag table removed."""
    text = _gzip_text(path).split("\x1f\nTag Table:", 1)[0]
    return text.replace("\x1f", "")


def _kjv() -> list[tuple[str, str]]:
    books = kjv_books()
    return list(zip(books["title"], books["text"]))


def _devil() -> list[tuple[str, str]]:
    (path,) = _installed("/usr/share/dictd/devil.dict.dz", "dict-devil")  # dictzip: gzip with random access
    lines = _gzip_text(path).splitlines(keepends=True)
    return [("devils-dictionary", "".join(line for line in lines if not line.startswith("00-database")))]


def _debian_reference() -> list[tuple[str, str]]:
    (path,) = _installed("/usr/share/debian-reference/debian-reference.en.txt.gz", "debian-reference-en")
    return [("debian-reference", _gzip_text(path))]


def _gnu_standards() -> list[tuple[str, str]]:
    paths = _installed("/usr/share/info/[sm]*[sn].info.gz", "gnu-standards")
    names = {"standards.info.gz": "gnu-coding-standards", "maintain.info.gz": "gnu-maintainers"}
    return [(names[path.rsplit("/", 1)[1]], _info(path)) for path in paths if path.rsplit("/", 1)[1] in names]


# Generated lists (contents, API, internals, modules, Unicode properties), not prose; version deltas are left out too.
PERL_SKIPPED = ("perltoc", "perlapi", "perluniprops", "perlintern", "perlmodlib")


def _perl_doc() -> list[tuple[str, str]]:
    (perlfunc,) = _installed("/usr/share/perl/5*/pod/perlfunc.pod", "perl-doc")  # (perl itself installs perldiag)
    documents = []
    for path in sorted(glob.glob(os.path.join(os.path.dirname(perlfunc), "*.pod"))):
        title = path.rsplit("/", 1)[1][: -len(".pod")]
        if title not in PERL_SKIPPED and not re.fullmatch(r"perl\d+delta", title):
            with open(path, encoding="utf-8", errors="replace") as handle:
                documents.append((title, handle.read()))
    return documents


TEXTS = {
    "kjv": Text("bible-kjv", "public domain", "the King James Bible, one document per book (66)", _kjv),
    "devils-dictionary": Text(
        "dict-devil", "public domain", "Ambrose Bierce, The Devil's Dictionary (1911), one document", _devil
    ),
    "debian-reference": Text(
        "debian-reference-en", "GPL-2+", "Osamu Aoki, Debian Reference (a technical manual), one document",
        _debian_reference,
    ),
    "gnu-standards": Text(
        "gnu-standards", "GFDL-1.3+", "the GNU Coding Standards and Information for Maintainers of GNU Software "
        "(Info manuals), two documents", _gnu_standards,
    ),
    "perl-doc": Text(
        "perl-doc", "GPL-1+ or Artistic", "Perl's manual pages (POD), one document per page, without the "
        "generated lists and version deltas", _perl_doc,
    ),
}


def text_documents(name: str) -> list[tuple[str, str]]:
    """The documents of the named text, ``[(title, text), ...]``."""
    if name not in TEXTS:
        raise ValueError(f"unknown text {name!r}; texts: {', '.join(TEXTS)}")
    return TEXTS[name].read()


def text_version(name: str) -> str:
    """The Debian package and version a text is read from (``dict-devil_1.0-13.1_all.deb``, or the installed
    package's ``dpkg-query`` version)."""
    package = TEXTS[name].package
    record = os.path.join(texts_root(), package, "package.json")
    if os.path.isfile(record):
        with open(record, encoding="utf-8") as handle:
            return json.load(handle)["deb"]
    if os.path.isdir(os.path.join(texts_root(), package)):
        return f"{package} (unpacked in {texts_root()}, version not recorded)"
    result = subprocess.run(["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True,
                            check=False)
    return f"{package} {result.stdout.strip() or 'unknown version'} (installed)"


def write_corpus(out: str, names: list[str], overwrite: bool = False) -> dict:
    """Write the named texts as plain-text files, ``out/<name>/<title>`` (UTF-8, one document each, for
    ``--text-files``), and ``out/corpus.json`` (package versions, licences, each document's characters and SHA-256).
    The folder is written whole or not at all; an existing one is replaced only with ``overwrite`` and only if it
    is a corpus folder (it holds ``corpus.json``). The manifest."""
    unknown = [name for name in names if name not in TEXTS]
    if unknown or not names:
        raise ValueError(f"--texts: unknown {', '.join(map(repr, unknown)) or 'none given'}; texts: {', '.join(TEXTS)}")
    out = os.path.normpath(out)
    if os.path.lexists(out):
        if not os.path.isdir(out) or os.listdir(out) and not os.path.isfile(os.path.join(out, "corpus.json")):
            raise ValueError(f"{out} exists and is not a corpus folder (no corpus.json): give a new folder")
        if os.listdir(out) and not overwrite:
            raise ValueError(f"{out} already holds a corpus: pass --overwrite to replace it, or give a new folder")
    documents = {name: text_documents(name) for name in dict.fromkeys(names)}  # (every text read before writing)
    manifest: dict = {"texts": {}}
    with written_whole(os.path.abspath(out), ".corpus-") as work:
        for name, docs in documents.items():
            (work / name).mkdir()
            entry = {"package": text_version(name), "license": TEXTS[name].license, "about": TEXTS[name].about}
            entry["documents"] = {}
            for title, text in docs:
                (work / name / title).write_text(text, encoding="utf-8")
                digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
                entry["documents"][title] = {"characters": len(text), "sha256": digest}
            manifest["texts"][name] = entry
        (work / "corpus.json").write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    return manifest
