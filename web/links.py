"""The URLs of a request the service hands out, made by the router from the route records (routes.py).

Webhook events carry the same URLs, made on the worker side (which has no
router) by common/urls.py; tests/test_service.py holds the two to each other.
"""

from __future__ import annotations

from typing import Protocol

from web import routes


class Router(Protocol):
    """What makes a route's path from its name and parameters: a Starlette app or router."""

    def url_path_for(self, name: str, /, **path_params: str) -> str: ...


class Links:
    """A request's URLs, as paths on this service (what the answers carry)."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def status(self, request_id: str) -> str:
        """Where a request's status is: `GET` it, or `DELETE` it to cancel."""
        return str(self.router.url_path_for(routes.STATUS.name, id=request_id))

    def audio(self, request_id: str, fmt: str = "wav") -> str:
        """A request's audio in `fmt`; WAV, the default, needs no query."""
        path = str(self.router.url_path_for(routes.AUDIO.name, id=request_id))
        return path if fmt == "wav" else f"{path}?format={fmt}"

    def captions(self, request_id: str) -> str:
        """A request's timed captions (WebVTT unless asked otherwise)."""
        return str(self.router.url_path_for(routes.CAPTIONS.name, id=request_id))
