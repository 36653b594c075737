"""Tests for tfpar-download (tfpar.tools.download) against a real HTTP server on 127.0.0.1."""

import contextlib
import functools
import hashlib
import http.server
import io
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import pytest

from tfpar.data import corpora, layouts
from tfpar.tools import download as download_data

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get(
    "TFPAR_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))


class _Handler(http.server.SimpleHTTPRequestHandler):
    """Serves a folder quietly and records the paths asked for."""

    requests: list[str]

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass

    def do_GET(self):
        self.requests.append(self.path)
        super().do_GET()


@contextlib.contextmanager
def _serving(served: Path, base: type = _Handler):
    """Serves ``served`` over HTTP with a ``base`` handler; yields (base_url, requests)."""
    requests: list = []
    handler = type("Handler", (base,), {"requests": requests})
    httpd = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(handler, directory=str(served)))
    # A short poll interval: shutdown() waits up to one interval, 0.5 s by default.
    thread = threading.Thread(target=httpd.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/", requests
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


@pytest.fixture
def server(tmp_path):
    """Serves tmp_path/served over HTTP; yields (folder, base_url, requested paths)."""
    served = tmp_path / "served"
    served.mkdir()
    with _serving(served) as (base_url, requests):
        yield served, base_url, requests


TINY = {"train": b" the cat sat\n the dog ran\n", "valid": b" a cat\n", "test": b" a dog\n"}


@pytest.fixture
def tiny_ptb(server, monkeypatch):
    """Makes "ptb" a tiny corpus that the server holds, with matching checksums."""
    served, base_url, requests = server
    files = []
    for split, data in TINY.items():
        (served / f"ptb.{split}.txt").write_bytes(data)
        sha256 = hashlib.sha256(data).hexdigest()
        files.append(corpora.CorpusFile(split, f"ptb.{split}.txt", sha256))
    monkeypatch.setitem(corpora.KNOWN_CORPORA, "ptb", corpora.KnownCorpus("ptb", tuple(files)))
    return served, base_url, requests


def _run(capsys, *argv):
    code = download_data.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_downloads_verifies_and_reads(tiny_ptb, tmp_path, capsys):
    _, base_url, requests = tiny_ptb
    folder = tmp_path / "in" / "ptb"
    code, out, err = _run(capsys, "ptb", "--base-url", base_url, "--input-dir", str(folder.parent))
    assert (code, err) == (0, "")
    assert out == f"ptb: downloaded 3 of 3 files into {folder}; all checksums match\n"
    assert sorted(requests) == ["/ptb.test.txt", "/ptb.train.txt", "/ptb.valid.txt"]
    assert sorted(p.name for p in folder.iterdir()) == ["ptb.test.txt", "ptb.train.txt",
                                                        "ptb.valid.txt"]
    for split, data in TINY.items():
        assert (folder / f"ptb.{split}.txt").read_bytes() == data
    corpus = corpora.resolve_named("ptb", input_dir=tmp_path / "in")
    assert corpus.lines("train") == ["the cat sat", "the dog ran"]


def test_second_run_is_a_no_op(tiny_ptb, tmp_path, capsys):
    _, base_url, requests = tiny_ptb
    args = ("ptb", "--base-url", base_url, "--input-dir", str(tmp_path))
    assert _run(capsys, *args)[0] == 0
    mtimes = {p: p.stat().st_mtime_ns for p in (tmp_path / "ptb").iterdir()}
    requests.clear()
    code, out, err = _run(capsys, *args)
    assert (code, err, requests) == (0, "", [])
    assert out == (f"ptb: all 3 files already present in {tmp_path / 'ptb'} with the right "
                   "checksums; nothing to do\n")
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "ptb").iterdir()} == mtimes


def test_wrong_file_present_is_downloaded_again(tiny_ptb, tmp_path, capsys):
    _, base_url, requests = tiny_ptb
    (tmp_path / "ptb").mkdir()
    (tmp_path / "ptb" / "ptb.valid.txt").write_bytes(b"stale\n")
    code, out, _ = _run(capsys, "ptb", "--base-url", base_url, "--input-dir", str(tmp_path))
    assert code == 0
    assert out.startswith("ptb: downloaded 3 of 3 files")
    assert (tmp_path / "ptb" / "ptb.valid.txt").read_bytes() == TINY["valid"]


