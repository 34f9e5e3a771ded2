"""A real S3 protocol server for tests: moto's standalone server on 127.0.0.1, and a fault proxy.

``s3_server()`` starts ``python -m moto.server`` in a subprocess on a free port (bounded start-up, always
stopped), ``S3Server.bucket()`` makes a bucket and ``S3Server.env()`` points the standard AWS variables
at the server, so that ``s3://`` URLs work as they would against a real store. ``FaultProxy`` sits
between the client and the server and fails, delays or holds chosen requests.

Multipart parts may be as small as ``MIN_PART`` bytes here (the server is started with a lower minimum
than S3's 5 MiB), so tests exercise multipart uploads with small tensors.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MIN_PART = 1024
START_TIMEOUT = 60.0
_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "upgrade"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class S3Server:
    """A running moto server."""

    endpoint: str
    proc: subprocess.Popen[bytes]

    def bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh unique name by default) and return its name."""
        name = name or f"t-{uuid.uuid4().hex[:20]}"
        req = urllib.request.Request(f"{self.endpoint}/{name}", method="PUT")
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.status == 200, resp.status
        return name

    def multipart_uploads(self, bucket: str) -> int:
        """How many multipart uploads are in progress (neither completed nor aborted) in ``bucket``."""
        with urllib.request.urlopen(f"{self.endpoint}/{bucket}?uploads", timeout=30) as resp:
            body: bytes = resp.read()
        return body.decode().count("<Upload>")

    @contextlib.contextmanager
    def env(self, endpoint: str | None = None) -> Iterator[None]:
        """Set the standard AWS variables for this server (or ``endpoint``), restoring them after."""
        values = {
            "AWS_ENDPOINT_URL": endpoint or self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1",
        }
        saved = {k: os.environ.get(k) for k in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


@contextlib.contextmanager
def s3_server() -> Iterator[S3Server]:
    """Run moto's S3 server on a free 127.0.0.1 port for the duration of the block."""
    port = free_port()
    env = {**os.environ, "S3_UPLOAD_PART_MIN_SIZE": str(MIN_PART), "MOTO_ALLOW_NONEXISTENT_REGION": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {proc.returncode} at start-up")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"moto server did not listen on port {port} in time") from None
                time.sleep(0.1)
        yield S3Server(endpoint=f"http://127.0.0.1:{port}", proc=proc)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client that hung up is no news
            super().handle_error(request, client_address)  # type: ignore[arg-type]


class FaultProxy:
    """An HTTP proxy in front of ``upstream`` that fails UploadPart requests with ``503 SlowDown``.

    Attributes:
        fail_first: Fail this many UploadPart requests, then pass them (the client retries).
        pass_then_fail: When set, pass this many UploadPart requests, then fail every later one.
        failed: UploadPart requests failed so far.
        passed: UploadPart requests forwarded so far.
        delay: Seconds each forwarded UploadPart request waits first (a slow link).
        refuse: When set, a predicate on (method, path with query): a request it accepts is answered
            ``503 SlowDown`` at once, without reaching the server.
        stall: When set, a predicate on (method, path with query): a request it accepts is held, never
            forwarded, and answered ``503`` on :meth:`release` or when the proxy closes (the client may
            retry it; one still in flight when its client died never lands).
        stalled: Set once a request was held.
        lose_answer: When set, a predicate on (method, path with query): a request it accepts is
            forwarded (it lands) and the client is answered ``503`` (the answer lost on the way).
    """

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.removeprefix("http://")
        self.fail_first = 0
        self.pass_then_fail: int | None = None
        self.failed = 0
        self.passed = 0
        self.delay = 0.0
        self.refuse: Callable[[str, str], bool] | None = None
        self.stall: Callable[[str, str], bool] | None = None
        self.stalled = threading.Event()
        self.lose_answer: Callable[[str, str], bool] | None = None
        self._released = threading.Event()
        self._lock = threading.Condition()
        self._server = _Server(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._released.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

    def _fail(self, method: str, target: str) -> bool:
        if method != "PUT" or "partNumber=" not in target or "uploadId=" not in target:
            return False
        with self._lock:
            if self.failed < self.fail_first or (
                self.pass_then_fail is not None and self.passed >= self.pass_then_fail
            ):
                self.failed += 1
                return True
            self.passed += 1
            self._lock.notify_all()
            return False

    def release(self) -> None:
        """Answer the held requests (``503``); hold no more."""
        self.stall = None
        self._released.set()

    def wait_passed(self, count: int, timeout: float) -> bool:
        """Block until ``count`` UploadPart requests were forwarded; ``False`` on timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: self.passed >= count, timeout)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _slow_down(self) -> None:
                reply = b"<Error><Code>SlowDown</Code><Message>injected</Message></Error>"
                self.send_response(503)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                if proxy.stall is not None and proxy.stall(self.command, self.path):
                    proxy.stalled.set()
                    proxy._released.wait()
                    self._slow_down()
                    return
                refused = proxy.refuse is not None and proxy.refuse(self.command, self.path)
                if refused or proxy._fail(self.command, self.path):
                    self._slow_down()
                    return
                if self.command == "PUT" and "partNumber=" in self.path:
                    time.sleep(proxy.delay)
                conn = http.client.HTTPConnection(proxy.upstream, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                if proxy.lose_answer is not None and proxy.lose_answer(self.command, self.path):
                    self._slow_down()
                    return
                self.send_response(resp.status)
                head = self.command == "HEAD"  # its Content-Length is the object's, with no body
                for k, v in resp.getheaders():
                    if k.lower() not in _HOP and (head or k.lower() != "content-length"):
                        self.send_header(k, v)
                if not head:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        return Handler
