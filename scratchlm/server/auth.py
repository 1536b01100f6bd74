"""The API-key rule, one function for every route that needs the key (the API under /v1, /tokenize and
/detokenize in the guard middleware, the inspector's /inspector/events and /inspector/snapshot).

``Authorization: Bearer KEY``: the scheme is matched case-insensitively (RFC 7235 section 2.1: ``bearer`` and
``BEARER`` name the same scheme) and separated from the key by one or more spaces; the key is compared exactly,
byte for byte, in constant time (``hmac.compare_digest``). Anything else (no header, another scheme, no key, a
wrong key) is refused.
"""

from __future__ import annotations

import hmac


def authorization_ok(header: str | bytes | None, api_key: str) -> bool:
    """Whether the ``Authorization`` header value `header` (raw bytes, or the latin-1 text a framework decoded them
    to) carries `api_key` under the Bearer scheme."""
    if header is None:
        return False
    raw = header.encode("latin-1", "replace") if isinstance(header, str) else header
    scheme, _, token = raw.strip().partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), api_key.encode("utf-8"))
