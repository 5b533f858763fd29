"""The hub download path, run as users run it (`python -m workflow.download --source hf:...`)
against a stand-in for the hub on 127.0.0.1 (tests/hubserver.py) that serves the tiny
checkpoint beside files that must never be fetched.

What workflow/hub.py does, and these tests pin down: a revision is resolved by
GET /api/models/<repo>/revision/<rev>?blobs=true (each file's size and hash), then each file
missing from the cache is one GET /<repo>/resolve/<commit>/<file> into `<file>.partial`, which
a cut connection (in the run) or a kill (in the next run) resumes with Range: bytes=N-, N the
bytes the partial holds, to the byte. A file is hashed before it is renamed into the cache.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
import time
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
from workflow.hfckpt import INDEX
from workflow.hub import PARTIAL, RETRIES

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


def start(source: str, out: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "workflow.download", *args(source, out)]
    return subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run(source: str, out: Path) -> subprocess.CompletedProcess:
    proc = start(source, out)
    stdout, stderr = proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def snapshot(out: Path, commit: str, repo: str = REPO) -> Path:
    """Where the cache holds the repo's checked files at that commit."""
    return out.parent / "hub-cache" / repo.replace("/", "--") / commit


def downloaded(out: Path, source: str, commit: str, local_manifest: dict) -> None:
    """`out` holds the served checkpoint, as a local download gives it, and names the commit;
    the cache holds those files and nothing else (no partial file)."""
    manifest = read_manifest(out)
    assert manifest.pop("source") == {"hub": source, "commit": commit}
    assert manifest == local_manifest
    assert leftovers(out) == []
    assert {p.name for p in snapshot(out, commit, source[3:].split("@")[0]).iterdir()} == FETCHED


def partial(out: Path, commit: str, file: str) -> Path:
    return snapshot(out, commit) / (file + PARTIAL)


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

    # Again into another output: the revision is asked again, the files come from the cache
    # (hashed again, not fetched) but one changed since, as an edit through a hard link would.
    cached = snapshot(tmp_path / "hf", commit) / "config.json"
    cached.write_text(cached.read_text() + " ")
    before = len(hub.log())
    r = run(source, tmp_path / "again")
    assert r.returncode == 0, r.stderr[-2000:]
    downloaded(tmp_path / "again", source, commit, local_manifest)
    asked = [q.path for q in hub.log()[before:] if REPO in q.path]
    assert asked == [f"/api/models/{REPO}/revision/{source.split('@')[1]}", f"/{REPO}/resolve/{commit}/config.json"]


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
    """The tag's commit is in the cache from the first run; with the hub gone, it is not taken
    for what the tag means now."""
    source = f"hf:{REPO}@v1.0"
    assert run(source, tmp_path / "hf").returncode == 0
    hub.stop()
    out = tmp_path / "again"
    r = run(source, out)
    refused = f"[Errno {errno.ECONNREFUSED}] {os.strerror(errno.ECONNREFUSED)}"
    assert (r.returncode, r.stderr) == (1, f"error: {source}: download failed (ConnectError: {refused})\n")
    assert not out.exists() and leftovers(out) == []


@pytest.mark.parametrize("cdn", [False, True], ids=["from_the_hub", "redirected_to_a_cdn"])
def test_a_connection_cut_mid_shard_is_resumed_where_it_was_cut(cdn, hub, local_manifest, tmp_path):
    """Twice: each retry asks for the bytes after those the partial file holds, to the byte (the
    same Range reaches the CDN through the hub's redirect)."""
    cut = (25 << 20) + 12345
    hub.cdn, hub.faults[SHARD1] = cdn, Fault(cut_after=cut, times=2)
    source = f"hf:{REPO}@v1.0"
    r = run(source, tmp_path / "hf")
    assert r.returncode == 0, r.stderr[-2000:]
    assert [q.range for q in hub.gets(SHARD1) if q.cdn == cdn] == [None, f"bytes={cut}-", f"bytes={2 * cut}-"]
    downloaded(tmp_path / "hf", source, hub.repos[REPO].commit, local_manifest)


def test_a_connection_that_keeps_failing_is_one_line_and_the_rerun_resumes(hub, local_manifest, tmp_path):
    """Cut in every try: after the retries, one line naming the file, and the partial file stays
    for the rerun, which asks only for the bytes after it."""
    cut = (5 << 20) + 1
    hub.faults[SHARD1] = Fault(cut_after=cut, times=1 + RETRIES)
    out, source, commit = tmp_path / "hf", f"hf:{REPO}@v1.0", hub.repos[REPO].commit
    r = run(source, out)
    assert r.returncode == 1
    *retries, error = printed(r.stderr)
    said = f"{SHARD1}{PARTIAL}: RemoteProtocolError: "
    assert len(retries) == RETRIES and all(x.startswith(said) and x.endswith("; resuming in 1 s") for x in retries), retries
    assert error.startswith(f"error: {source}/{SHARD1}: download failed (RemoteProtocolError: peer closed connection"), error
    assert not out.exists() and leftovers(out) == []
    assert partial(out, commit, SHARD1).stat().st_size == (1 + RETRIES) * cut
    r = run(source, out)
    assert r.returncode == 0, r.stderr[-2000:]
    assert [q.range for q in hub.gets(SHARD1)] == [None] + [f"bytes={i * cut}-" for i in range(1, 2 + RETRIES)]
    downloaded(out, source, commit, local_manifest)


