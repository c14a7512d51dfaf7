"""The baselines the service is measured against, as uvicorn app factories: `bare`, a Starlette app answering
stored bytes from Redis (the floor of a cache hit), and `naive`, a server that synthesizes in-process on every
request (same model; no cache, queue or dedupe)."""

from __future__ import annotations

import asyncio
import json
import logging
import os

import redis.asyncio as aioredis
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route


def bare() -> Starlette:
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


def naive() -> Starlette:
    # Imported here: the bare app's footprint is the floor scenario 7 measures. The repository's root is on
    # sys.path (uvicorn runs as `python -m` from it: spawned.Cluster.start_app).
    from cache import Spec, normalize
    from common import audio
    from common.model import decode_all
    from common.settings import from_env
    from engines.loading import load_engine
    from splitter import split

    logging.basicConfig(level=logging.WARNING)
    settings = from_env()
    engine, info = load_engine(settings)
    lock = asyncio.Lock()

    def synthesize(chunks: tuple[str, ...]) -> bytes:
        spec = Spec(chunks=chunks, model=info.id, seed=settings.default_seed)
        pcm: list[bytes] = []
        rows = [spec.row(i) for i in range(len(chunks))]
        for start in range(0, len(rows), settings.batch_size):
            # One static model call per batch (the engine's static decoder: ChatTTS's own call).
            batch = [(str(i), row) for i, row in enumerate(rows[start : start + settings.batch_size])]
            made = decode_all(engine.decoder(settings.batch_size, settings.stream_tokens, False), batch)
            pcm.extend(audio.to_pcm16(made[key][0].samples) for key, _ in batch)
        return audio.encode(audio.join(pcm), "wav")

    async def speech(request: Request) -> Response:
        body = await request.json()
        chunks = tuple(split(normalize(str(body["input"])), settings.chunk_chars))
        async with lock:
            data = await run_in_threadpool(synthesize, chunks)
        return Response(data, media_type="audio/wav")

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": info.name})

    return Starlette(routes=[Route("/healthz", healthz), Route("/v1/audio/speech", speech, methods=["POST"])])
