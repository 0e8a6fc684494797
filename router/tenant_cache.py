"""Each tenant's prefix cache its own: with API keys, a request's cache_salt is made from its
tenant and the salt it gave, so no tenant can reach another's cached prefixes, even by
sending the other's salt (or none), and the prefix hits it sees are its own."""

from __future__ import annotations

import dataclasses
import hashlib

from tandem.router.validation import ValidRequest


def tenant_salt(tenant: str, cache_salt: str | None) -> str:
    """The salt a tenant's request is cached under (32 hex characters, within the field's bound)."""
    given = "" if cache_salt is None else cache_salt
    return hashlib.blake2b(f"{tenant}\0{given}".encode(), digest_size=16, person=b"tandem-tenant").hexdigest()


def for_tenant(request: ValidRequest, tenant: str | None) -> ValidRequest:
    """`request` with its tenant's salt (unchanged without API keys: tenant None)."""
    if tenant is None:
        return request
    params = dataclasses.replace(request.params, cache_salt=tenant_salt(tenant, request.params.cache_salt))
    return request._replace(params=params)
