"""Registers ``tandem.v1.Generation`` on a grpc.aio server with request parsing that cannot
fail the call: bytes protobuf refuses (a string field holding invalid UTF-8, a truncated
message) reach the servicer as an ``Unparsable`` request, so that the client gets
INVALID_ARGUMENT naming the message, not the UNKNOWN grpc answers for a failed parse."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from tandem.proto import generation_pb2 as pb

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "tandem.v1.Generation"


@dataclass(frozen=True)
class Unparsable:
    """A request whose bytes are not a valid message of its type."""

    message_type: str
    error: str

    def describe(self) -> str:
        return (f"request: not a valid {self.message_type} (are its strings UTF-8?): "
                f"{self.error or 'parse error'}")


def _tolerant(message_class: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except DecodeError as e:
            return Unparsable(message_class.DESCRIPTOR.full_name, str(e))
    return parse


def add_generation_service(servicer: Any, server: grpc.aio.Server) -> None:
    """What ``generation_pb2_grpc.add_GenerationServicer_to_server`` does, with tolerant parsing:
    the servicer's methods receive the message or an ``Unparsable``."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=_tolerant(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString),
        "Abort": grpc.unary_unary_rpc_method_handler(
            servicer.Abort, request_deserializer=_tolerant(pb.AbortRequest),
            response_serializer=pb.AbortResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
