"""The hub download path, run as users run it (`python -m workflow.download --source hf:...`)
against a stand-in for the hub on 127.0.0.1 (tests/hubserver.py) that serves the tiny
checkpoint beside files that must never be fetched.

What huggingface_hub 1.33 does, and these tests pin down: a revision is resolved by
GET /api/models/<repo>/revision/<rev> (ours, with blobs=true for each file's sha256), the files
are listed by GET .../tree/<commit>, then each is HEAD then GET /<repo>/resolve/<commit>/<file>.
A connection cut mid-file is resumed in the same process (Range: bytes=N-, N the bytes received
in whole 10 MiB chunks); a killed process's partial file is never resumed: the next run gets
that file from byte 0. It checks sizes only, so we check each file against the hub's hash.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.error import HTTPError, URLError
from urllib.request import urlopen

import pytest
from conftest import ROOT
from hubserver import Fault, HubServer
from test_bad_input import SHARD1, SHARD2, printed
from test_interrupt import kill_when, leftovers

from workflow import download
from workflow.artifacts import MANIFEST, read_manifest
from workflow.download import INDEX

REPO, PRIVATE, GATED = "OpenMOSS-Team/MOSS-Speech", "OpenMOSS-Team/MOSS-Speech-private", "OpenMOSS-Team/MOSS-Speech-gated"
TOKEN = "hf_" + "test" * 8  # the token the private and gated repos want
FETCHED = {"config.json", "generation_config.json", INDEX, SHARD1, SHARD2}
NEVER = {  # a hub repo's other files: remote code, a pickle, docs, a subfolder's weights
    "modeling_moss_speech.py": b"raise SystemExit('remote code ran')\n",
    "configuration_moss_speech.py": b"raise SystemExit('remote code ran')\n",
    "pytorch_model.bin": b"\x80\x04not weights",
    "README.md": b"# MOSS-Speech\n",
    ".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n",
    "original/model.safetensors": b"not fetched",
}


@pytest.fixture(scope="module")
def served(tiny_hf, tmp_path_factory) -> Path:
    """The tiny checkpoint as a hub repo holds it, with the files that must not be fetched."""
    repo = tmp_path_factory.mktemp("repo")
    for p in tiny_hf.iterdir():
        if p.name != MANIFEST:
            os.link(p, repo / p.name)
    (repo / "generation_config.json").write_text('{"do_sample": false}\n')
    for name, data in NEVER.items():
        (repo / name).parent.mkdir(exist_ok=True)
        (repo / name).write_bytes(data)
    return repo


@pytest.fixture(scope="module")
def local_manifest(served, tmp_path_factory) -> dict:
    """The manifest of the same files downloaded from local:<dir>."""
    out = tmp_path_factory.mktemp("local") / "hf"
    download.main(["--source", f"local:{served}", "--out", str(out), "--no-finite-check"])
    return read_manifest(out)


@pytest.fixture
def hub(served, tmp_path, monkeypatch):
    """A fresh server (empty log, no faults), named by HF_ENDPOINT for the downloads this test
    starts; no HF_TOKEN, and huggingface_hub's own files (HF_HOME) under tmp_path."""
    with HubServer(deadline=120, max_requests=200) as hub:
        hub.add_repo(REPO, served, refs=("main", "v1.0"))
        hub.add_repo(PRIVATE, served, token=TOKEN)
        hub.add_repo(GATED, served, token=TOKEN, gated=True)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE"):
            monkeypatch.delenv(var, raising=False)
        yield hub


def args(source: str, out: Path) -> list[str]:
    return ["--source", source, "--out", str(out), "--cache-dir", str(out.parent / "hub-cache"), "--no-finite-check"]


def run(source: str, out: Path) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "workflow.download", *args(source, out)]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)


def downloaded(out: Path, source: str, commit: str, local_manifest: dict) -> None:
    """`out` holds the served checkpoint, as a local download gives it, and names the commit."""
    manifest = read_manifest(out)
    assert manifest.pop("source") == {"hub": source, "commit": commit}
    assert manifest == local_manifest
    assert leftovers(out) == []


