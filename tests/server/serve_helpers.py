"""Shared by the server tests: start `loramux serve` on a free port (--port 0, the port read from its log),
the official openai client for it, plain HTTP for what the client cannot send, and /metrics as a dict."""
import json
import os
import re
import signal
import subprocess
import tempfile
import time

import http.client
import openai

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("LORAMUX_BIN", os.path.join(ROOT, "build", "loramux"))


class Response:
    def __init__(self, status, body):
        self.status_code, self.content = status, body
        self.text = body.decode("utf-8", "replace")

    def json(self):
        return json.loads(self.text)


def http_request(port, method, path, body=None, headers=None):
    """Plain HTTP without the openai client (which cannot send malformed bodies or hit admin routes)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request(method, path, body=body, headers=headers or {})
    r = c.getresponse()
    out = Response(r.status, r.read())
    c.close()
    return out


class Server:
    def __init__(self, *args, wait_ready=True, env=None):
        """Start serving; with wait_ready, return once /health says 200 (the model has loaded)."""
        self.log = tempfile.NamedTemporaryFile(prefix="loramux_serve_", suffix=".log", delete=False)
        self.proc = subprocess.Popen([BIN, "serve", "--port", "0", *args], stdout=self.log, stderr=self.log,
                                     env={**os.environ, **(env or {})})
        deadline = time.time() + 60
        self.port = None
        while time.time() < deadline and self.proc.poll() is None:
            m = re.search(r"listening on http://[\d.]+:(\d+)", open(self.log.name).read())
            if m:
                self.port = int(m.group(1))
                break
            time.sleep(0.05)
        assert self.port, "server did not start:\n" + open(self.log.name).read()
        self.url = f"http://127.0.0.1:{self.port}"
        while wait_ready and self.get("/health").status_code != 200:  # 503 while the model loads
            assert time.time() < deadline and self.proc.poll() is None, "server not ready:\n" + open(self.log.name).read()
            time.sleep(0.05)

    def client(self, api_key="none"):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60)

    def post(self, path, body, **kw):
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        return http_request(self.port, "POST", path, data, **kw)

    def get(self, path):
        return http_request(self.port, "GET", path)

    def metrics(self):
        text = self.get("/metrics").text
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        os.unlink(self.log.name)
