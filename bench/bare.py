"""Baseline for the cache-hit benchmark: a bare Starlette app answering stored bytes from Redis.

    REDIS_URL=... uvicorn bare:create_app --factory --app-dir bench

`GET /raw/{key}` answers the value under `key` as audio/wav; `POST /raw/{key}`
reads and parses the JSON body, then answers the value under `key` as JSON.
One Redis round trip each (`redis.asyncio`, as the service uses), no
validation, no headers beyond the framework's: the floor a cache hit of the
real service is compared with. The benchmark stores the service's own
answers under the keys, so both return the same bytes.
"""

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

    async def get(request: Request) -> Response:
        data = await redis.get(request.path_params["key"])
        if data is None:
            return JSONResponse({"detail": "no such key"}, status_code=404)
        return Response(data, media_type="audio/wav")

    async def post(request: Request) -> Response:
        json.loads(await request.body())
        data = await redis.get(request.path_params["key"])
        if data is None:
            return JSONResponse({"detail": "no such key"}, status_code=404)
        return Response(data, media_type="application/json")

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    return Starlette(
        routes=[
            Route("/healthz", healthz, methods=["GET"]),
            Route("/raw/{key}", get, methods=["GET"]),
            Route("/raw/{key}", post, methods=["POST"]),
        ]
    )
