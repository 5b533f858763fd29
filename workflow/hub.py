"""hub: a repository's files at a pinned revision, downloaded resumably into our own cache and
each checked against the hub's hash.

Not huggingface_hub's snapshot_download: it writes each download to a fresh
`<etag>.<uuid>.incomplete`, so a killed run starts every file over, and within a run it resumes
a cut connection from whole 10 MiB chunks only; MOSS-Speech's shards are ~5 GB each. Here a
file is fetched by GET of its resolve URL into `<cache>/<owner>--<name>/<commit>/<file>.partial`,
resumed with `Range: bytes=<its size>-` where that file ends (after a cut connection in the same
run, after a kill in the next), then hashed and renamed into place: the snapshot directory holds
only checked files. huggingface_hub does the rest: the revision (asked of the hub, never taken
from a cache), URLs, headers with the token (it reads HF_TOKEN; we never see it), the HTTP
client and the hub's error codes.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from operator import attrgetter
from pathlib import Path

import httpx
from huggingface_hub import HfApi, constants, hf_hub_url
from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError
from huggingface_hub.hf_api import RepoSibling
from huggingface_hub.utils import build_hf_headers, filter_repo_objects, get_session, hf_raise_for_status
from huggingface_hub.utils.sha import git_hash
from tqdm import tqdm

from workflow import artifacts
from workflow.errors import InputError

RETRIES, RETRY_WAIT = 5, 1.0  # a connection cut mid-file: tried again, 1 s apart, each from where the file ends
PARTIAL = ".partial"


def fetch(repo: str, revision: str, cache_dir: Path, allow: list[str], ignore: list[str]) -> tuple[Path, dict[str, str]]:
    """Bring the repo's allowed files at `revision` into the cache; return the snapshot directory
    (named by the commit the revision resolves to) and each file's sha256."""
    name = f"hf:{repo}@{revision}"
    info = _model_info(repo, revision, name)
    by_name = attrgetter("rfilename")
    files = sorted(filter_repo_objects(info.siblings, key=by_name, allow_patterns=allow, ignore_patterns=ignore), key=by_name)
    snapshot = Path(cache_dir) / repo.replace("/", "--") / info.sha
    snapshot.mkdir(parents=True, exist_ok=True)
    with _locked(snapshot.with_name(f"{info.sha}.lock")):
        return snapshot, {f.rfilename: _fetch_file(repo, info.sha, f, snapshot, f"{name}/{f.rfilename}") for f in files}


def _model_info(repo: str, revision: str, name: str):
    """The hub's word on the revision: its commit and every file's size and hash."""
    try:
        return HfApi().model_info(repo, revision=revision, files_metadata=True)
    except GatedRepoError:
        raise InputError(name, f"{repo} is gated: HF_TOKEN must be of an account granted access to it") from None
    except RepositoryNotFoundError:
        raise InputError(name, f"no repository {repo} at {constants.ENDPOINT} (or HF_TOKEN may not read it)") from None
    except RevisionNotFoundError:
        raise InputError(name, f"no revision '{revision}' in {repo}") from None
    except (OSError, httpx.HTTPError) as e:  # unreachable
        raise InputError(name, f"download failed ({_first_line(e)})") from None


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"


@contextmanager
def _locked(lock: Path) -> Iterator[None]:
    """One download into a snapshot at a time (two would append to the same partial files); the
    lock goes with its process, killed or not."""
    with open(lock, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another download into {lock.with_suffix('')}", file=sys.stderr)
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _fetch_file(repo: str, commit: str, sibling: RepoSibling, snapshot: Path, name: str) -> str:
    """The file's sha256 once `snapshot` holds it checked: already there, or downloaded."""
    if sibling.size is None or (sibling.lfs is None and sibling.blob_id is None):
        raise InputError(name, "the hub gives no size or hash for it: the download cannot be checked")
    path = snapshot / sibling.rfilename
    path.parent.mkdir(parents=True, exist_ok=True)  # a file in a folder of the repo (the codec's flow/)
    if path.exists():
        try:
            return _checked(path, sibling, name)
        except InputError:
            path.unlink()  # changed since it was checked (written through a hard link to it?): fetched again
    part = path.with_name(path.name + PARTIAL)
    try:
        _download(hf_hub_url(repo, sibling.rfilename, revision=commit), part, sibling.size)
    except (OSError, httpx.HTTPError) as e:  # the partial file stays: the next run resumes it
        raise InputError(name, f"download failed ({_first_line(e)})") from None
    try:
        sha256 = _checked(part, sibling, name)
    except InputError as e:
        part.unlink()
        raise InputError(name, f"{e.problem}: a corrupt download, deleted (the next run fetches it afresh)") from None
    os.replace(part, path)
    return sha256


def _checked(path: Path, sibling: RepoSibling, name: str) -> str:
    """The file's sha256 if it is the hub's (its sha256 for an LFS file, else its git blob id)."""
    if sibling.lfs is not None:
        kind, want = "sha256", sibling.lfs.sha256
        got = sha256 = artifacts.sha256_file(path, progress=True)
    else:
        data = path.read_bytes()  # not in LFS: a small file
        kind, want, got, sha256 = "git blob id", sibling.blob_id, git_hash(data), hashlib.sha256(data).hexdigest()
    if got != want:
        raise InputError(name, f"{kind} {got[:12]} is not the hub's {want[:12]}")
    return sha256


def _download(url: str, part: Path, size: int) -> None:
    """Bring `part` to `size` bytes; after a cut connection, try again from where it ends."""
    for tries_left in reversed(range(RETRIES + 1)):
        if (have := _bytes(part)) == size:
            return
        try:
            _get(url, part, have if have < size else 0, size)  # longer than the file: not a prefix of it
        except httpx.TransportError as e:
            if not tries_left:
                raise
            print(f"{part.name}: {_first_line(e)}; resuming in {RETRY_WAIT:g} s", file=sys.stderr)
            time.sleep(RETRY_WAIT)
    if (have := _bytes(part)) != size:
        raise OSError(f"{have} of {size} bytes after {RETRIES + 1} tries")


def _bytes(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _get(url: str, part: Path, have: int, size: int) -> None:
    """One GET of the bytes after the first `have`: a 206 appends them to `part`, a 200 (the server
    ignored the Range) rewrites it from byte 0, a 416 deletes it for the next try."""
    headers = build_hf_headers()  # with HF_TOKEN's token, which httpx drops on a redirect to another origin (the CDN)
    headers["Accept-Encoding"] = "identity"  # the file's own bytes, which a Range counts (not gzip's)
    if have:
        headers["Range"] = f"bytes={have}-"
    with get_session().stream("GET", url, headers=headers, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as r:
        if r.status_code == 416:
            part.unlink()
            return
        hf_raise_for_status(r)
        start = have if r.status_code == 206 else 0
        bar = tqdm(total=size, initial=start, unit="B", unit_scale=True, unit_divisor=1024, desc=part.name.removesuffix(PARTIAL))
        with bar, open(part, "ab" if start else "wb") as f:
            for chunk in r.iter_bytes():  # as received, so that a cut loses none of them
                f.write(chunk)
                bar.update(len(chunk))
