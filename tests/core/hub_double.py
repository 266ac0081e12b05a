"""A stand-in for the Hugging Face Hub's file API: a real HTTP server in a thread, on 127.0.0.1.

It answers what huggingface_hub asks of a model repo (read from its source: hf_api.model_info and
file_download.get_hf_file_metadata / http_get): model info with siblings and the resolved commit sha, and
HEAD/GET on /<repo>/resolve/<revision>/<file> with X-Repo-Commit, ETag and Content-Length, with Range for
resumes. Every request is recorded, and a file's download can be cut midway to play a dropped connection,
or held midway to watch a pull's progress.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]]  # commit sha -> file name -> content
    refs: dict[str, str]  # branch or tag -> commit sha


@dataclass
class HubDouble:
    repos: dict[str, Repo] = field(default_factory=dict)
    requests: list[tuple[str, str]] = field(default_factory=list)  # (method, path)
    authorizations: list[str | None] = field(default_factory=list)  # each request's Authorization header
    ranges: list[str | None] = field(default_factory=list)  # each request's Range header
    # A GET of this file sends half of it and hangs up; later requests for it get 503 until it is cleared.
    break_file: str | None = None
    _broken: bool = False
    # A GET of this file sends half of it, then waits for `resume` (at most 60 s) before the rest.
    stall_file: str | None = None
    resume: threading.Event = field(default_factory=threading.Event)
    # A hostile mirror: model info answers this as the commit sha (whatever the revision resolves to), and
    # a GET of a file named in `padded` sends that many bytes more than the listing says it has.
    claimed_sha: str | None = None
    padded: dict[str, int] = field(default_factory=dict)
    url: str = ""

    def add(self, repo_id: str, files: dict[str, bytes], ref: str = "main") -> str:
        """Commit `files` to `repo_id` under `ref`; returns the commit sha."""
        digest = hashlib.sha1(f"{repo_id}@{ref}".encode())
        for name in sorted(files):
            digest.update(name.encode() + hashlib.sha256(files[name]).digest())
        sha = digest.hexdigest()
        repo = self.repos.setdefault(repo_id, Repo({}, {}))
        repo.commits[sha] = files
        repo.refs[ref] = sha
        return sha

    def requested(self, pattern: str) -> list[tuple[str, str]]:
        return [r for r in self.requests if re.search(pattern, r[1])]

    def resolve(self, repo_id: str, revision: str) -> str | None:
        repo = self.repos.get(repo_id)
        if repo is None:
            return None
        return revision if revision in repo.commits else repo.refs.get(revision)


_INFO = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+))?$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")


def _handler(hub: HubDouble) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:  # quiet
            pass

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_GET(self) -> None:
            self._serve(body=True)

        def _serve(self, body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.requests.append((self.command, path))
            hub.authorizations.append(self.headers.get("Authorization"))
            hub.ranges.append(self.headers.get("Range"))
            if m := _INFO.match(path):
                return self._info(m["repo"], m["rev"] or "main")
            if m := _RESOLVE.match(path):
                return self._file(m["repo"], m["rev"], m["file"], body)
            self._error(404, "EntryNotFound")

        def _info(self, repo_id: str, revision: str) -> None:
            if repo_id not in hub.repos:
                return self._error(404, "RepoNotFound")
            sha = hub.resolve(repo_id, revision)
            if sha is None:
                return self._error(404, "RevisionNotFound")
            files = hub.repos[repo_id].commits[sha]
            siblings = [{"rfilename": name, "size": len(data)} for name, data in sorted(files.items())]
            claimed = sha if hub.claimed_sha is None else hub.claimed_sha
            payload = json.dumps({"id": repo_id, "modelId": repo_id, "sha": claimed, "siblings": siblings})
            self._send(200, payload.encode(), {"Content-Type": "application/json"})

        def _file(self, repo_id: str, revision: str, name: str, body: bool) -> None:
            sha = hub.resolve(repo_id, revision)
            if sha is None:
                return self._error(404, "RepoNotFound" if repo_id not in hub.repos else "RevisionNotFound")
            data = hub.repos[repo_id].commits[sha].get(name)
            if data is None:
                return self._error(404, "EntryNotFound", {"X-Repo-Commit": sha})
            if hub._broken and name == hub.break_file:
                return self._error(503, "")
            headers = {"X-Repo-Commit": sha, "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}
            start = 0
            if body and (r := re.match(r"bytes=(\d+)-$", self.headers.get("Range", ""))):
                start = int(r[1])
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            if not body:
                return self._send(200, b"", {**headers, "Content-Length": str(len(data))}, head=True)
            if name == hub.stall_file and not start:
                self.send_response(200)
                for k, v in {**headers, "Content-Length": str(len(data))}.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                hub.resume.wait(60)
                self.wfile.write(data[len(data) // 2 :])
                return
            if name in hub.padded:
                return self._send_padded(headers, data, hub.padded[name])
            if name == hub.break_file and not hub._broken:
                hub._broken = True
                self.send_response(200)
                for k, v in {**headers, "Content-Length": str(len(data))}.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                self.close_connection = True
                return
            self._send(206 if start else 200, data[start:], headers)

        def _send_padded(self, headers: dict[str, str], data: bytes, extra: int) -> None:
            """The file, then `extra` bytes more, in 64 KiB pieces until the client hangs up."""
            self.send_response(200)
            for k, v in {**headers, "Content-Length": str(len(data) + extra)}.items():
                self.send_header(k, v)
            self.end_headers()
            self.close_connection = True
            try:
                self.wfile.write(data)
                for i in range(0, extra, 65536):
                    self.wfile.write(b" " * min(65536, extra - i))
            except (BrokenPipeError, ConnectionResetError):
                pass

        def _error(self, status: int, code: str, extra: dict[str, str] | None = None) -> None:
            headers = {"X-Error-Code": code, "Content-Type": "application/json", **(extra or {})}
            self._send(status, json.dumps({"error": code or "unavailable"}).encode(), headers)

        def _send(self, status: int, payload: bytes, headers: dict[str, str], head: bool = False) -> None:
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            if not head:
                self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if not head:
                self.wfile.write(payload)

    return Handler


@contextmanager
def serve(hub: HubDouble) -> Iterator[HubDouble]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()


def heal(hub: HubDouble) -> None:
    """The network is back: the broken file is served whole again."""
    hub.break_file, hub._broken = None, False
