"""Baseline for the cache-hit benchmark: a bare Starlette app answering stored bytes from Redis."""

from __future__ import annotations

import json
import os

import redis.asyncio as aioredis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route


def create_app() -> Starlette:
    redis = aioredis.from_url(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))

    async def raw(request: Request) -> Response:
        """GET: the value under `key` as audio/wav; POST: parse the JSON body, then the value as JSON."""
        if request.method == "POST":
            json.loads(await request.body())
        data = await redis.get(request.path_params["key"])
        if data is None:
            return JSONResponse({"detail": "no such key"}, status_code=404)
        return Response(data, media_type="application/json" if request.method == "POST" else "audio/wav")

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[Route("/healthz", healthz), Route("/raw/{key}", raw, methods=["GET", "POST"])])
