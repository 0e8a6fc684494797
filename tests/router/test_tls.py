"""TLS on both front doors: with a certificate, gRPC and HTTP speak only TLS, clients that
trust the CA are served, and plaintext or an untrusted CA is refused."""

from __future__ import annotations

import asyncio
import json
import ssl
import urllib.error
import urllib.request

import grpc
import pytest
import trustme
from fake_backend import FakeBackend
from router_harness import serving

from tandem import cli
from tandem.proto import generation_pb2 as pb
from tandem.proto import generation_pb2_grpc as pb_grpc
from tandem.router.client import GenerationClient
from tandem.router.server import bound_port, http_port
from tandem.router.tls import TLSFiles


@pytest.fixture
def tls_files(tmp_path):
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost", "demo-tandem-router")
    cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "server.pem"))
    cert.private_key_pem.write_to_path(str(tmp_path / "server.key"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    return TLSFiles(str(tmp_path / "server.pem"), str(tmp_path / "server.key")), str(tmp_path / "ca.pem")


def post_completion(url: str, context: ssl.SSLContext | None) -> dict:
    body = json.dumps({"model": "SmolLM2-135M-Instruct", "prompt": "hi", "max_tokens": 2}).encode()
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, context=context, timeout=30) as response:
        return json.loads(response.read())


def test_grpc_and_http_over_tls(router_tokenizer, tls_files):
    tls, ca_file = tls_files

    def calls(grpc_port: int, web_port: int | None) -> tuple:
        with GenerationClient(f"127.0.0.1:{grpc_port}", tls_ca=ca_file) as client:
            served = [r for r in client.generate(pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(
                max_tokens=2)), timeout=30)]
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as plain:
            with pytest.raises(grpc.RpcError) as refused:
                list(pb_grpc.GenerationStub(plain).Generate(pb.GenerateRequest(prompt="hi"), timeout=5))
        https = post_completion(f"https://127.0.0.1:{web_port}/v1/completions",
                                ssl.create_default_context(cafile=ca_file))
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            post_completion(f"https://127.0.0.1:{web_port}/v1/completions", ssl.create_default_context())
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            post_completion(f"http://127.0.0.1:{web_port}/v1/completions", None)
        return served, refused.value.code(), https

    async def main():
        async with serving(FakeBackend(router_tokenizer), tls=tls, http_port=0) as (_, server):
            return await asyncio.to_thread(calls, bound_port(server), http_port(server))

    served, refused, https = asyncio.run(main())
    assert served[-1].usage.completion_tokens == 2
    assert refused == grpc.StatusCode.UNAVAILABLE  # a plaintext client never gets through the handshake
    assert https["usage"]["completion_tokens"] == 2


def test_the_probe_command_over_tls(router_tokenizer, tls_files, capsys):
    """`tandem health`, as the Helm chart's probes run it in the router's pod: 127.0.0.1, the
    certificate's name given (Kubernetes' own gRPC probes speak no TLS)."""
    tls, ca_file = tls_files

    async def main():
        async with serving(FakeBackend(router_tokenizer), tls=tls) as (_, server):
            server_args = ["--server", f"127.0.0.1:{bound_port(server)}", "--tls-ca", ca_file,
                           "--tls-server-name", "demo-tandem-router"]
            return [await asyncio.to_thread(cli.main, ["health", *server_args, "--service", service])
                    for service in ("", "tandem.liveness", "no.such.Service")]

    assert asyncio.run(main()) == [0, 0, 1]
    out, err = capsys.readouterr()
    assert out.split() == ["SERVING", "SERVING"] and "NOT_FOUND" in err


def test_tls_needs_both_readable_files(tmp_path):
    assert TLSFiles.of(None, None) is None
    with pytest.raises(ValueError, match="both --tls-certfile and --tls-keyfile"):
        TLSFiles.of("cert.pem", None)
    with pytest.raises(ValueError, match="is not a readable file"):
        TLSFiles.of(str(tmp_path / "missing.pem"), str(tmp_path / "missing.key"))
