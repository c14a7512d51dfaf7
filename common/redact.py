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


# The same parameters inside a line of text (a quoted request path): a value ends at white space or a quote too.
_SECRET_PARAM_IN_TEXT = re.compile(
    r"([?&;](?:[^=&;#\s\"']*(?:pass|pwd|secret|token|key|auth|cred)[^=&;#\s\"']*)=)[^&;#\s\"']*", re.IGNORECASE
)


def hide_query_secrets(text: str) -> str:
    """`text` with the values of password-like query parameters (`?api_key=`, `&token=`) masked wherever they occur."""
    return _SECRET_PARAM_IN_TEXT.sub(r"\1***", text) if "=" in text else text
