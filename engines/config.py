"""What every engine shares: the model identity's revision, ChatTTS's config built fresh, the load error."""

from __future__ import annotations

import copy
import hashlib
import json
import os
from dataclasses import fields, is_dataclass
from typing import Any, Mapping

# Bump when this module changes how text becomes audio for the same model
# (trimming, speaker sampling): it is part of the model identity, so audio
# made the old way stops being served.
ENGINE_REVISION = 2


def identity(payload: Any) -> str:
    """A short hash of `payload` and ENGINE_REVISION: the model id that keys every chunk."""
    data = json.dumps({"revision": ENGINE_REVISION, **payload}, sort_keys=True)
    return hashlib.sha256(data.encode()).hexdigest()[:16]


def host_cores() -> int:
    """The CPU cores this process may run on (its affinity mask, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def torch_threads(configured: int, workers_on_host: int, cores: int) -> int:
    """Torch threads for one worker: `configured` (TTS_TORCH_THREADS) when set, else its share of the cores.

    More threads than free cores make OpenMP's spinning threads fight, so
    workers sharing a host split its cores between them (BENCHMARKS.md,
    scenario 6, measures the choice).
    """
    if configured:
        return configured
    return max(1, cores // max(1, workers_on_host))


class ModelUnavailable(RuntimeError):
    """The configured model cannot be loaded; the message says what to do."""


def chattts_config(overrides: Mapping[str, Any] | None = None) -> Any:
    """A fresh ChatTTS Config with `overrides` (nested dicts) applied.

    ChatTTS's config dataclasses share their sub-config default instances
    between all Config objects, so every level is rebuilt rather than mutated.
    Raises ValueError on an unknown key.
    """
    from ChatTTS.config import Config

    return _fresh(Config(), overrides or {}, "config")


def _fresh(obj: Any, overrides: Mapping[str, Any], where: str) -> Any:
    names = {f.name for f in fields(obj)}
    unknown = set(overrides) - names
    if unknown:
        raise ValueError(f"unknown ChatTTS config keys at {where}: {sorted(unknown)}")
    values = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if is_dataclass(value):
            values[f.name] = _fresh(value, overrides.get(f.name, {}), f"{where}.{f.name}")
        else:
            new = overrides.get(f.name, value)
            values[f.name] = tuple(new) if isinstance(value, tuple) else copy.deepcopy(new)
    return type(obj)(**values)
