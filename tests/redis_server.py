"""A throwaway redis-server for tests: a free loopback port, no persistence, its own temp dir.
Each pytest process (xdist worker) starts its own. Optionally it requires a password (of the
default user, or of an ACL user with the default user disabled) and speaks TLS only (a
self-signed certificate made with `openssl`, given to clients as `ssl_ca_certs`)."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, workdir: Path, port: int | None = None, password: str | None = None,
                 user: str | None = None, tls: bool = False):
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (apt-get install -y redis-server; `make setup` does it)")
        if user is not None and password is None:
            raise ValueError("an ACL user needs a password")
        self.exe, self.dir = exe, workdir
        self.port = port or free_port()
        self.password, self.user, self.tls = password, user, tls
        self.proc: subprocess.Popen | None = None
        self.ca = self._certificate() if tls else None

    def url_with(self, user: str | None, password: str | None) -> str:
        auth = f"{user or ''}:{password}@" if password is not None else ""
        scheme, query = ("rediss", f"?ssl_ca_certs={self.ca}") if self.tls else ("redis", "")
        return f"{scheme}://{auth}127.0.0.1:{self.port}/0{query}"

    @property
    def url(self) -> str:
        return self.url_with(self.user, self.password)

    def _certificate(self) -> Path:
        cert, key = self.dir / "redis-cert.pem", self.dir / "redis-key.pem"
        if not cert.exists():
            subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                            "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                            "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
        return cert

    def _argv(self) -> list[str]:
        argv = [self.exe, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(self.dir)]
        if self.tls:
            cert = str(self.ca)
            argv += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", cert,
                     "--tls-key-file", str(self.dir / "redis-key.pem"), "--tls-ca-cert-file", cert,
                     "--tls-auth-clients", "no"]
        else:
            argv += ["--port", str(self.port)]
        if self.user is not None:  # only this user may log in
            argv += ["--user", self.user, "on", f">{self.password}", "~*", "&*", "+@all", "--user", "default", "off"]
        elif self.password is not None:
            argv += ["--requirepass", self.password]
        return argv

    def start(self) -> "RedisServer":
        self.proc = subprocess.Popen(self._argv(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = self.client(timeout=1)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return self
            except redis.RedisError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {self.port}")
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: the store vanishes mid-conversation, as in a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def client(self, timeout: float = 2) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=timeout, socket_connect_timeout=timeout)
