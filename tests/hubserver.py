"""A stand-in for the Hugging Face Hub's file API on 127.0.0.1, for tests (no network needed).

It answers what workflow/hub.py asks through huggingface_hub 1.33 (HfApi.model_info, then a
GET of each file's resolve URL), and hf_hub_download's HEAD, for repos served from local
directories, one commit each (its sha, and tag or branch names that resolve to it):

    GET  /api/models/<repo>/revision/<rev>[?blobs=true]   model info; siblings' blobId, size and
                                                          lfs.sha256 with blobs
    HEAD /<repo>/resolve/<rev>/<file>                     X-Repo-Commit, ETag (git blob id),
                                                          X-Linked-Etag and X-Linked-Size (LFS)
    GET  /<repo>/resolve/<rev>/<file>                     the bytes; Range: bytes=N- gives 206

and the hub's 404s: X-Error-Code RepoNotFound (401 without a token, as the hub answers),
RevisionNotFound, EntryNotFound. A repo may require a token (private) or be gated. An LFS file's
bytes are answered at its resolve URL, or, with `cdn` set, as the hub does: by a 302 to a
signed URL on another origin (a second port, /cdn/<repo>/<commit>/<file>, which asks no token).
Nothing is served through Xet (no X-Xet-Hash), so huggingface_hub takes its plain HTTP path.

Every request is recorded (method, path, Range, Authorization). A file can be made to misbehave
(Fault): the connection cut after N bytes of its body, its bytes throttled, one byte changed
(same size, wrong content), or a Range ignored (200 and the whole file). The server is small
and bounded: daemon threads, and it stops by itself after `deadline` seconds or `max_requests`
requests, whichever comes first.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
import socket
import threading
import time
from dataclasses import dataclass, replace
from functools import cache
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

LFS = ("*.safetensors", "*.bin")  # what a repo's .gitattributes sends to LFS
CHUNK = 64 << 10


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # unquoted, without the query
    range: str | None
    authorization: str | None

    @property
    def file(self) -> str | None:
        """The repo file a resolve request names."""
        m = re.fullmatch(r"/(?:[^/]+/[^/]+/resolve/[^/]+|cdn/[^/]+/[^/]+/[^/]+)/(.+)", self.path)
        return m and m.group(1)

    @property
    def cdn(self) -> bool:
        return self.path.startswith("/cdn/")


@dataclass
class Fault:
    cut_after: int | None = None  # close the connection after this many bytes of the body...
    times: int = 1  # ... in this many GETs, then serve it whole
    rate: float | None = None  # bytes a second
    corrupt: bool = False  # one byte changed: same size, wrong content
    ignore_range: bool = False  # a ranged GET answered 200 with the whole file, as some CDNs do


@dataclass
class Entry:
    path: Path
    size: int
    blob_id: str  # git's sha1 of the content (of the pointer file for an LFS file, as the hub has it)
    sha256: str | None  # LFS files only
    pointer: int | None  # the LFS pointer's size


@dataclass
class Repo:
    commit: str
    refs: tuple[str, ...]
    files: dict[str, Entry]
    token: str | None
    gated: bool


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@cache  # served files are read once: they must not change while served
def _entry(path: Path) -> Entry:
    data = path.read_bytes()
    if not any(fnmatch.fnmatch(path.name, p) for p in LFS):
        return Entry(path, len(data), _git_blob_id(data), None, None)
    sha = hashlib.sha256(data).hexdigest()
    pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\nsize {len(data)}\n".encode()
    return Entry(path, len(data), _git_blob_id(pointer), sha, len(pointer))


class HubServer:
    """Use as a context manager, or start() then stop()."""

    def __init__(self, deadline: float = 120.0, max_requests: int = 500):
        self.repos: dict[str, Repo] = {}
        self.faults: dict[str, Fault] = {}  # repo file name -> how it misbehaves
        self.requests: list[Request] = []
        self.max_requests = max_requests
        self.cdn = False  # LFS files redirected to the CDN's origin
        self.stopped = threading.Event()
        self._lock = threading.Lock()
        self._stop_lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._cdn = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))  # another port: another origin
        for httpd in (self._httpd, self._cdn):
            httpd.daemon_threads = True
            httpd.block_on_close = False  # a throttled response must not hold up stop()
        self._threads = [
            threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
            for httpd in (self._httpd, self._cdn)
        ]
        self._timer = threading.Timer(deadline, self.stop)
        self._timer.daemon = True

    @property
    def url(self) -> str:
        return _url(self._httpd)

    @property
    def cdn_url(self) -> str:
        return _url(self._cdn)

    def add_repo(self, repo_id: str, directory: Path, refs=("main",), token: str | None = None, gated: bool = False) -> str:
        """Serve every file under `directory` as `repo_id` at one commit; return its sha."""
        files = {str(p.relative_to(directory)): _entry(p) for p in sorted(directory.rglob("*")) if p.is_file()}
        commit = hashlib.sha1(json.dumps([repo_id] + [[k, e.blob_id] for k, e in files.items()]).encode()).hexdigest()
        self.repos[repo_id] = Repo(commit, tuple(refs), files, token, gated)
        return commit

    def start(self) -> HubServer:
        for thread in self._threads:
            thread.start()
        self._timer.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the port (then `stopped` is set); the deadline, the request cap
        and the fixture's teardown may all call it."""
        with self._stop_lock:
            if not self.stopped.is_set():
                self._timer.cancel()
                for httpd in (self._httpd, self._cdn):
                    httpd.shutdown()
                    httpd.server_close()
                self.stopped.set()

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def gets(self, file: str) -> list[Request]:
        """The GETs of one repo file's bytes, in order."""
        return [r for r in self.log() if r.method == "GET" and r.file == file]

    def log(self) -> list[Request]:
        with self._lock:
            return list(self.requests)

    def _record(self, request: Request) -> bool:
        """Record a request; False once the cap is passed (the server then stops)."""
        with self._lock:
            self.requests.append(request)
            within = len(self.requests) <= self.max_requests
        if not within:
            threading.Thread(target=self.stop, daemon=True).start()
        return within

    def _fault(self, file: str) -> Fault | None:
        """The file's fault for this GET (a cut counts down its times)."""
        with self._lock:
            fault = self.faults.get(file)
            if fault is None or fault.cut_after is None:
                return fault
            fault.times -= 1
            return fault if fault.times >= 0 else replace(fault, cut_after=None)


