"""The offline texts (``rope_ext.eval.corpus``, ``rope-ext corpus``): what each reads from its Debian package, the
files written for ``--text-files``, and fetching a package without root. The texts themselves come from `make setup`."""

import hashlib
import json
import os
import subprocess

import pytest

from rope_ext.cli import main
from rope_ext.eval import corpus
from rope_ext.eval.corpus import TEXTS, fetch_texts, text_documents, write_corpus


@pytest.fixture(scope="module")
def documents():
    return {name: dict(text_documents(name)) for name in TEXTS if name != "kjv"}


def test_each_text_reads_its_documents_as_running_text(documents):
    devil = documents["devils-dictionary"]["devils-dictionary"]
    assert "AMBROSE BIERCE" in devil and "ABASEMENT, n." in devil and "ZEAL, n." in devil
    assert "00-database" not in devil  # (dictd's header entries)
    assert len(devil) > 300_000
    assert list(documents["debian-reference"]) == ["debian-reference"]
    assert "Debian Reference" in documents["debian-reference"]["debian-reference"][:2000]
    gnu = documents["gnu-standards"]
    assert sorted(gnu) == ["gnu-coding-standards", "gnu-maintainers"]
    for text in gnu.values():
        assert "\x1f" not in text and "Tag Table:" not in text  # (Info's node separators and index)
    assert "GNU Coding Standards" in gnu["gnu-coding-standards"][:3000]
    perl = documents["perl-doc"]
    assert {"perlfunc", "perlop", "perlre", "perlsyn", "perlguts"} <= set(perl)
    assert not {"perltoc", "perlapi", "perluniprops", "perlintern", "perlmodlib"} & set(perl)  # generated lists
    assert not [title for title in perl if title.endswith("delta") and title[4:-5].isdigit()]
    assert "=head1" in perl["perlfunc"]


def test_the_kjv_is_its_books():
    books = dict(text_documents("kjv"))
    assert len(books) == 66 and next(iter(books)) == "Genesis" and list(books)[-1] == "Revelation"


def test_an_unknown_text_names_the_texts():
    with pytest.raises(ValueError, match="unknown text 'bible'; texts: kjv, devils-dictionary, debian-reference"):
        text_documents("bible")


def test_write_corpus_writes_each_document_and_its_digest(tmp_path, documents):
    out = tmp_path / "corpus"
    manifest = write_corpus(str(out), ["gnu-standards", "devils-dictionary"])
    assert sorted(os.listdir(out)) == ["corpus.json", "devils-dictionary", "gnu-standards"]
    assert json.loads((out / "corpus.json").read_text()) == manifest
    for name in ("gnu-standards", "devils-dictionary"):
        entry = manifest["texts"][name]
        assert entry["package"].startswith(TEXTS[name].package) and entry["license"] == TEXTS[name].license
        assert sorted(os.listdir(out / name)) == sorted(documents[name])
        for title, text in documents[name].items():
            data = (out / name / title).read_bytes()
            assert data.decode("utf-8") == text
            assert entry["documents"][title] == {"characters": len(text), "sha256": hashlib.sha256(data).hexdigest()}
    assert oct(os.stat(out).st_mode & 0o777) != oct(0o700)  # (not the private mode of its temporary folder)


def test_write_corpus_replaces_only_a_corpus_folder_and_only_when_told(tmp_path):
    out = tmp_path / "corpus"
    write_corpus(str(out), ["devils-dictionary"])
    with pytest.raises(ValueError, match="already holds a corpus: pass --overwrite"):
        write_corpus(str(out), ["gnu-standards"])
    write_corpus(str(out), ["gnu-standards"], overwrite=True)
    assert sorted(os.listdir(out)) == ["corpus.json", "gnu-standards"]  # the old text is gone
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a corpus folder"):
        write_corpus(str(other), ["devils-dictionary"], overwrite=True)
    assert os.listdir(other) == ["notes.txt"]
    with pytest.raises(ValueError, match="unknown 'nope'; texts: kjv"):
        write_corpus(str(tmp_path / "new"), ["nope"])
    assert not (tmp_path / "new").exists()