def blobs(out: Path) -> Path:
    return out.parent / "hub-cache" / f"models--{REPO.replace('/', '--')}" / "blobs"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("rev", ["commit", "v1.0"])
def test_a_pinned_revision_downloads_only_the_checkpoint(rev, hub, served, local_manifest, tmp_path):
    commit = hub.repos[REPO].commit
    source = f"hf:{REPO}@{commit if rev == 'commit' else rev}"
    r = run(source, tmp_path / "hf")
    assert r.returncode == 0, r.stderr[-2000:]
    downloaded(tmp_path / "hf", source, commit, local_manifest)
    asked = {q.file for q in hub.log() if q.file}
    assert asked == FETCHED, f"fetched besides the checkpoint: {asked - FETCHED}"
    assert sorted(q.file for q in hub.log() if q.method == "GET" and q.file) == sorted(FETCHED)

    # Again into another output: the revision is asked again, the files come from the cache.
    before = len(hub.log())
    r = run(source, tmp_path / "again")
    assert r.returncode == 0, r.stderr[-2000:]
    downloaded(tmp_path / "again", source, commit, local_manifest)
    assert [q.path for q in hub.log()[before:] if REPO in q.path] == [f"/api/models/{REPO}/revision/{source.split('@')[1]}"]


@pytest.mark.parametrize(
    "source, problem",
    [
        (f"hf:{REPO}@v9.9", f"no revision 'v9.9' in {REPO}"),
        (f"hf:{REPO}@{'0' * 40}", f"no revision '{'0' * 40}' in {REPO}"),
        ("hf:OpenMOSS-Team/Nothing@v1.0", "no repository OpenMOSS-Team/Nothing at {url} (or HF_TOKEN may not read it)"),
        (f"hf:{PRIVATE}@main", f"no repository {PRIVATE} at {{url}} (or HF_TOKEN may not read it)"),
        (f"hf:{GATED}@main", f"{GATED} is gated: HF_TOKEN must be of an account granted access to it"),
    ],
    ids=["unknown_tag", "unknown_commit", "unknown_repository", "private_without_token", "gated_without_token"],
)
def test_an_unknown_repository_or_revision_is_one_line(source, problem, hub, tmp_path):
    out = tmp_path / "hf"
    r = run(source, out)
    assert (r.returncode, r.stderr) == (1, f"error: {source}: {problem.format(url=hub.url)}\n")
    assert not out.exists() and leftovers(out) == []


def test_an_unreachable_hub_is_an_error_not_the_cache(hub, tmp_path):
    """The tag is in the cache from the first run; with the hub gone, huggingface_hub alone would
    take the cache's word for what the tag means."""
    source = f"hf:{REPO}@v1.0"
    assert run(source, tmp_path / "hf").returncode == 0
    hub.stop()
    out = tmp_path / "again"
    r = run(source, out)
    refused = f"[Errno {errno.ECONNREFUSED}] {os.strerror(errno.ECONNREFUSED)}"
    assert (r.returncode, r.stderr) == (1, f"error: {source}: download failed (ConnectError: {refused})\n")
    assert not out.exists() and leftovers(out) == []


def test_a_connection_cut_mid_shard_is_resumed(hub, local_manifest, tmp_path):
    """huggingface_hub retries in the same process from the bytes it holds: whole 10 MiB chunks."""
    hub.faults[SHARD1] = Fault(cut_after=25 << 20)
    source = f"hf:{REPO}@v1.0"
    r = run(source, tmp_path / "hf")
    assert r.returncode == 0, r.stderr[-2000:]
    assert [q.range for q in hub.gets(SHARD1)] == [None, f"bytes={20 << 20}-"]
    downloaded(tmp_path / "hf", source, hub.repos[REPO].commit, local_manifest)


