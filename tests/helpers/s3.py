"""A real S3 server on loopback for the ``s3`` tests: moto's threaded server, started and stopped by a fixture."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "kvdi-test", "AWS_SECRET_ACCESS_KEY": "kvdi-test-secret"}
"""What moto accepts; set in the environment so boto3's own chain finds them (as it would in production)."""


def use_test_credentials() -> None:
    """Point boto3's chain at :data:`CREDENTIALS` (and away from any profile or config file of the machine)."""
    os.environ.update(CREDENTIALS)
    os.environ.pop("AWS_PROFILE", None)
    os.environ["AWS_CONFIG_FILE"] = os.devnull
    os.environ["AWS_SHARED_CREDENTIALS_FILE"] = os.devnull


@contextmanager
def s3_server() -> Iterator[str]:
    """A moto S3 server on a free loopback port; yields its endpoint URL and stops it on exit."""
    from moto.server import ThreadedMotoServer

    use_test_credentials()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def raw_client(endpoint_url: str) -> Any:
    """A plain boto3 client on the server (for planting objects by hand and listing what is there)."""
    import boto3

    return boto3.client("s3", endpoint_url=endpoint_url, region_name="us-east-1")


def new_bucket(endpoint_url: str) -> str:
    """A fresh, empty bucket on the server."""
    name = f"kvdi-{uuid.uuid4().hex[:16]}"
    raw_client(endpoint_url).create_bucket(Bucket=name)
    return name


def object_names(endpoint_url: str, bucket: str) -> list[str]:
    """Every object name in ``bucket``."""
    reply = raw_client(endpoint_url).list_objects_v2(Bucket=bucket)
    return [o["Key"] for o in reply.get("Contents", [])]


class ThrottlingProxy:
    """An HTTP proxy in front of an S3 endpoint that answers the next ``throttle`` requests ``503 SlowDown``
    (as S3 does when a prefix is hot) and forwards every other request as it is."""

    def __init__(self, endpoint_url: str) -> None:
        import http.client
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import urlsplit

        target = urlsplit(endpoint_url)
        proxy = self
        self.throttle = 0
        self.throttled = 0
        self._lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def _any(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with proxy._lock:
                    slow = proxy.throttle > 0
                    if slow:
                        proxy.throttle -= 1
                        proxy.throttled += 1
                if slow:
                    error = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(error)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(error)
                    return
                conn = http.client.HTTPConnection(target.hostname or "127.0.0.1", target.port, timeout=30)
                conn.request(self.command, self.path, body=body, headers=dict(self.headers))
                reply = conn.getresponse()
                data = reply.read()
                self.send_response(reply.status)
                for name, value in reply.getheaders():
                    if name.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _any

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
