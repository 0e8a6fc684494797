"""A small blocking client of ``tandem.v1.Generation`` (what ``tandem generate`` uses)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import grpc

from tandem.proto import generation_pb2 as pb
from tandem.proto import generation_pb2_grpc as pb_grpc
from tandem.router.auth import auth_token_from_env
from tandem.router.tls import client_channel

DEFAULT_SERVER = "127.0.0.1:50051"


class ResponseStream(Protocol):
    """A streaming call's responses, as grpc returns them: an iterator that can be cancelled."""

    def __iter__(self) -> Iterator[pb.GenerateResponse]: ...

    def __next__(self) -> pb.GenerateResponse: ...

    def cancel(self) -> bool: ...


def build_request(prompt: str, *, chat: bool = False, request_id: str = "", max_tokens: int | None = None,
                  temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                  seed: int | None = None, stop: list[str] | None = None, logprobs: int | None = None,
                  n: int | None = None, use_beam_search: bool | None = None, beam_width: int | None = None,
                  length_penalty: float | None = None) -> pb.GenerateRequest:
    """A GenerateRequest for one prompt: plain text, or (``chat``) one user message rendered
    with the model's chat template. None leaves a sampling field unset (the server's default).
    logprobs: 0 returns each chosen token's log-probability, N in [1, 20] also the N most
    likely tokens at each position (GenerateResponse.top_logprobs)."""
    sampling = pb.SamplingParams(stop=stop or [])
    for name, value in (("max_tokens", max_tokens), ("temperature", temperature), ("top_p", top_p),
                        ("top_k", top_k), ("seed", seed), ("n", n), ("logprobs", logprobs),
                        ("use_beam_search", use_beam_search),
                        ("beam_width", beam_width), ("length_penalty", length_penalty)):
        if value is not None:
            setattr(sampling, name, value)
    request = pb.GenerateRequest(request_id=request_id, sampling=sampling)
    if chat:
        request.messages.messages.add(role="user", content=prompt)
    else:
        request.prompt = prompt
    return request


class GenerationClient:
    """A channel to one router. Use as a context manager (closes the channel)."""

    def __init__(self, target: str = DEFAULT_SERVER, auth_token: str | None = None, tls_ca: str | None = None) -> None:
        """auth_token: sent as `authorization: Bearer <token>` (default: $TANDEM_AUTH_TOKEN, if set).
        tls_ca: connect over TLS, trusting this PEM CA file (None: plaintext)."""
        self._channel = client_channel(target, tls_ca)
        self._stub = pb_grpc.GenerationStub(self._channel)
        token = auth_token if auth_token is not None else auth_token_from_env()
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()

    def generate(self, request: pb.GenerateRequest, timeout: float | None = None) -> ResponseStream:
        """Stream the responses as they arrive. Raises grpc.RpcError (see ``describe_error``).
        Stopping the iteration early does not cancel the call: use ``cancel`` on the iterator."""
        return self._stub.Generate(request, timeout=timeout, metadata=self._metadata)

    def abort(self, request_ids: list[str], timeout: float | None = None) -> list[str]:
        """-> the ids that were running and are now aborted."""
        return list(self._stub.Abort(pb.AbortRequest(request_ids=request_ids), timeout=timeout,
                                   metadata=self._metadata).aborted_request_ids)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def health_status(target: str, service: str = "", tls_ca: str | None = None, server_name: str | None = None,
                  timeout: float = 5.0) -> str:
    """A router's grpc.health.v1 status for `service` ("SERVING", "NOT_SERVING", ...): what
    the Helm chart's probes ask when the router speaks TLS (Kubernetes' own gRPC probes do not)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with client_channel(target, tls_ca, server_name) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                           timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)


def describe_error(error: grpc.RpcError) -> str:
    """``"INVALID_ARGUMENT: prompt: must not be empty"``: the status code's name and the details."""
    code = error.code() if hasattr(error, "code") else None
    details = error.details() if hasattr(error, "details") else str(error)
    return f"{code.name if code is not None else 'UNKNOWN'}: {details}"


FINISH_REASON_NAMES = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
}
"""The proto's FinishReason -> the words the workers and OpenAI use."""
