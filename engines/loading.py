"""The engine a worker runs, by `TTS_ENGINE`: loaded and warmed up before it takes jobs."""

from __future__ import annotations

from cache import Spec
from common.model import Engine, ModelInfo, decode_all, decoder_for
from common.settings import Settings
from engines.config import identity
from engines.tone import ToneEngine


def load_engine(settings: Settings) -> tuple[Engine, ModelInfo]:
    """The engine `settings.engine` names, loaded and warmed up."""
    engine: Engine
    if settings.engine == "tone":
        engine, info = (
            ToneEngine(),
            ModelInfo(
                identity({"tone": 1}), "tone", True, "tone", "cpu", speaker_dim=ToneEngine.speaker_dim, codec="tone"
            ),
        )
    else:
        from engines.chattts import load_chattts

        engine, info = load_chattts(settings)
    # The first inference pays for JIT compilation and allocator growth; pay
    # it before taking jobs, not inside the first user's request.
    # Mixed scripts and a character ChatTTS rejects: each path compiles its own
    # numba kernels on first use.
    warm = Spec(chunks=("Warm up, 1!", "预热一下。"), model=info.id)
    decode_all(decoder_for(engine, settings, capacity=2), [("warm-0", warm.row(0)), ("warm-1", warm.row(1))])
    return engine, info
