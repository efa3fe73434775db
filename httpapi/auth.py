"""API-key check: `Authorization: Bearer <key>`, compared in constant time."""

from __future__ import annotations

import hmac

from httpapi.errors import unauthorized


def check_api_key(authorization: str | None, api_key: str | None) -> None:
    """Raises APIError(401) unless `authorization` (the header's value, as starlette gives
    it: latin-1 text) carries `api_key`. No key configured: every request passes."""
    if api_key is None:
        return
    scheme, _, token = (authorization or "").partition(" ")
    # latin-1 gives back the header's raw bytes; keys are configured as UTF-8 text
    sent = token.strip().encode("latin-1", "replace")
    if scheme.lower() != "bearer" or not hmac.compare_digest(sent, api_key.encode()):
        raise unauthorized()