def test_a_download_killed_mid_shard_is_resumed_by_the_rerun(hub, served, local_manifest, tmp_path):
    """The killed run's partial shard stays in the cache; the rerun asks only for the bytes after
    it, and gives an uninterrupted download's manifest."""
    hub.faults[SHARD1] = Fault(rate=32 << 20)  # 2.5 s for the whole shard
    out, source, commit = tmp_path / "hf", f"hf:{REPO}@v1.0", hub.repos[REPO].commit
    shard = partial(out, commit, SHARD1)
    kill_when("workflow.download", args(source, out), out, lambda tmp: shard.exists() and shard.stat().st_size > 1 << 20)
    assert not out.exists() and len(leftovers(out)) == 1
    written, size = shard.stat().st_size, (served / SHARD1).stat().st_size
    assert 0 < written < size, "not killed mid-shard"
    hub.faults.clear()
    r = run(source, out)
    assert r.returncode == 0, r.stderr[-2000:]
    assert [q.range for q in hub.gets(SHARD1)] == [None, f"bytes={written}-"]
    downloaded(out, source, commit, local_manifest)


def test_a_shard_with_wrong_bytes_is_refused_and_the_rerun_succeeds(hub, served, local_manifest, tmp_path):
    hub.faults[SHARD2] = Fault(corrupt=True)  # its last byte flipped: still a readable safetensors file
    out, source, commit = tmp_path / "hf", f"hf:{REPO}@v1.0", hub.repos[REPO].commit
    good = (served / SHARD2).read_bytes()
    r = run(source, out)
    want, got = sha256(good), sha256(good[:-1] + bytes([good[-1] ^ 0xFF]))
    problem = f"sha256 {got[:12]} is not the hub's {want[:12]}: a corrupt download, deleted (the next run fetches it afresh)"
    assert r.returncode == 1
    assert printed(r.stderr) == [f"error: {source}/{SHARD2}: {problem}"]
    assert not out.exists() and leftovers(out) == []
    assert not (snapshot(out, commit) / SHARD2).exists() and not partial(out, commit, SHARD2).exists()
    hub.faults.clear()
    r = run(source, out)
    assert r.returncode == 0, r.stderr[-2000:]
    assert [q.range for q in hub.gets(SHARD2)] == [None, None]
    downloaded(out, source, commit, local_manifest)


def test_a_server_that_ignores_the_range_still_gives_the_right_file(hub, local_manifest, tmp_path):
    """The resumed GET is answered 200 with the whole file: the partial is written afresh."""
    cut = (25 << 20) + 12345
    hub.faults[SHARD1] = Fault(cut_after=cut, ignore_range=True)
    source = f"hf:{REPO}@v1.0"
    r = run(source, tmp_path / "hf")
    assert r.returncode == 0, r.stderr[-2000:]
    assert [q.range for q in hub.gets(SHARD1)] == [None, f"bytes={cut}-"]
    downloaded(tmp_path / "hf", source, hub.repos[REPO].commit, local_manifest)


def test_a_partial_file_longer_than_the_file_starts_over(hub, served, local_manifest, tmp_path):
    out, source, commit = tmp_path / "hf", f"hf:{REPO}@v1.0", hub.repos[REPO].commit
    shard = partial(out, commit, SHARD2)
    shard.parent.mkdir(parents=True)
    shard.write_bytes((served / SHARD2).read_bytes() + b"more")
    r = run(source, out)
    assert r.returncode == 0, r.stderr[-2000:]
    assert [q.range for q in hub.gets(SHARD2)] == [None]
    downloaded(out, source, commit, local_manifest)


def test_two_downloads_into_one_cache_fetch_each_file_once(hub, local_manifest, tmp_path):
    """The second waits for the first's lock (they would append to the same partial files),
    then finds every file in the cache."""
    hub.faults[SHARD1] = Fault(rate=1 << 20)  # the first holds the lock until the second waits for it
    source, commit = f"hf:{REPO}@v1.0", hub.repos[REPO].commit
    asked = f"/api/models/{REPO}/revision/v1.0"
    first = start(source, tmp_path / "hf")
    shard = partial(tmp_path / "hf", commit, SHARD1)
    while not shard.exists() and first.poll() is None:
        time.sleep(0.01)
    second = start(source, tmp_path / "again")
    while [q.path for q in hub.log()].count(asked) < 2 and second.poll() is None:
        time.sleep(0.01)
    time.sleep(0.5)  # from the hub's answer to the lock: no request, a few lines of Python
    hub.faults[SHARD1].rate = None
    (_, first_err), (_, second_err) = first.communicate(), second.communicate()
    assert (first.returncode, second.returncode) == (0, 0), (first_err + second_err)[-2000:]
    assert f"waiting for another download into {snapshot(tmp_path / 'hf', commit)}" in second_err
    assert sorted(q.file for q in hub.log() if q.method == "GET" and q.file) == sorted(FETCHED)
    for out in (tmp_path / "hf", tmp_path / "again"):
        downloaded(out, source, commit, local_manifest)


def test_the_token_is_sent_never_written_nor_printed(hub, local_manifest, tmp_path, monkeypatch):
    """Sent to the hub, not to the CDN it redirects the shards to (httpx drops it: another origin)."""
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    hub.cdn = True
    for repo in (PRIVATE, GATED):
        out = tmp_path / repo.split("/")[1] / "hf"
        source = f"hf:{repo}@main"
        r = run(source, out)
        assert r.returncode == 0, r.stderr[-2000:]
        downloaded(out, source, hub.repos[repo].commit, local_manifest)
        assert TOKEN not in r.stdout + r.stderr
    to_repos = [q for q in hub.log() if PRIVATE in q.path or GATED in q.path]
    assert len(to_repos) == 2 * (1 + len(FETCHED) + 2)  # per repo: revision, a GET a file, the 2 shards' at the CDN
    assert {q.authorization for q in to_repos if not q.cdn} == {f"Bearer {TOKEN}"}
    assert {q.authorization for q in to_repos if q.cdn} == {None}
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