def test_checksum_mismatch_leaves_nothing(tiny_ptb, tmp_path, capsys):
    served, base_url, _ = tiny_ptb
    (served / "ptb.valid.txt").write_bytes(b" tampered\n")
    expected = corpora.KNOWN_CORPORA["ptb"].files[1].sha256
    actual = hashlib.sha256(b" tampered\n").hexdigest()
    code, out, err = _run(capsys, "ptb", "--base-url", base_url, "--input-dir", str(tmp_path))
    assert (code, out) == (2, "")
    assert err == (f"error: ptb.valid.txt from {base_url}ptb.valid.txt has sha256 {actual} but "
                   f"expected {expected}; the server holds a different file, so nothing was "
                   "saved\n")
    # train (verified before valid failed) stays; nothing of valid, final or temporary.
    assert sorted(p.name for p in (tmp_path / "ptb").iterdir()) == ["ptb.train.txt"]


def test_http_404_is_a_one_line_error(server, tmp_path, capsys):
    _, base_url, _ = server  # serves an empty folder
    code, out, err = _run(capsys, "wikitext-2", "--base-url", base_url,
                          "--input-dir", str(tmp_path))
    assert (code, out) == (2, "")
    assert err == (f"error: cannot download {base_url}train.txt: HTTP 404 File not found; "
                   "check --base-url\n")
    # The folder this run created is removed again, so --data says "missing, download it".
    assert not (tmp_path / "wikitext-2").exists()


def test_unreachable_server_is_a_one_line_error(tmp_path, capsys):
    with socket.socket() as s:  # a port that was free a moment ago: connection refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, _, err = _run(capsys, "ptb", "--base-url", f"http://127.0.0.1:{port}",
                        "--input-dir", str(tmp_path), "--timeout", "5")
    assert code == 2
    assert err.startswith(f"error: cannot reach http://127.0.0.1:{port}/ptb.train.txt: ")
    assert err.endswith("; check your connection or --base-url\n") and err.count("\n") == 1
    assert not (tmp_path / "ptb").exists()


def test_unwritable_input_dir_is_a_one_line_error(tiny_ptb, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    code, _, err = _run(capsys, "ptb", "--base-url", tiny_ptb[1], "--input-dir", str(blocker))
    assert code == 2
    assert err.startswith(f"error: cannot create {blocker / 'ptb'}: ") and err.count("\n") == 1


def test_help_describes_every_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        download_data.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--input-dir", "--base-url", "--timeout", "--keep-archive",
                 "{ptb,wikitext-2,wikitext2,lm1b}"):
        assert flag in out


