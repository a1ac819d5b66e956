"""A local stand-in for the Hub's dataset endpoints (the network boundary): what ``datasets.load_dataset`` asks for
a Hub id at a revision (repo info, tree listing, paths-info, file downloads), and what preflight asks of model and
dataset repos (repo info, auth-check). ``repos``: dataset repo id -> {revision name -> (commit sha, {path: bytes})};
``models``: the same for model repos; ``gated``: repo id -> the tokens granted access to it; ``invalid_tokens``: refused
with 401 on every request. Every request is
recorded in ``requests``, with its Authorization header in ``authorizations``.

Errors are answered as the Hub does: an unknown repo (or one this token cannot see) 401 with ``X-Error-Code:
RepoNotFound``, an unknown revision 404 ``RevisionNotFound``, a gated repo's auth-check 403 ``GatedRepo``."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse


class DatasetHub:
    def __init__(self, repos, models=None, gated=None, invalid_tokens=()):
        self.repos, self.models, self.gated, self.invalid_tokens = repos, models or {}, gated or {}, set(invalid_tokens)
        self.requests, self.authorizations = [], []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.hub = self
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
    def __enter__(self): self.thread.start(); return self
    def __exit__(self, *a): self.server.shutdown(); self.server.server_close()
    def lookup(self, repo, rev, kind="datasets"):
        revs = (self.repos if kind == "datasets" else self.models).get(repo, {})
        for name, (sha, files) in revs.items():
            if rev in (name, sha): return sha, files
        return None, None
    def known(self, repo, kind="datasets"):
        return repo in (self.repos if kind == "datasets" else self.models)

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def _send(self, status, body=b"", headers=None, head=False):
        self.send_response(status)
        for k, v in (headers or {}).items(): self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head: self.wfile.write(body)
    def _json(self, status, payload, head=False, headers=None):
        self._send(status, json.dumps(payload).encode(), {"Content-Type": "application/json", **(headers or {})}, head)
    def _not_found(self, head=False):  # the Hub's answer for a repo that does not exist, or that this token cannot see
        return self._json(401, {"error": "Repository not found"}, head, {"X-Error-Code": "RepoNotFound"})
    def handle_any(self, head=False):
        hub = self.server.hub
        path = unquote(urlparse(self.path).path)
        hub.requests.append((self.command, self.path))
        hub.authorizations.append(self.headers.get("Authorization"))
        if (self.headers.get("Authorization") or "").removeprefix("Bearer ") in hub.invalid_tokens:
            return self._json(401, {"error": "Invalid credentials in Authorization header"}, head,
                              {"X-Error-Message": "Invalid credentials in Authorization header"})
        if m := re.fullmatch(r"/api/(models|datasets)/([^/]+(?:/[^/]+)?)/auth-check", path):
            if not hub.known(m.group(2), m.group(1)): return self._not_found(head)
            token = (self.headers.get("Authorization") or "").removeprefix("Bearer ")
            if m.group(2) in hub.gated and token not in hub.gated[m.group(2)]:
                return self._json(403, {"error": "gated"}, head, {"X-Error-Code": "GatedRepo"})
            return self._json(200, {}, head)
        if m := re.fullmatch(r"/api/models/([^/]+(?:/[^/]+)?)(?:/revision/([^/]+))?", path):
            if not hub.known(m.group(1), "models"): return self._not_found(head)
            sha, files = hub.lookup(m.group(1), m.group(2) or "main", "models")
            if sha is None: return self._json(404, {"error": "Revision not found"}, head, {"X-Error-Code": "RevisionNotFound"})
            return self._json(200, {"id": m.group(1), "modelId": m.group(1), "sha": sha, "private": False,
                                    "gated": "manual" if m.group(1) in hub.gated else False,
                                    "siblings": [{"rfilename": f} for f in files], "tags": []}, head)
        if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):  # a model's file
            if not hub.known(m.group(1), "models"): return self._not_found(head)
            sha, files = hub.lookup(m.group(1), m.group(2), "models")
            if sha is None or m.group(3) not in files:
                return self._send(404, b"", {"X-Error-Code": "RevisionNotFound" if sha is None else "EntryNotFound"}, head)
            body = files[m.group(3)]
            return self._send(200, body, {"ETag": '"' + hashlib.sha1(body).hexdigest() + '"', "X-Repo-Commit": sha}, head)
        if m := re.fullmatch(r"/datasets/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
            sha, files = hub.lookup(m.group(1), m.group(2))
            if sha is None: return self._json(404, {"error": "Repository not found"}, head)
            if m.group(3) not in files:
                return self._send(404, b"", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": sha}, head)
            body = files[m.group(3)]
            return self._send(200, body, {"ETag": '"' + hashlib.sha1(body).hexdigest() + '"', "X-Repo-Commit": sha}, head)
        if m := re.fullmatch(r"/api/datasets/([^/]+/[^/]+)(?:/revision/([^/]+))?", path):
            if not hub.known(m.group(1)): return self._not_found(head)
            sha, files = hub.lookup(m.group(1), m.group(2) or "main")
            if sha is None: return self._json(404, {"error": "Revision not found"}, head, {"X-Error-Code": "RevisionNotFound"})
            return self._json(200, {"id": m.group(1), "sha": sha, "private": False, "disabled": False,
                                    "gated": "manual" if m.group(1) in hub.gated else False,
                                    "siblings": [{"rfilename": f} for f in files], "tags": [], "downloads": 0, "likes": 0,
                                    "lastModified": "2026-01-01T00:00:00.000Z", "cardData": {}}, head)
        if m := re.fullmatch(r"/api/datasets/([^/]+/[^/]+)/tree/([^/]+)/?(.*)", path):
            sha, files = hub.lookup(m.group(1), m.group(2))
            if sha is None: return self._json(404, {"error": "not found"}, head)
            prefix = m.group(3).strip("/")
            entries, dirs = [], set()
            for f, body in files.items():
                if prefix and not f.startswith(prefix + "/"): continue
                rest = f[len(prefix) + 1:] if prefix else f
                if "/" in rest and "recursive=true" not in self.path.lower() and "recursive=True" not in self.path:
                    d = (prefix + "/" if prefix else "") + rest.split("/")[0]
                    if d not in dirs: dirs.add(d); entries.append({"type": "directory", "path": d, "oid": "0" * 40, "size": 0})
                else:
                    entries.append({"type": "file", "path": f, "size": len(body), "oid": hashlib.sha1(body).hexdigest()})
            return self._json(200, entries, head)
        return self._json(404, {"error": f"not served: {self.path}"}, head)
    def do_GET(self): self.handle_any()
    def do_HEAD(self): self.handle_any(head=True)
    def do_POST(self):
        hub = self.server.hub
        path = unquote(urlparse(self.path).path)
        length = int(self.headers.get("Content-Length") or 0); body = self.rfile.read(length)
        hub.requests.append(("POST", self.path))
        if m := re.fullmatch(r"/api/datasets/([^/]+/[^/]+)/paths-info/([^/]+)", path):
            sha, files = hub.lookup(m.group(1), m.group(2))
            from urllib.parse import parse_qs
            try: wanted = json.loads(body)["paths"]
            except Exception: wanted = parse_qs(body.decode()).get("paths", [])
            out = []
            for p in wanted:
                if p in files: out.append({"type": "file", "path": p, "size": len(files[p]), "oid": hashlib.sha1(files[p]).hexdigest()})
                elif any(f.startswith(p.rstrip("/") + "/") for f in files): out.append({"type": "directory", "path": p, "oid": "0" * 40})
            return self._json(200, out)
        return self._json(404, {"error": f"not served: {self.path}"})
