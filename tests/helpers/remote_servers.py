"""Servers for remote slides, started in-process: a range-capable HTTP server, a TCP proxy that adds
latency, and moto's S3 server. Used by tests/test_remote_slides.py and benchmarks/bench_remote.py.

:class:`RangeServer` serves the files of a folder with ``Range`` requests (206 and Content-Range),
an ETag and Last-Modified, an optional bearer token or basic login it asks for, and faults set per
file name (:attr:`RangeServer.faults`): ``"status:503:2"`` (answer 503 to the next 2 requests),
``"status:403"`` (always), ``"truncate"`` (a body cut short, then the connection closed),
``"hang"`` (headers, then nothing), ``"die-within:A:B"`` (the connection closed, no answer, for
every request of a range that meets bytes ``[A, B)``).
"""

from __future__ import annotations

import base64
import email.utils
import hashlib
import http.server
import os
import re
import socket
import threading
import time
from collections import defaultdict

_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _HTTPServer

    def log_message(self, format, *args):  # quiet
        pass

    def _refuse(self, status: int) -> None:
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:  # noqa: N802
        owner = self.server.owner
        name = self.path.split("?")[0].lstrip("/")
        owner.requests[name] += 1
        if owner.expected_auth and self.headers.get("Authorization") != owner.expected_auth:
            return self._refuse(401)
        fault = owner.faults.get(name, "")
        if fault.startswith("status:"):
            _, code, *times = fault.split(":")
            if times:
                left = int(times[0]) - 1
                owner.faults[name] = f"status:{code}:{left}" if left > 0 else ""
            return self._refuse(int(code))
        m = _RANGE.match(self.headers.get("Range", ""))
        if fault.startswith("die-within:") and m is not None:
            lo, hi = (int(v) for v in fault.split(":")[1:])
            if int(m.group(1)) < hi and int(m.group(2) or hi) >= lo:
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return None
        path = os.path.join(owner.folder, name)
        if not os.path.isfile(path):
            return self._refuse(404)
        size = os.path.getsize(path)
        if m is None:
            return self._refuse(400)
        start, end = int(m.group(1)), min(int(m.group(2) or size - 1), size - 1)
        if start >= size:
            return self._refuse(416)
        st = os.stat(path)
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("ETag", '"' + hashlib.sha1(f"{st.st_mtime_ns}-{size}".encode()).hexdigest()[:16] + '"')
        self.send_header("Last-Modified", email.utils.formatdate(st.st_mtime, usegmt=True))
        self.end_headers()
        if fault == "hang":
            owner.release.wait()
            return None
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read(end - start + 1)
        if fault == "truncate":
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self.close_connection = True
            return None
        self.wfile.write(data)
        return None


class _HTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    owner: RangeServer


class RangeServer:
    """An HTTP server of the files of ``folder`` on 127.0.0.1 (see the module's text); ``url`` the
    address of its root. ``token``: the bearer token it asks for; ``login``: (user, password) for basic."""

    def __init__(self, folder: str, token: str | None = None, login: tuple[str, str] | None = None):
        self.folder = folder
        self.faults: dict[str, str] = {}
        self.requests: defaultdict[str, int] = defaultdict(int)
        self.release = threading.Event()
        if token:
            self.expected_auth = f"Bearer {token}"
        elif login:
            self.expected_auth = "Basic " + base64.b64encode(f"{login[0]}:{login[1]}".encode()).decode()
        else:
            self.expected_auth = None
        self._server = _HTTPServer(("127.0.0.1", 0), _Handler)
        self._server.owner = self
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.release.set()
        self._server.shutdown()
        self._server.server_close()


class LatencyProxy:
    """A TCP proxy on 127.0.0.1 to ``target_port`` that holds each chunk ``delay_s`` in each
    direction (a round trip of twice that added), keeping the order of the bytes."""

    def __init__(self, target_port: int, delay_s: float):
        self.target_port, self.delay_s = target_port, delay_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._closing = threading.Event()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sockets += [client, upstream]
            self._pipe(client, upstream)
            self._pipe(upstream, client)

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        held: list[tuple[float, bytes]] = []
        ready = threading.Condition()

        def read() -> None:
            while True:
                try:
                    data = src.recv(1 << 16)
                except OSError:
                    data = b""
                with ready:
                    held.append((time.monotonic() + self.delay_s, data))
                    ready.notify()
                if not data:
                    return

        def write() -> None:
            while True:
                with ready:
                    while not held:
                        ready.wait()
                    due, data = held.pop(0)
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                try:
                    if not data:
                        dst.shutdown(socket.SHUT_WR)
                        return
                    dst.sendall(data)
                except OSError:
                    return

        threading.Thread(target=read, daemon=True).start()
        threading.Thread(target=write, daemon=True).start()

    def close(self) -> None:
        self._closing.set()
        self._listener.close()
        for s in self._sockets:
            try:
                s.close()
            except OSError:
                pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """moto's S3 server on 127.0.0.1 (``pip install 'moto[server]'``), ``endpoint`` its address."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.port = free_port()
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing-secret",
        )

    def close(self) -> None:
        self._server.stop()