def _url(httpd: ThreadingHTTPServer) -> str:
    host, port = httpd.server_address[:2]
    return f"http://{host}:{port}"


class _Error(Exception):
    def __init__(self, status: int, code: str | None, message: str, commit: str | None = None):
        self.status, self.code, self.message, self.commit = status, code, message, commit


def _handler(hub: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # one request a connection: a cut connection is no pooled one

        def log_message(self, format, *args):  # quiet
            pass

        def do_HEAD(self):
            self._answer(body=False)

        def do_GET(self):
            self._answer(body=True)

        def _answer(self, body: bool) -> None:
            url = urlsplit(self.path)
            request = Request(self.command, unquote(url.path), self.headers.get("Range"), self.headers.get("Authorization"))
            if not hub._record(request):
                return self._send(503, {}, b"request cap reached: the test server stops\n", body)
            try:
                if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/([^/]+)", url.path):
                    repo = self._repo(m.group(1))
                    blobs = parse_qs(url.query).get("blobs", ["false"])[0].lower() == "true"
                    return self._json(_model_info(unquote(m.group(1)), repo, self._commit(repo, m.group(2)), blobs))
                if m := re.fullmatch(r"/cdn/([^/]+/[^/]+)/[^/]+/(.+)", url.path):  # a signed URL: no token asked
                    return self._file(hub.repos[unquote(m.group(1))], unquote(m.group(2)), body)
                if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", url.path):
                    repo = self._repo(m.group(1))
                    commit = self._commit(repo, m.group(2))
                    file = unquote(m.group(3))
                    if file not in repo.files:
                        raise _Error(404, "EntryNotFound", f'{file} does not exist on "{m.group(2)}"', commit)
                    if hub.cdn and repo.files[file].sha256:
                        cdn = f"{hub.cdn_url}/cdn/{unquote(m.group(1))}/{commit}/{m.group(3)}"
                        return self._send(302, {"Location": cdn, "X-Repo-Commit": commit}, b"", body)
                    return self._file(repo, file, body)
                raise _Error(404, None, "Not Found")
            except _Error as e:
                headers = {"X-Error-Message": e.message}
                if e.code:
                    headers["X-Error-Code"] = e.code
                if e.commit:
                    headers["X-Repo-Commit"] = e.commit
                self._send(e.status, headers, json.dumps({"error": e.message}).encode(), body)
            except (BrokenPipeError, ConnectionResetError):  # the client went away (a killed download)
                pass

        def _repo(self, repo_id: str) -> Repo:
            repo = hub.repos.get(unquote(repo_id))
            sent = self.headers.get("Authorization")
            if repo is None or (repo.token and not repo.gated and sent != f"Bearer {repo.token}"):
                status = 404 if sent else 401  # the hub answers 401 to an anonymous request
                raise _Error(status, "RepoNotFound", "Repository not found")
            if repo.gated and sent != f"Bearer {repo.token}":
                raise _Error(
                    403, "GatedRepo", "Access to this model is restricted: you must be authenticated and accept its conditions"
                )
            return repo

        def _commit(self, repo: Repo, rev: str) -> str:
            rev = unquote(rev)
            if rev != repo.commit and rev not in repo.refs:
                raise _Error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
            return repo.commit

        def _json(self, obj) -> None:
            self._send(200, {"Content-Type": "application/json"}, json.dumps(obj).encode(), True)

        def _head(self, status: int, headers: dict[str, str]) -> None:
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()

        def _send(self, status: int, headers: dict[str, str], data: bytes, body: bool) -> None:
            self._head(status, {"Content-Length": str(len(data)), **headers})
            if body:
                self.wfile.write(data)

        def _file(self, repo: Repo, file: str, body: bool) -> None:
            entry, start, status = repo.files[file], 0, 200
            fault = (hub._fault(file) if body else None) or Fault()
            headers = {"X-Repo-Commit": repo.commit, "ETag": f'"{entry.blob_id}"', "Content-Type": "application/octet-stream"}
            if entry.sha256:
                headers |= {"X-Linked-Etag": f'"{entry.sha256}"', "X-Linked-Size": str(entry.size)}
            if body and (r := self.headers.get("Range")) and not fault.ignore_range:
                m = re.fullmatch(r"bytes=(\d+)-", r)
                if not m or int(m.group(1)) >= entry.size:
                    raise _Error(416, None, f"unsatisfiable range {r}")
                start, status = int(m.group(1)), 206
                headers["Content-Range"] = f"bytes {start}-{entry.size - 1}/{entry.size}"
            self._head(status, {**headers, "Accept-Ranges": "bytes", "Content-Length": str(entry.size - start)})
            if body:
                self._stream(entry, start, fault)

        def _stream(self, entry: Entry, start: int, fault: Fault) -> None:
            with open(entry.path, "rb") as f:
                f.seek(pos := start)
                while (chunk := f.read(CHUNK)) and not hub.stopped.is_set():
                    if fault.corrupt and pos + len(chunk) == entry.size:  # the last byte, flipped
                        chunk = chunk[:-1] + bytes([chunk[-1] ^ 0xFF])
                    if fault.cut_after is not None and pos - start + len(chunk) >= fault.cut_after:
                        self.wfile.write(chunk[: fault.cut_after - (pos - start)])
                        self.wfile.flush()
                        self.connection.shutdown(socket.SHUT_RDWR)  # mid-body: the client sees the connection cut
                        return
                    self.wfile.write(chunk)
                    pos += len(chunk)
                    if fault.rate:
                        time.sleep(len(chunk) / fault.rate)

    return Handler


def _model_info(repo_id: str, repo: Repo, commit: str, blobs: bool) -> dict:
    siblings = []
    for name, e in repo.files.items():
        s: dict = {"rfilename": name}
        if blobs:
            s |= {"blobId": e.blob_id, "size": e.size}
            if e.sha256:
                s["lfs"] = {"sha256": e.sha256, "size": e.size, "pointerSize": e.pointer}
        siblings.append(s)
    return {
        "_id": commit[:24],
        "id": repo_id,
        "modelId": repo_id,
        "sha": commit,
        "private": repo.token is not None and not repo.gated,
        "gated": "auto" if repo.gated else False,
        "disabled": False,
        "tags": [],
        "siblings": siblings,
    }
