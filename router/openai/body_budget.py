"""Bytes of HTTP request bodies being received at once, bounded: a body reserves its declared
length (or, chunked, the most a body may be) before a byte of it is read, and gives it back
once parsed. Hundreds of clients uploading maximum-size bodies, or trickling them in, then
cost the router at most the budget, not hundreds of bodies."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from aiohttp import web

from tandem.router.limits import RequestLimits
from tandem.router.openai.errors import APIError


class BodyBudget:
    def __init__(self, limits: RequestLimits) -> None:
        self.max_bytes = limits.max_body_bytes_in_flight
        self.max_body_bytes = limits.max_body_bytes
        self.read_timeout_s = limits.body_read_timeout_s
        self.num_bytes = 0
        """Reserved by the bodies being received now."""

    def may_take(self, num_bytes: int) -> bool:
        return self.num_bytes + num_bytes <= self.max_bytes

    @contextlib.asynccontextmanager
    async def body(self, request: web.Request) -> AsyncIterator[bytes]:
        """The request's body, read within the budget and the read timeout: 413 when it says
        it is larger than a body may be, 503 at once when the budget has no room for it, 408
        when it does not arrive in time. The bytes stay counted until the block ends."""
        declared = request.content_length
        if declared is not None and declared > self.max_body_bytes:
            raise APIError(413, f"the request body is {declared} bytes, the most is {self.max_body_bytes}")
        reserved = self.max_body_bytes if declared is None else declared
        if not self.may_take(reserved):
            raise APIError(503, f"the server is receiving {self.num_bytes} bytes of request bodies already "
                                f"(max_body_bytes_in_flight={self.max_bytes}): retry later",
                           type="server_error", headers={"Retry-After": "1"})
        self.num_bytes += reserved
        try:
            try:
                raw = await asyncio.wait_for(request.read(), self.read_timeout_s)
            except web.HTTPRequestEntityTooLarge as e:
                raise APIError(413, e.text or "the request body is too large") from e
            except asyncio.TimeoutError:
                raise APIError(408, f"the request body did not arrive within "
                                    f"body_read_timeout_s={self.read_timeout_s} s") from None
            yield raw
        finally:
            self.num_bytes -= reserved
