"""A local stand-in for the Hub's HTTP API (the network boundary): records repo creation, branches and commits.

Only the endpoints `HfApi.create_repo`, `create_branch` and `create_commit` call, and a HEAD of the front page (the
reachability probe), are served; every file is accepted as a regular (non-LFS) upload, so its bytes arrive inline in
the commit and can be asserted on."""

from __future__ import annotations

import base64
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeHub:
    def __init__(self):
        self.requests: list[tuple[str, str, dict]] = []  # (method, path, headers)
        self.repos: dict[str, dict] = {}
        self.branches: list[tuple[str, str]] = []
        self.commits: list[dict] = []  # {"repo", "revision", "summary", "files": {path: bytes}}
        self.validated: list[dict] = []  # model cards sent to /api/validate-yaml
        self.fail_commits = False
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), HubHandler)
        self.server.hub = self
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


class HubHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep test output clean
        pass

    def do_POST(self):
        hub = self.server.hub
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        hub.requests.append(("POST", self.path, dict(self.headers)))
        path = self.path.split("?")[0]
        if path == "/api/repos/create":
            spec = json.loads(body)
            repo = f"{spec['organization']}/{spec['name']}" if spec.get("organization") else spec["name"]
            hub.repos[repo] = spec
            return self._json(200, {"url": f"{hub.url}/{repo}", "name": repo})
        if path == "/api/validate-yaml":  # the Hub checks a README.md's metadata before the commit
            hub.validated.append(json.loads(body))
            return self._json(200, {"errors": [], "warnings": []})
        if m := re.fullmatch(r"/api/models/(.+?/.+?)/branch/(.+)", path):
            hub.branches.append((m.group(1), m.group(2)))
            return self._json(200, {})
        if m := re.fullmatch(r"/api/models/(.+?/.+?)/preupload/(.+)", path):
            files = json.loads(body)["files"]
            return self._json(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                              for f in files]})
        if m := re.fullmatch(r"/api/models/(.+?/.+?)/commit/(.+)", path):
            if hub.fail_commits:
                return self._json(403, {"error": "You have exceeded your storage quota"})
            lines = [json.loads(line) for line in body.splitlines() if line.strip()]
            files = {i["value"]["path"]: base64.b64decode(i["value"]["content"]) for i in lines if i["key"] == "file"}
            header = next(i["value"] for i in lines if i["key"] == "header")
            hub.commits.append({"repo": m.group(1), "revision": m.group(2), "summary": header["summary"],
                                "files": files})
            return self._json(200, {"commitUrl": f"{hub.url}/{m.group(1)}/commit/abc123", "commitOid": "abc123"})
        return self._json(404, {"error": f"not served by the fake hub: {self.path}"})

    def do_GET(self):
        self.server.hub.requests.append(("GET", self.path, dict(self.headers)))
        return self._json(404, {"error": f"not served by the fake hub: {self.path}"})

    def do_HEAD(self):  # the reachability probe: the Hub answers its front page
        self.server.hub.requests.append(("HEAD", self.path, dict(self.headers)))
        self.send_response(200 if self.path == "/" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _json(self, status, payload):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
