"""A local S3 server (s3s-fs, which `scripts/setup.sh --test` installs) and a fault-injecting
HTTP proxy in front of it, for tests that run real clients against real failures.

The proxy forwards each request on its own upstream connection (``Connection: close``) and,
by the request's number, answers a burst of 503 SlowDown, resets the connection, cuts the
response body in half, or stalls before forwarding. It checks ``If-Match`` as S3 does (the
local server ignores it on GET): a GET pinned to another version than the store's is
answered 412 Precondition Failed, before any other answer (a range past the new version's
end included), as S3 evaluates preconditions first. Faults are only injected while
``faults`` is true.
"""

import hashlib
import os
import pathlib
import socket
import struct
import subprocess
import threading
import time
import urllib.parse

S3S_FS = pathlib.Path(
    os.environ.get("FLOWGATE_S3S_FS")
    or pathlib.Path.home() / ".cache/flowgate/tools/bin/s3s-fs")

KEYS = {"AWS_ACCESS_KEY_ID": "flowgate", "AWS_SECRET_ACCESS_KEY": "flowgate-secret",
        "AWS_REGION": "us-east-1"}


def s3_store(tmp_path, monkeypatch, *, faults: bool, available: bool = True):
    """A pytest fixture's body: the server over ``tmp_path/s3`` (bucket ``data``), with the
    fault proxy before it when ``faults``; the environment points clients at whichever is in
    front. Yields ``(root, proxy or None)``; skips (fails under CI) when s3s-fs or the
    package's ``s3`` feature (``available``) is missing."""
    import pytest
    if not S3S_FS.exists() or not available:
        if os.environ.get("CI"):
            pytest.fail(f"{S3S_FS} or the package's s3 feature is missing")
        pytest.skip("needs s3s-fs (scripts/setup.sh --test) and the package built with s3")
    root = tmp_path / "s3"
    (root / "data").mkdir(parents=True)
    server = Server(root)
    proxy = FaultProxy(server.port, root) if faults else None
    port = proxy.port if proxy else server.port
    for k, v in {**KEYS, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}.items():
        monkeypatch.setenv(k, v)
    try:
        yield root, proxy
    finally:
        if proxy:
            proxy.stop()
        server.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            assert proc.poll() is None, f"{what} exited"
            assert time.monotonic() < deadline, f"{what} did not start"
            time.sleep(0.02)


class Server:
    """s3s-fs over ``root`` (its folders are buckets) on a free port; ``stop()`` ends it."""

    def __init__(self, root: pathlib.Path) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [str(S3S_FS), "--host", "127.0.0.1", "--port", str(self.port), "--access-key",
             KEYS["AWS_ACCESS_KEY_ID"], "--secret-key", KEYS["AWS_SECRET_ACCESS_KEY"],
             str(root)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(self.port, self.proc, "s3s-fs")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def _find(buf: bytes, needle: bytes) -> int:
    return buf.find(needle)


def _header(head: str, name: str):
    for line in head.split("\r\n")[1:]:
        k, sep, v = line.partition(":")
        if sep and k.strip().lower() == name:
            return v.strip()
    return None


def _error(status: int, reason: str, code: str) -> bytes:
    body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
            f"<Message>injected by the fault proxy</Message></Error>").encode()
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


class FaultProxy:
    """See the module docs. ``counts`` holds what it did: requests, slow_down, reset,
    truncated, stalled, precondition_failed."""

    def __init__(self, upstream_port: int, root: pathlib.Path, stall: float = 1.0,
                 faults: bool = True) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        #: The server's folder (buckets are its folders): the current version's entity tag
        #: of an object is its file's MD5, as the server computes it.
        self.root = root
        self.stall = stall
        self.faults = faults
        self.counts = dict(requests=0, gets=0, slow_down=0, reset=0, truncated=0, stalled=0,
                           precondition_failed=0)
        self._lock = threading.Lock()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        self.port = self._sock.getsockname()[1]
        self._stopped = False
        threading.Thread(target=self._accept, daemon=True).start()

    def stop(self) -> None:
        self._stopped = True
        self._sock.close()

    def _accept(self) -> None:
        while not self._stopped:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _plan(self, n: int) -> str:
        """The fault for GET number ``n`` (listings and footers too): bursts of two 503s,
        resets, cut bodies and stalls at co-prime periods, about 13% of GETs: a rate the
        client's retry budget absorbs (at much higher rates it runs out by design, and
        requests fail fast)."""
        if not self.faults:
            return "none"
        if n % 40 in (4, 5):
            return "slow_down"
        if n % 31 == 7:
            return "reset"
        if n % 37 == 11:
            return "truncate"
        if n % 43 == 2:
            return "stall"
        return "none"

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                self._serve_one(conn)
        except OSError:
            pass

    def _serve_one(self, conn: socket.socket) -> None:
        buf = b""
        while (end := _find(buf, b"\r\n\r\n")) < 0:
            chunk = conn.recv(65536)
            if not chunk:
                return
            buf += chunk
        head = buf[:end + 2].decode("latin-1")
        length = int(_header(head, "content-length") or 0)
        while len(buf) < end + 4 + length:
            chunk = conn.recv(65536)
            if not chunk:
                return
            buf += chunk
        method = head.split(" ", 1)[0]
        with self._lock:
            self.counts["requests"] += 1
            n = self.counts["gets"]
            self.counts["gets"] += method == "GET"
        fault = self._plan(n) if method == "GET" else "none"
        if fault == "slow_down":
            self._count("slow_down")
            conn.sendall(_error(503, "Slow Down", "SlowDown"))
            return
        if fault == "reset":
            self._count("reset")
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return
        if fault == "stall":
            self._count("stalled")
            time.sleep(self.stall)
        wanted = _header(head, "if-match")
        if method == "GET" and wanted is not None and wanted != self._etag(head):
            self._count("precondition_failed")
            conn.sendall(_error(412, "Precondition Failed", "PreconditionFailed"))
            return
        lines = [line for line in head.split("\r\n") if line
                 and not line.lower().startswith("connection:")]
        request = ("\r\n".join(lines) + "\r\nConnection: close\r\n\r\n").encode("latin-1")
        request += buf[end + 4:end + 4 + length]
        with socket.create_connection(self.upstream) as up:
            up.sendall(request)
            resp = b""
            while chunk := up.recv(1 << 16):
                resp += chunk
        resp_end = _find(resp, b"\r\n\r\n")
        if fault == "truncate" and resp_end >= 0 and len(resp) > resp_end + 5:
            self._count("truncated")
            conn.sendall(resp[:resp_end + 4 + (len(resp) - resp_end - 4) // 2])
            return
        conn.sendall(resp)

    def _etag(self, head: str):
        """The entity tag of the object a request names, now: its file's MD5, quoted."""
        target = urllib.parse.unquote(head.split(" ", 2)[1].split("?", 1)[0])
        path = self.root / target.lstrip("/")
        try:
            return f'"{hashlib.md5(path.read_bytes()).hexdigest()}"'
        except OSError:
            return None

    def _count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1
