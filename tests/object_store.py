"""Real local object stores for tests and benchmarks: an S3-compatible server (moto in server mode), a GCS
emulator (gcp-storage-emulator) and a fault-injecting HTTP proxy that can sit in front of either.

Each server runs as a subprocess on a free port of 127.0.0.1 and is stopped by :meth:`close`. Clients reach
them through the ecosystem's environment variables (``AWS_ENDPOINT_URL`` and friends,
``STORAGE_EMULATOR_HOST``), which :attr:`env` holds for subprocesses and :meth:`activate` sets in
``os.environ`` for in-process use (restored by :meth:`deactivate`). ``levanter.utils.fs`` maps them onto
s3fs, gcsfs and tensorstore.

The GCS emulator ignores two parts of the JSON API that we rely on: upload preconditions
(``ifGenerationMatch``, used by exclusive creation: ``fs.create_exclusive``, run locks) and the
``startOffset`` / ``endOffset`` of object listings (tensorstore lists and deletes key ranges with them, so
the emulator's answer -- every object in the bucket -- made ``delete_existing`` wipe the bucket). The
emulator is therefore started through this module (``python tests/object_store.py gcs PORT``), which wraps
those handlers to answer 412 when a precondition does not hold and to honour the offsets, as GCS does. Its HTTP server is single-threaded: requests are served one at a
time, which is slow but faithful. moto is started the same way (``python tests/object_store.py s3 PORT``), so
that a write with a precondition is checked and stored in one step, as on S3.

:class:`FaultProxy` forwards HTTP requests to a server, answers a seeded fraction of them with 503 and
delays the others, and counts what it saw: the transient-error and latency half of a real store.
"""

from __future__ import annotations

import http.client
from http import HTTPStatus
import http.server
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.request

S3_BUCKET = "levanter-test"
GCS_BUCKET = "levanter-test"
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing-key-id",
    "AWS_SECRET_ACCESS_KEY": "testing-secret-key",
    "AWS_REGION": "us-east-1",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server for {url} exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"server for {url} did not answer within {timeout}s")


class _Server:
    scheme = ""
    bucket = ""

    def __init__(self):
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self._saved: dict[str, str | None] | None = None
        self.env: dict[str, str] = {}

    def url(self, path: str = "") -> str:
        """``scheme://bucket/path`` on this server."""
        path = path.lstrip("/")
        return f"{self.scheme}://{self.bucket}/{path}" if path else f"{self.scheme}://{self.bucket}"

    def activate(self) -> None:
        """Set :attr:`env` in ``os.environ`` (the previous values are restored by :meth:`deactivate`)."""
        if self._saved is None:
            self._saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)

    def deactivate(self) -> None:
        if self._saved is None:
            return
        for k, v in self._saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        self._saved = None

    def close(self) -> None:
        self.deactivate()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class S3Server(_Server):
    """moto in server mode with one bucket, :data:`S3_BUCKET`."""

    scheme = "s3"
    bucket = S3_BUCKET

    def __init__(self):
        super().__init__()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.env = {**S3_ENV, "AWS_ENDPOINT_URL": self.endpoint}
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "s3", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **self.env},
        )
        try:
            _wait_http(self.endpoint + "/moto-api/", self.proc)
            self.create_bucket(self.bucket)
        except BaseException:
            self.close()
            raise

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
            region_name=self.env["AWS_REGION"],
        )

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)


