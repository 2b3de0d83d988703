"""A small real HTTP server speaking the Hugging Face hub routes that huggingface_hub 2.4's
`snapshot_download` uses, for download tests without the internet:

  GET  /api/models/{repo}/revision/{rev}   repo info (its `sha` is the commit)
  GET  /api/models/{repo}/tree/{rev}       recursive file listing (one page)
  HEAD /{repo}/resolve/{rev}/{file}        X-Repo-Commit, ETag, Content-Length
  GET  /{repo}/resolve/{rev}/{file}        the bytes; honours `Range: bytes=N-` (resume)

Gated repos answer 401 with `X-Error-Code: GatedRepo`, unknown ones 404 `RepoNotFound`,
exactly the signals huggingface_hub maps to GatedRepoError / RepositoryNotFoundError.
`drop_after` cuts a file's first GET after N bytes (the client must resume with Range).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

ROUTE = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/(?P<kind>revision|tree)/(?P<rev>[^/?]+)")
RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")


class HubServer:
    def __init__(self, repos: dict[str, dict[str, bytes]], *, gated: tuple[str, ...] = (),
                 chunk: int = 64 * 1024, delay_s: float = 0.0, drop_after: dict[str, int] | None = None):
        self.repos, self.gated = repos, set(gated)
        self.chunk, self.delay_s = chunk, delay_s
        self.drop_after = dict(drop_after or {})  # "repo/file" -> bytes sent before cutting, once
        self.log: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"

    @staticmethod
    def commit(repo: str) -> str:
        return hashlib.sha1(repo.encode()).hexdigest()

    def __enter__(self) -> "HubServer":
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # keep test output clean
                pass

            def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head=False):
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                if "Content-Length" not in (headers or {}):
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _repo_error(self, repo: str, head=False) -> bool:
                if repo in server.gated:
                    self._send(401, b'{"error": "gated"}', {"X-Error-Code": "GatedRepo",
                               "X-Error-Message": f"Access to model {repo} is restricted."}, head)
                    return True
                if repo not in server.repos:
                    self._send(404, b'{"error": "not found"}', {"X-Error-Code": "RepoNotFound",
                               "X-Error-Message": "Repository not found"}, head)
                    return True
                return False

            def do_GET(self):
                self._serve(head=False)

            def do_HEAD(self):
                self._serve(head=True)

            def _serve(self, head: bool):
                path = unquote(urlparse(self.path).path)
                server.log.append((self.command, path, self.headers.get("Range")))
                if m := ROUTE.match(path):
                    repo = m["repo"]
                    if self._repo_error(repo, head):
                        return
                    files = server.repos[repo]
                    if m["kind"] == "revision":
                        body = {"id": repo, "sha": server.commit(repo), "private": False,
                                "siblings": [{"rfilename": f} for f in files]}
                    else:
                        body = [{"type": "file", "path": f, "size": len(data),
                                 "oid": hashlib.sha1(data).hexdigest()} for f, data in files.items()]
                    self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"}, head)
                elif m := RESOLVE.match(path):
                    repo, name = m["repo"], m["file"]
                    if self._repo_error(repo, head):
                        return
                    if name not in server.repos[repo]:
                        self._send(404, b"", {"X-Error-Code": "EntryNotFound",
                                              "X-Repo-Commit": server.commit(repo)}, head)
                        return
                    self._file(repo, name, server.repos[repo][name], head)
                else:
                    self._send(404, b"no such route")

            def _file(self, repo: str, name: str, data: bytes, head: bool):
                start = 0
                if rng := re.match(r"bytes=(\d+)-", self.headers.get("Range") or ""):
                    start = int(rng[1])
                headers = {"X-Repo-Commit": server.commit(repo), "Accept-Ranges": "bytes",
                           "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                           "Content-Length": str(len(data) - start)}
                if start:
                    headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                self.send_response(206 if start else 200)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                if head:
                    return
                cut = server.drop_after.pop(f"{repo}/{name}", None)
                end = len(data) if cut is None else min(len(data), start + cut)
                for i in range(start, end, server.chunk):
                    self.wfile.write(data[i:min(i + server.chunk, end)])
                    self.wfile.flush()
                    time.sleep(server.delay_s)
                if cut is not None:
                    self.close_connection = True  # a dropped connection mid-file

        return Handler