def test_a_download_killed_mid_shard_gets_that_shard_again(hub, served, local_manifest, tmp_path):
    """A killed run leaves its partial shard in the cache as `<sha256>.<random>.incomplete`, a name
    no other run reuses: the rerun downloads the shard from byte 0 (no Range), then clears it."""
    hub.faults[SHARD1] = Fault(rate=32 << 20)  # 2.5 s for the whole shard, 0.3 s for its first 10 MiB
    out, source = tmp_path / "hf", f"hf:{REPO}@v1.0"
    shard = blobs(out) / sha256((served / SHARD1).read_bytes())

    def partial() -> list[Path]:
        return [p for p in shard.parent.glob(f"{shard.name}.*.incomplete") if p.stat().st_size > 0]

    kill_when("workflow.download", args(source, out), out, lambda tmp: bool(partial()))
    assert not out.exists() and len(leftovers(out)) == 1
    (left,) = partial()
    assert 0 < left.stat().st_size < (served / SHARD1).stat().st_size, "not killed mid-shard"
    hub.faults.clear()
    r = run(source, out)
    assert r.returncode == 0, r.stderr[-2000:]
    assert [q.range for q in hub.gets(SHARD1)] == [None, None]
    assert list(blobs(out).glob("*.incomplete")) == []
    downloaded(out, source, hub.repos[REPO].commit, local_manifest)


def test_a_shard_with_wrong_bytes_is_refused_and_the_rerun_succeeds(hub, served, local_manifest, tmp_path):
    hub.faults[SHARD2] = Fault(corrupt=True)  # its last byte flipped: still a readable safetensors file
    out, source = tmp_path / "hf", f"hf:{REPO}@v1.0"
    good = (served / SHARD2).read_bytes()
    r = run(source, out)
    want, got = sha256(good), sha256(good[:-1] + bytes([good[-1] ^ 0xFF]))
    problem = f"sha256 {got[:12]} is not the hub's {want[:12]}: a corrupt download, removed from the cache"
    assert r.returncode == 1
    assert printed(r.stderr) == [f"error: {source}/{SHARD2}: {problem}"]
    assert not out.exists() and leftovers(out) == []
    assert not (blobs(out) / want).exists(), "the corrupt blob stays in the cache"
    hub.faults.clear()
    r = run(source, out)
    assert r.returncode == 0, r.stderr[-2000:]
    assert len(hub.gets(SHARD2)) == 2
    downloaded(out, source, hub.repos[REPO].commit, local_manifest)


def test_the_token_is_sent_never_written_nor_printed(hub, local_manifest, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    for repo in (PRIVATE, GATED):
        out = tmp_path / repo.split("/")[1] / "hf"
        source = f"hf:{repo}@main"
        r = run(source, out)
        assert r.returncode == 0, r.stderr[-2000:]
        downloaded(out, source, hub.repos[repo].commit, local_manifest)
        assert TOKEN not in r.stdout + r.stderr
    to_repos = [q for q in hub.log() if PRIVATE in q.path or GATED in q.path]
    assert len(to_repos) == 2 * (2 + 2 * len(FETCHED))  # per repo: revision, tree, then HEAD and GET a file
    assert {q.authorization for q in to_repos} == {f"Bearer {TOKEN}"}
    written = [p for p in tmp_path.rglob("*") if p.is_file() and not p.is_symlink()]
    assert len(written) > 20
    assert [p for p in written if TOKEN.encode() in p.read_bytes()] == []


def test_the_stand_in_stops_by_itself(served):
    """Bounded: past its request cap it answers 503 and stops; past its deadline it stops."""
    with HubServer(deadline=60, max_requests=1) as hub:
        hub.add_repo(REPO, served)
        info = f"{hub.url}/api/models/{REPO}/revision/main"
        assert json.load(urlopen(info, timeout=5))["sha"] == hub.repos[REPO].commit
        with pytest.raises(HTTPError) as e:
            urlopen(info, timeout=5)
        assert e.value.code == 503
        assert hub.stopped.wait(5)
    with HubServer(deadline=0.2) as hub:
        assert hub.stopped.wait(5)
        with pytest.raises(URLError):
            urlopen(f"{hub.url}/api/models/{REPO}/revision/main", timeout=5)