class GcsServer(_Server):
    """gcp-storage-emulator (in memory, upload preconditions enforced) with one bucket, :data:`GCS_BUCKET`."""

    scheme = "gs"
    bucket = GCS_BUCKET

    def __init__(self):
        super().__init__()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.env = {"STORAGE_EMULATOR_HOST": self.endpoint}
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "gcs", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            _wait_http(self.endpoint + "/storage/v1/b", self.proc)
            self.create_bucket(self.bucket)
        except BaseException:
            self.close()
            raise

    def create_bucket(self, name: str) -> None:
        req = urllib.request.Request(
            self.endpoint + "/storage/v1/b?project=test",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        urllib.request.urlopen(req, timeout=10).read()


def _serve_gcs(port: int) -> None:
    """Run the GCS emulator in this process, with upload preconditions (``ifGenerationMatch``) enforced."""
    import logging

    from gcp_storage_emulator import server as gserver
    from gcp_storage_emulator.handlers import objects

    logging.disable(logging.CRITICAL)

    def current_generation(storage, bucket, name):
        try:
            return str(storage.get_file_obj(bucket, name).get("generation"))
        except Exception:
            return None

    def with_preconditions(handler):
        def wrapped(request, response, storage, *args, **kwargs):
            want = request.query.get("ifGenerationMatch")
            name = (request.query.get("name") or [None])[0]
            if want and name is None and isinstance(request.data, dict):
                name = (request.data.get("meta") or {}).get("name")
            if want and name:
                have = current_generation(storage, request.params["bucket_name"], name)
                ok = have is None if want[0] == "0" else have == want[0]
                if not ok:
                    response.status = HTTPStatus.PRECONDITION_FAILED
                    response.json(
                        {"error": {"code": 412, "message": "Precondition Failed", "errors": [
                            {"reason": "conditionNotMet", "message": "Precondition Failed"}]}}
                    )
                    return
            return handler(request, response, storage, *args, **kwargs)

        return wrapped

    def with_offsets(handler):
        # objects.list's startOffset/endOffset (tensorstore lists and deletes key ranges with them; the
        # emulator would list, and so delete, every object of the bucket).
        def wrapped(request, response, storage, *args, **kwargs):
            out = handler(request, response, storage, *args, **kwargs)
            start = (request.query.get("startOffset") or [None])[0]
            end = (request.query.get("endOffset") or [None])[0]
            if (start or end) and response.status == HTTPStatus.OK:
                body = json.loads(response._content)
                keep = lambda name: (not start or name >= start) and (not end or name < end)  # noqa: E731
                body["items"] = [o for o in body.get("items") or [] if keep(o.get("name", ""))]
                body["prefixes"] = [p for p in body.get("prefixes") or [] if keep(p)]
                response.json(body)
            return out

        return wrapped

    for _, handlers in gserver.HANDLERS:
        for method, handler in list(handlers.items()):
            if handler is objects.insert:
                handlers[method] = with_preconditions(handler)
            elif handler is objects.ls:
                handlers[method] = with_offsets(handler)
    original_insert = objects.insert
    objects.insert = with_preconditions(original_insert)  # the router's fallback for uploads without /upload

    def with_generation_headers(handler):
        # GCS sends an object's generation with its media download; tensorstore keeps it to revalidate
        # what it read (a second open of the same array in one context), and the emulator leaves it out.
        def wrapped(request, response, storage, *args, **kwargs):
            try:
                obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
                response["x-goog-generation"] = str(obj["generation"])
                response["x-goog-metageneration"] = str(obj.get("metageneration", 1))
            except Exception:
                pass  # absent: the handler answers 404
            return handler(request, response, storage, *args, **kwargs)

        return wrapped

    for _, handlers in gserver.HANDLERS:
        for method, handler in list(handlers.items()):
            if handler is objects.download:
                handlers[method] = with_generation_headers(handler)
    objects.download = with_generation_headers(objects.download)  # objects.get(alt=media) calls it by name

    # Every upload and delete makes the emulator rewrite its whole metadata (every object of the session, the
    # soft-deleted ones too) as indented JSON, to be read back by a later start on disk. In memory nothing
    # reads it back, and the rewrite grows with the session: ~0.5 s a request once the suite's caches and
    # checkpoints are in the bucket (a 52-array checkpoint save took ~28 s). The state stays in the
    # Storage object's dicts, which every handler reads.
    from gcp_storage_emulator import storage as gstorage

    gstorage.Storage._write_config_to_file = lambda self: None
    srv = gserver.create_server("127.0.0.1", port, in_memory=True)
    srv.run()


# ------------------------------------------------------------------------------------------ fault proxy


class FaultProxy:
    """An HTTP proxy on 127.0.0.1 that forwards to ``127.0.0.1:target_port``, answers a fraction
    ``fail_fraction`` of requests with ``fail_status`` (503 by default; 403 with ``fail_fraction=1`` plays
    a store that denies access), seeded so a run's pattern repeats, and delays every forwarded request by a
    uniform draw from ``delay_s`` (seconds). ``requests``, ``failed`` and ``forwarded``
    count what it saw. Point a client at :attr:`endpoint` instead of the server."""

    def __init__(self, target_port: int, fail_fraction: float = 0.1, delay_s: tuple[float, float] = (0.02, 0.05),
                 seed: int = 0, fail_status: int = 503):
        self.target_port = target_port
        self.fail_status = fail_status
        self.fail_fraction = fail_fraction
        self.delay_s = delay_s
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.requests = 0
        self.failed = 0
        self.forwarded = 0
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = b""
                    while True:
                        line = self.rfile.readline()
                        n = int(line.split(b";")[0].strip() or b"0", 16)
                        if n == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return out
                        out += self.rfile.read(n)
                        self.rfile.readline()
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else b""

            def _final_headers(self):
                # One request per connection: a client never reuses a connection whose framing a fault
                # could have disturbed. (Not in end_headers: that also ends an interim "100 Continue".)
                self.send_header("Connection", "close")
                self.close_connection = True
                self.end_headers()

            def _handle(self):
                body = self._body()
                with proxy._lock:
                    proxy.requests += 1
                    fail = proxy._rng.random() < proxy.fail_fraction
                    delay = proxy._rng.uniform(*proxy.delay_s) if proxy.delay_s else 0.0
                    if fail:
                        proxy.failed += 1
                if fail:
                    status = HTTPStatus(proxy.fail_status)
                    code = {503: "SlowDown", 403: "AccessDenied"}.get(status.value, status.phrase.replace(" ", ""))
                    payload = (f"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>{code}</Code>"
                               f"<Message>{status.phrase}</Message></Error>").encode()
                    self.send_response(status.value, status.phrase)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self._final_headers()
                    self.wfile.write(payload)
                    return
                if delay:
                    time.sleep(delay)
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("transfer-encoding", "connection", "proxy-connection", "keep-alive", "expect")}
                if body or self.command in ("POST", "PUT", "PATCH"):
                    headers["Content-Length"] = str(len(body))
                conn = http.client.HTTPConnection("127.0.0.1", proxy.target_port, timeout=60)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    self.send_response(resp.status, resp.reason)
                    for k, v in resp.getheaders():
                        if k.lower() in ("transfer-encoding", "connection", "content-length", "keep-alive", "server",
                                         "date"):
                            continue
                        self.send_header(k, v)
                    if self.command != "HEAD" or data:
                        self.send_header("Content-Length", str(len(data)))
                    else:
                        length = resp.getheader("Content-Length")
                        if length is not None:
                            self.send_header("Content-Length", length)
                    self._final_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    conn.close()
                with proxy._lock:
                    proxy.forwarded += 1

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _handle

        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)
        self._thread.start()

    def env_for(self, server: _Server) -> dict[str, str]:
        """``server.env`` with the endpoint replaced by this proxy's."""
        env = dict(server.env)
        for k in ("AWS_ENDPOINT_URL", "STORAGE_EMULATOR_HOST"):
            if k in env:
                env[k] = self.endpoint
        return env

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _serve_s3(port: int) -> None:
    """moto's server (threaded, as ``python -m moto.server`` runs it), with conditional writes made atomic.

    moto checks ``If-None-Match: *`` and then stores the object as two steps, so two racing writers can both
    win, where S3 lets exactly one (six threads racing for a run lock found two winners). Writes that carry
    a precondition are therefore served one at a time; everything else stays concurrent."""
    import threading

    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import run_simple

    os.environ.setdefault("MOTO_PORT", str(port))  # moto builds some URLs it returns from it
    app = DomainDispatcherApplication(create_backend_app)
    conditional = threading.Lock()

    def serialized(environ, start_response):
        if environ.get("REQUEST_METHOD") in ("PUT", "POST") and (
                "HTTP_IF_NONE_MATCH" in environ or "HTTP_IF_MATCH" in environ):
            with conditional:
                return list(app(environ, start_response))
        return app(environ, start_response)

    run_simple("127.0.0.1", port, serialized, threaded=True, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "gcs":
        _serve_gcs(int(sys.argv[2]))
    elif len(sys.argv) == 3 and sys.argv[1] == "s3":
        _serve_s3(int(sys.argv[2]))
    else:
        raise SystemExit("usage: python tests/object_store.py gcs|s3 PORT")