def test_unknown_name_is_rejected(capsys):
    with pytest.raises(SystemExit) as exit_info:
        download_data.main(["ptb3"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'ptb3'" in capsys.readouterr().err


def test_runs_as_a_script_from_the_repo_root():
    # Runs in a clean interpreter with no PYTHONPATH, as a user would before installing.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "scripts/download_data.py", "--help"], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "--base-url" in result.stdout


def test_sources_cover_every_known_corpus():
    assert set(download_data.SOURCES) == set(corpora.KNOWN_CORPORA)
    for name, source in download_data.SOURCES.items():
        assert set(source.remote_names) == set(corpora.SPLITS)
        assert source.base_url.startswith("https://raw.githubusercontent.com/")


def test_real_ptb_files_verify(server, tmp_path, capsys):
    shared = SHARED_DATA / "ptb"
    if not shared.is_dir():
        pytest.skip(f"shared corpus folder {shared} is absent (set TFPAR_SHARED_DATA)")
    served, base_url, _ = server
    for split in corpora.SPLITS:
        shutil.copyfile(shared / f"ptb.{split}.txt", served / f"ptb.{split}.txt")
    args = ("ptb", "--base-url", base_url, "--input-dir", str(tmp_path / "input"))
    assert _run(capsys, *args)[:2] == (0, f"ptb: downloaded 3 of 3 files into "
                                          f"{tmp_path / 'input' / 'ptb'}; all checksums match\n")
    for split in corpora.SPLITS:
        name = f"ptb.{split}.txt"
        assert (tmp_path / "input" / "ptb" / name).read_bytes() == (shared / name).read_bytes()
    assert "nothing to do" in _run(capsys, *args)[1]


# --- lm1b: one archive, unpacked safely ---------------------------------------------------

LM1B = layouts.LM1B_RELEASE_FOLDER
LM1B_NAME = corpora.KNOWN_ARCHIVES["lm1b"].filename
TRAIN_DIR, HELDOUT_DIR = layouts.LM1B_TRAIN_FOLDER, layouts.LM1B_HELDOUT_FOLDER


def _shard_names() -> list[str]:
    return ([f"{TRAIN_DIR}/news.en-{n:05d}-of-00100" for n in range(1, 100)]
            + [f"{HELDOUT_DIR}/news.en.heldout-{n:05d}-of-00050" for n in range(50)])


def _tiny_lm1b_archive(*, drop: str = "") -> bytes:
    """A tar.gz laid out like the release, with tiny shards and members to be skipped."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        def add(name: str, data: bytes = b"", **info) -> None:
            member = tarfile.TarInfo(name)
            member.size = len(data)
            for key, value in info.items():
                setattr(member, key, value)
            tar.addfile(member, io.BytesIO(data))

        add(LM1B, type=tarfile.DIRTYPE)
        add(f"{LM1B}/README", b"not a shard\n")
        for name in _shard_names():
            if name != drop:
                add(f"{LM1B}/{name}", f"{name.rsplit('/', 1)[1]} says hi .\n".encode())
        # Members that must not be written anywhere: traversal, absolute, links, misplaced.
        add(f"{LM1B}/{TRAIN_DIR}/../../../evil-news.en-00001-of-00100", b"evil\n")
        add("../evil", b"evil\n")
        add("/tmp/tfpar-evil", b"evil\n")
        add(f"{LM1B}/{TRAIN_DIR}/news.en-00100-of-00100", type=tarfile.SYMTYPE,
            linkname="/etc/passwd")
        add(f"{LM1B}/{HELDOUT_DIR}/news.en.heldout-00050-of-00050", type=tarfile.LNKTYPE,
            linkname=f"{LM1B}/README")
        add(f"{LM1B}/{HELDOUT_DIR}/news.en-00000-of-00100", b"not one of the 50\n")
    return buffer.getvalue()


def _swap_lm1b(monkeypatch, data: bytes) -> None:
    """Makes lm1b's checksum table entry describe ``data`` (as tiny_ptb does for ptb)."""
    monkeypatch.setitem(corpora.KNOWN_ARCHIVES, "lm1b", corpora.KnownArchive(
        "lm1b", LM1B_NAME, hashlib.sha256(data).hexdigest(), len(data)))


@pytest.fixture
def tiny_lm1b(server, monkeypatch):
    """Makes "lm1b" a tiny archive that the server holds, with a matching checksum."""
    served, base_url, requests = server
    data = _tiny_lm1b_archive()
    (served / LM1B_NAME).write_bytes(data)
    _swap_lm1b(monkeypatch, data)
    return served, base_url, requests, data


def _tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def test_lm1b_downloads_verifies_and_unpacks_only_shards(tiny_lm1b, tmp_path, capsys):
    _, base_url, requests, _ = tiny_lm1b
    input_dir = tmp_path / "in"
    code, out, err = _run(capsys, "lm1b", "--base-url", base_url, "--input-dir", str(input_dir))
    assert (code, err) == (0, "")
    folder = input_dir / "lm1b"
    assert out == (f"lm1b: unpacked 149 shards into {folder}; the archive's checksum "
                   "matches\n")
    assert requests == [f"/{LM1B_NAME}"]
    # Only the shards, under input/lm1b/; the archive is gone; nothing escaped.
    assert _tree(input_dir) == [f"lm1b/{name}" for name in sorted(_shard_names())]
    assert not (tmp_path / "evil").exists() and not Path("/tmp/tfpar-evil").exists()
    assert not list(tmp_path.glob("evil*"))
    files = layouts.find_split_files(folder)
    assert [len(files[s]) for s in corpora.SPLITS] == [99, 1, 1]
    assert files["valid"][0].read_text() == "news.en.heldout-00001-of-00050 says hi .\n"
    assert files["test"][0].read_text() == "news.en.heldout-00000-of-00050 says hi .\n"


def test_lm1b_second_run_is_a_no_op(tiny_lm1b, tmp_path, capsys):
    _, base_url, requests, _ = tiny_lm1b
    args = ("lm1b", "--base-url", base_url, "--input-dir", str(tmp_path / "in"))
    assert _run(capsys, *args)[0] == 0
    requests.clear()
    code, out, err = _run(capsys, *args)
    assert (code, err, requests) == (0, "", [])
    assert out == (f"lm1b: every shard already present in {tmp_path / 'in' / 'lm1b'}; "
                   "nothing to do\n")


def test_lm1b_keep_archive_is_reused(tiny_lm1b, tmp_path, capsys):
    _, base_url, requests, data = tiny_lm1b
    input_dir = tmp_path / "in"
    args = ("lm1b", "--base-url", base_url, "--input-dir", str(input_dir), "--keep-archive")
    assert _run(capsys, *args)[0] == 0
    assert (input_dir / LM1B_NAME).read_bytes() == data
    shutil.rmtree(input_dir / "lm1b")
    requests.clear()
    code, out, _ = _run(capsys, *args)
    assert (code, requests) == (0, [])  # unpacked again from the verified archive
    assert out.startswith("lm1b: unpacked 149 shards")


def test_lm1b_checksum_mismatch_leaves_nothing(tiny_lm1b, tmp_path, capsys):
    served, base_url, _, _ = tiny_lm1b
    tampered = _tiny_lm1b_archive(drop=f"{TRAIN_DIR}/news.en-00042-of-00100")
    (served / LM1B_NAME).write_bytes(tampered)
    expected = corpora.KNOWN_ARCHIVES["lm1b"].sha256
    actual = hashlib.sha256(tampered).hexdigest()
    input_dir = tmp_path / "in"
    code, out, err = _run(capsys, "lm1b", "--base-url", base_url, "--input-dir", str(input_dir))
    assert (code, out) == (2, "")
    assert err == (f"error: {LM1B_NAME} from {base_url}{LM1B_NAME} has sha256 {actual} but "
                   f"expected {expected}; the server holds a different file, so nothing was "
                   "saved\n")
    assert list(input_dir.iterdir()) == []  # no archive, no .part, no lm1b/


class _RangeHandler(_Handler):
    """Also answers "Range: bytes=N-" with 206 and the rest of the file."""

    def do_GET(self):
        spec = self.headers.get("Range")
        self.requests.append((self.path, spec))
        if not spec:
            return http.server.SimpleHTTPRequestHandler.do_GET(self)
        data = Path(self.directory, self.path.lstrip("/")).read_bytes()
        start = int(spec.removeprefix("bytes=").rstrip("-"))
        if start >= len(data):
            self.send_error(416)
            return
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        self.wfile.write(data[start:])


class _CutHandler(_Handler):
    """Announces the whole file but sends only its first half, then hangs up."""

    def do_GET(self):
        self.requests.append(self.path)
        data = Path(self.directory, self.path.lstrip("/")).read_bytes()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data[: len(data) // 2])


def test_lm1b_cut_download_keeps_only_a_part_then_resumes(tmp_path, monkeypatch, capsys):
    served = tmp_path / "served"
    served.mkdir()
    data = _tiny_lm1b_archive()
    (served / LM1B_NAME).write_bytes(data)
    _swap_lm1b(monkeypatch, data)
    input_dir = tmp_path / "in"
    with _serving(served, _CutHandler) as (base_url, _):
        code, out, err = _run(capsys, "lm1b", "--base-url", base_url,
                              "--input-dir", str(input_dir))
    assert (code, out) == (2, "")
    assert err.startswith(f"error: download of {base_url}{LM1B_NAME} failed after ")
    assert err.endswith("; run the same command again to resume\n") and err.count("\n") == 1
    # Nothing under the archive's name or lm1b/: only the .part, which holds the first half.
    assert sorted(p.name for p in input_dir.iterdir()) == [f"{LM1B_NAME}.part"]
    assert (input_dir / f"{LM1B_NAME}.part").read_bytes() == data[: len(data) // 2]

    with _serving(served, _RangeHandler) as (base_url, requests):
        code, out, err = _run(capsys, "lm1b", "--base-url", base_url,
                              "--input-dir", str(input_dir))
    assert (code, err) == (0, "")
    assert requests == [(f"/{LM1B_NAME}", f"bytes={len(data) // 2}-")]
    assert _tree(input_dir) == [f"lm1b/{name}" for name in sorted(_shard_names())]


def test_lm1b_part_restarts_when_the_server_cannot_resume(tiny_lm1b, tmp_path, capsys):
    _, base_url, requests, _ = tiny_lm1b  # SimpleHTTPRequestHandler ignores Range
    input_dir = tmp_path / "in"
    input_dir.mkdir()
    (input_dir / f"{LM1B_NAME}.part").write_bytes(b"garbage from some other file")
    code, out, err = _run(capsys, "lm1b", "--base-url", base_url, "--input-dir", str(input_dir))
    assert (code, err) == (0, "")
    assert requests == [f"/{LM1B_NAME}", f"/{LM1B_NAME}"]  # the ranged ask, then from 0
    assert _tree(input_dir) == [f"lm1b/{name}" for name in sorted(_shard_names())]


def test_lm1b_complete_part_is_not_downloaded_again(tiny_lm1b, tmp_path, capsys):
    _, base_url, requests, data = tiny_lm1b
    (tmp_path / f"{LM1B_NAME}.part").write_bytes(data)
    code, out, _ = _run(capsys, "lm1b", "--base-url", base_url, "--input-dir", str(tmp_path))
    assert (code, requests) == (0, [])
    assert out.startswith("lm1b: unpacked 149 shards")


def test_lm1b_archive_without_every_shard_leaves_no_folder(server, tmp_path, monkeypatch,
                                                           capsys):
    served, base_url, _ = server
    data = _tiny_lm1b_archive(drop=f"{HELDOUT_DIR}/news.en.heldout-00001-of-00050")
    (served / LM1B_NAME).write_bytes(data)
    _swap_lm1b(monkeypatch, data)
    input_dir = tmp_path / "in"
    code, out, err = _run(capsys, "lm1b", "--base-url", base_url, "--input-dir", str(input_dir),
                          "--keep-archive")
    assert (code, out) == (2, "")
    assert err == (f"error: archive {input_dir / LM1B_NAME} is not the lm1b release: it has 49 "
                   "of the 50 held-out shards; delete it and run again to download it afresh\n")
    assert [p.name for p in input_dir.iterdir()] == [LM1B_NAME]  # no lm1b/, no temporary


def test_lm1b_incomplete_folder_is_never_overwritten(tiny_lm1b, tmp_path, capsys):
    _, base_url, requests, _ = tiny_lm1b
    folder = tmp_path / "lm1b"
    (folder / TRAIN_DIR).mkdir(parents=True)
    (folder / TRAIN_DIR / "news.en-00001-of-00100").write_text("mine\n")
    code, out, err = _run(capsys, "lm1b", "--base-url", base_url, "--input-dir", str(tmp_path))
    assert (code, out, requests) == (2, "", [])
    assert err == (f"error: {folder} exists but is not a complete lm1b: it has 1 of the 99 "
                   "train shards; move it away (it is never overwritten) and run again\n")
    assert (folder / TRAIN_DIR / "news.en-00001-of-00100").read_text() == "mine\n"


def test_archive_sources_cover_every_known_archive():
    assert set(download_data.ARCHIVE_SOURCES) == set(corpora.KNOWN_ARCHIVES)
    lm1b = corpora.KNOWN_ARCHIVES["lm1b"]
    assert download_data.ARCHIVE_SOURCES["lm1b"] + lm1b.filename == (
        "http://www.statmt.org/lm-benchmark/"
        "1-billion-word-language-modeling-benchmark-r13output.tar.gz")
    assert len(lm1b.sha256) == 64 and int(lm1b.sha256, 16) >= 0
