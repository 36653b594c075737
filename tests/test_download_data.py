"""Tests for scripts/download_data.py against a real HTTP server on 127.0.0.1."""

import functools
import hashlib
import http.server
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tfpar.data import corpora

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get(
    "TFPAR_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))


def _load_script():
    spec = importlib.util.spec_from_file_location(
        "download_data", REPO / "scripts" / "download_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


download_data = _load_script()


class _Handler(http.server.SimpleHTTPRequestHandler):
    """Serves a folder quietly and records the paths asked for."""

    requests: list[str]

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass

    def do_GET(self):
        self.requests.append(self.path)
        super().do_GET()


@pytest.fixture
def server(tmp_path):
    """Serves tmp_path/served over HTTP; yields (folder, base_url, requested paths)."""
    served = tmp_path / "served"
    served.mkdir()
    requests: list[str] = []
    handler = type("Handler", (_Handler,), {"requests": requests})
    httpd = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(handler, directory=str(served)))
    # A short poll interval: shutdown() waits up to one interval, 0.5 s by default.
    thread = threading.Thread(target=httpd.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    yield served, f"http://127.0.0.1:{httpd.server_address[1]}/", requests
    httpd.shutdown()
    httpd.server_close()
    thread.join()


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
    assert corpus.train == ["the cat sat", "the dog ran"]


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
    for flag in ("--input-dir", "--base-url", "--timeout", "{ptb,wikitext-2,wikitext2}"):
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
