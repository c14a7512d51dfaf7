"""Credentials kept out of what is printed: URLs as messages, logs and reprs may show them."""

from __future__ import annotations

import re

# Query parameters whose values are credentials (redis-py reads `password`; others are common).
_SECRET_PARAM = re.compile(r"([?&;](?:[^=&;#]*(?:pass|pwd|secret|token|key|auth|cred)[^=&;#]*)=)[^&;#]*", re.IGNORECASE)


def safe_url(url: str) -> str:
    """`url` without its user information and with password-like query values masked.

    Everything before the last "@" of the part after "://" is taken for user
    information, so a password holding "@", "/" or "?" is hidden whole (a
    host is never shown with a piece of one).
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    if "@" in rest:
        rest = "***@" + rest.rsplit("@", 1)[1]
    shown = f"{scheme}{sep}{rest}"
    return _SECRET_PARAM.sub(r"\1***", shown)
