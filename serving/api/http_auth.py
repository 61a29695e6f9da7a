"""API keys for the OpenAI routes, and the prefix-cache salt each request runs under.

With `--api_key` set, every `/v1/*` route, `/internal/prefill` and the
profiling routes need `Authorization: Bearer <key>` with one of the keys;
anything else is a 401 in OpenAI's error envelope (`invalid_api_key`).
`/health` and `/metrics` stay open, as load balancers and Prometheus expect,
and `/internal/decode` is authenticated by the payload's signature instead
(`serving.disaggregation.kv_wire`).

The salt a request's prefix-cache pages are named under (`cache_salt`, see
`serving.core.block_manager`) is the client's own `cache_salt` field; with
`--cache_salt_per_api_key` it is also bound to the key the request came with,
so tenants holding different keys never share cached pages, whatever salt
they send. (A client that names another tenant's salt cannot reach that
tenant's pages either: its salt always starts with its own key's digest.)
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Optional, Sequence

from fastapi import Request

from serving.api import http_protocol as P
from serving.core.block_manager import is_cache_salt


class APIKeys:
    """The keys a server accepts (none: every route is open) and how they salt the prefix cache."""

    def __init__(self, keys: Sequence[str] = (), salt_per_key: bool = False):
        self.keys = [k.encode("utf-8") for k in keys if k]
        if salt_per_key and not self.keys:
            raise ValueError("--cache_salt_per_api_key needs --api_key")
        self.salt_per_key = salt_per_key

    @classmethod
    def parse(cls, spec: Optional[str], salt_per_key: bool = False) -> "APIKeys":
        """From a comma-separated list of keys (the flag's or the environment's value)."""
        return cls([k.strip() for k in (spec or "").split(",") if k.strip()], salt_per_key)

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    async def require(self, request: Request) -> None:
        """A FastAPI dependency: refuses a request without a valid key (401); remembers the key it used."""
        request.state.api_key = None
        if not self.keys:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, given = auth.partition(" ")
        self._check(request, given, scheme.lower() == "bearer")

    async def require_anthropic(self, request: Request) -> None:
        """`require`, with the key also taken from `x-api-key` (how Anthropic's clients send it)."""
        request.state.api_key = None
        if self.keys and "x-api-key" in request.headers and "authorization" not in request.headers:
            self._check(request, request.headers["x-api-key"], True)
        else:
            await self.require(request)

    def _check(self, request: Request, given: str, scheme_ok: bool) -> None:
        given_bytes = given.strip().encode("utf-8")
        # Compare against every key, in constant time each, so timing tells nothing about which matched.
        ok = False
        for key in self.keys:
            ok |= hmac.compare_digest(given_bytes, key)
        if not scheme_ok or not ok:
            raise P.APIError("Incorrect API key provided: send one of this server's keys as "
                             "'Authorization: Bearer <key>'.", status=401, code="invalid_api_key")
        request.state.api_key = given.strip()

    def cache_salt(self, request: Request, client_salt: Optional[str]) -> Optional[str]:
        """The salt a request's cached pages are named under."""
        if client_salt is not None and not is_cache_salt(client_salt):
            raise P.APIError("cache_salt must be a non-empty string", param="cache_salt", code="invalid_value")
        key = getattr(request.state, "api_key", None)
        if not self.salt_per_key or key is None:
            return client_salt
        tenant = hashlib.sha256(b"ridgeline api key\0" + key.encode("utf-8")).hexdigest()[:32]
        return f"api-key:{tenant}" + (f"/{client_salt}" if client_salt is not None else "")