def test_a_missing_text_leaves_nothing_written(tmp_path, monkeypatch):
    def missing():
        raise FileNotFoundError("not installed")

    monkeypatch.setitem(TEXTS, "devils-dictionary", corpus.Text("dict-devil", "", "", missing))
    with pytest.raises(FileNotFoundError, match="not installed"):
        write_corpus(str(tmp_path / "out"), ["gnu-standards", "devils-dictionary"])
    assert os.listdir(tmp_path) == []


def fake_apt(tmp_path, monkeypatch, succeed=True):
    """An ``apt-get`` on PATH whose ``download`` copies a package built here (``dpkg-deb --build``) or fails."""
    package = tmp_path / "pkg"
    (package / "DEBIAN").mkdir(parents=True)
    (package / "DEBIAN" / "control").write_text(
        "Package: dict-devil\nVersion: 9.9-1\nArchitecture: all\nMaintainer: t <t@t>\nDescription: test\n"
    )
    (package / "usr/share/dictd").mkdir(parents=True)
    import gzip

    with gzip.open(package / "usr/share/dictd/devil.dict.dz", "wt") as handle:
        handle.write("00-database-short\n     The Devil's Dictionary\nABSURDITY, n.  A statement of belief.\n")
    subprocess.run(["dpkg-deb", "--build", str(package), str(tmp_path / "dict-devil_9.9-1_all.deb")],
                   check=True, capture_output=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = f"cp {tmp_path}/dict-devil_9.9-1_all.deb ." if succeed else "echo 'E: Unable to locate package' >&2; exit 100"
    (bin_dir / "apt-get").write_text(f"#!/bin/sh\n{script}\n")
    (bin_dir / "apt-get").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("ROPE_EXT_TEXTS", str(tmp_path / "texts"))


def test_fetch_unpacks_the_package_without_root_and_keeps_what_is_there(tmp_path, monkeypatch):
    fake_apt(tmp_path, monkeypatch)
    assert fetch_texts(["devils-dictionary"]) == ["dict-devil"]
    assert text_documents("devils-dictionary") == [
        ("devils-dictionary", "     The Devil's Dictionary\nABSURDITY, n.  A statement of belief.\n")
    ]
    assert corpus.text_version("devils-dictionary") == "dict-devil_9.9-1_all.deb"
    assert fetch_texts(["devils-dictionary"]) == []  # already there
    assert sorted(os.listdir(tmp_path / "texts")) == ["dict-devil"]


def test_a_failed_download_says_why_and_leaves_nothing(tmp_path, monkeypatch):
    fake_apt(tmp_path, monkeypatch, succeed=False)
    with pytest.raises(OSError, match=r"apt-get download dict-devil failed \(E: Unable to locate package\)"):
        fetch_texts(["devils-dictionary"])
    assert os.listdir(tmp_path / "texts") == []
    with pytest.raises(FileNotFoundError, match="rope-ext corpus --fetch"):
        text_documents("devils-dictionary")


def test_the_command_lists_writes_and_refuses_in_one_line(tmp_path, capsys):
    assert main(["corpus", "--texts", "devils-dictionary,gnu-standards"]) == 0
    out = capsys.readouterr().out
    assert "devils-dictionary  dict-devil (public domain)" in out and "2 documents" in out
    assert main(["corpus", str(tmp_path / "c"), "--texts", "devils-dictionary"]) == 0
    assert "1 document from dict-devil" in capsys.readouterr().out
    for texts, message in (("devil", "unknown text 'devil'; texts: kjv"), ("kjv,kjv", "kjv given more than once")):
        assert main(["corpus", str(tmp_path / "d"), "--texts", texts]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1
    assert not (tmp_path / "d").exists()
