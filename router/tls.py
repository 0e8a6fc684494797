"""TLS for the router's gRPC and HTTP APIs: one certificate and key, given as files
(`tandem serve --tls-certfile --tls-keyfile`; the Helm chart mounts them from a Secret)."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class TLSFiles:
    certfile: str
    """PEM: the server's certificate (and its chain)."""
    keyfile: str
    """PEM: its private key."""

    @classmethod
    def of(cls, certfile: str | None, keyfile: str | None) -> TLSFiles | None:
        """Both files, or neither (no TLS); ValueError for one alone or an unreadable one."""
        if certfile is None and keyfile is None:
            return None
        if not (certfile and keyfile):
            raise ValueError("TLS needs both --tls-certfile and --tls-keyfile")
        for path in (certfile, keyfile):
            if not Path(path).is_file():
                raise ValueError(f"TLS: {path} is not a readable file")
        return cls(certfile, keyfile)

    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(Path(self.keyfile).read_bytes(), Path(self.certfile).read_bytes())])

    def ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.certfile, self.keyfile)
        return context


def client_channel(target: str, ca_file: str | None = None, server_name: str | None = None) -> grpc.Channel:
    """A channel to a router: TLS, trusting `ca_file` (PEM), when given; plaintext otherwise.
    server_name: the name the certificate must carry, when `target` is not it (a probe that
    dials 127.0.0.1 inside the router's pod)."""
    if ca_file is None:
        return grpc.insecure_channel(target)
    options = [] if server_name is None else [("grpc.ssl_target_name_override", server_name)]
    credentials = grpc.ssl_channel_credentials(root_certificates=Path(ca_file).read_bytes())
    return grpc.secure_channel(target, credentials, options=options)
