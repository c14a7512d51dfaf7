"""ChatTTS behind the jobs' Engine interface: loaded once, tuned; a continuous decode loop or static calls.

The only module (with tuning and fidelity beside it) that imports torch and
ChatTTS, and only inside functions; the web process never imports engines/.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

import numpy as np

from cache import Spec, sample_digest
from common import sampling, spoken
from common.model import SAMPLES_PER_TOKEN, Decoder, ModelInfo, token_budget
from common.scheduling import Place
from common.settings import Settings
from engines import homophones
from engines.config import ModelUnavailable, chattts_config, host_cores, identity, torch_threads
from engines.decoders import StaticDecoder
from engines.refine import refine

if TYPE_CHECKING:
    from engines.loop import ChatTTSLoop

logger = logging.getLogger("engine")
F = TypeVar("F", bound=Callable[..., Any])

HUB_NAME = "2Noise/ChatTTS"


def _import_chattts() -> Any:
    try:
        import ChatTTS
    except OSError as exc:
        if "torchaudio" in str(exc):
            raise ModelUnavailable(
                "torchaudio's native libraries failed to load (the PyPI wheel is a CUDA build; "
                "ChatTTS needs only its pure-Python parts). Run `make install`, which removes "
                "torchaudio/lib/*.so from the virtualenv, or delete those files yourself."
            ) from exc
        raise
    cache_normalizer_jit()
    homophones.install(ChatTTS.norm)
    return ChatTTS


def cache_normalizer_jit() -> None:
    """Keep the machine code of ChatTTS's numba-compiled text helpers on disk.

    ChatTTS's normalizer declares them `@jit(nopython=True)` without `cache=True`, so every
    process compiles them again on its first sentence (seconds of CPU at each worker start).
    With caching on, numba stores them in `__pycache__` beside ChatTTS's sources, or in
    `NUMBA_CACHE_DIR`, or the user's cache folder, keyed by the source file and the argument
    types; where none of them is writable numba refuses (RuntimeError) and the process compiles
    as before.
    """
    from ChatTTS import norm

    for name, value in vars(norm).items():
        if callable(getattr(value, "enable_caching", None)):
            try:
                value.enable_caching()
            except RuntimeError as exc:
                logger.info("ChatTTS's %s is compiled at each start: %s", name, exc)


def _inference(method: F) -> F:
    """Run `method` under torch.inference_mode: no autograd records, no version counters.

    Imports torch on call, so that importing this module does not.
    """

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        import torch

        with torch.inference_mode():
            return method(*args, **kwargs)

    return run  # type: ignore[return-value]


class ChatTTSEngine:
    """ChatTTS behind the jobs' one-method Engine interface (and the VoiceBank one)."""

    def __init__(self, chat: Any, max_new_token: int) -> None:
        self.chat = chat
        self.max_new_token = max_new_token
        chat.speaker.apply = _apply_speakers(chat.speaker.apply)

    @lru_cache(maxsize=256)  # noqa: B019 (one engine per process, alive as long as the process)
    def _speaker(self, seed: int | None, speaker: str | None) -> Any:
        import torch

        if speaker is not None:
            return torch.from_numpy(self.chat.speaker._decode(speaker)).float()
        # Sampled on the CPU whatever the device, so a seed names the same
        # voice on every machine.
        generator = torch.Generator(device="cpu").manual_seed(int(seed or 0))
        std = self.chat.speaker.std.float().cpu()
        mean = self.chat.speaker.mean.float().cpu()
        return torch.randn(std.shape[0], generator=generator) * std + mean

    @_inference
    def speaker(self, seed: int) -> str:
        """The speaker string of `seed`'s voice: the same embedding synthesis uses for the seed."""
        return self.chat.speaker._encode(self._speaker(seed, None))

    @_inference
    def encode_sample(self, samples: np.ndarray) -> str:
        """The speaker prompt of a recording (float32 mono, 24 kHz): ChatTTS's own `Chat.sample_audio_speaker`,
        its DVAE encoder's codes."""
        return str(self.chat.sample_audio_speaker(np.ascontiguousarray(samples, dtype=np.float32)))

    def decoder(self, capacity: int, stream_tokens: int, continuous: bool, reserve: int = 0) -> Decoder:
        """The continuous loop (engines/loop.py, parking up to `reserve` rows), or static calls of `synthesize`;
        both in inference mode."""
        if not continuous:
            return StaticDecoder(self.synthesize, capacity)
        return _InferenceDecoder(self.loop(capacity, stream_tokens, reserve=reserve))

    def loop(
        self, capacity: int, stream_tokens: int, reserve: int = 0, clock: Callable[[], float] = time.monotonic
    ) -> ChatTTSLoop:
        """A continuous decode loop on this engine's model (engines/loop.py), called outside inference mode
        (the caller enters it): `decoder` wraps it; tests and benches drive it bare."""
        from engines.loop import ChatTTSLoop
        from engines.rowmodel import RowModel

        model = RowModel(self.chat, self._speaker, self.max_new_token)
        return ChatTTSLoop(model, capacity, stream_tokens, clock=clock, reserve=reserve)

    @_inference
    def synthesize(self, rows: Sequence[Spec]) -> list[np.ndarray]:
        """One model call for `rows` (one-chunk Specs), trimmed to each row's generated length; one call for
        each recorded voice among them.

        Rows may differ in text, voice and speed: each row's speaker embedding
        goes into its own `[spk_emb]` position (ChatTTS 0.2.5 writes one
        embedding into every row; `_apply_speakers` below gives each its own)
        and its speed prompt leads its own text. ChatTTS takes one recorded
        voice (`spk_smp`, `txt_smp`) a call, so the rows of each recorded
        voice are a call of their own. The sampling settings (temperature,
        top_p, top_k, refine) apply to the whole call, so the rows must share
        `Spec.batch_key()`; ValueError otherwise.

        This follows `Chat.infer(split_text=False)` step by step (ChatTTS
        0.2.5, pinned) instead of calling it, because `infer` pads a batch to
        its longest item and then drops every sample with |x| <= 1e-5: shorter
        items keep the decoded padding as a noisy tail. Knowing each item's
        token count T, its audio is exactly the first 512*T - 256 samples.
        """
        if not rows:
            return []
        first = rows[0]
        if any(row.batch_key() != first.batch_key() for row in rows):
            raise ValueError("rows of one model call must share their sampling settings (Spec.batch_key)")
        calls: dict[tuple[str | None, str | None], list[int]] = {}
        for i, row in enumerate(rows):
            calls.setdefault((row.sample, row.transcript), []).append(i)
        out: list[np.ndarray] = [np.zeros(0, np.float32)] * len(rows)
        for indexes in calls.values():
            for i, wav in zip(indexes, self._call([rows[i] for i in indexes])):
                out[i] = wav
        return out

    def _call(self, rows: Sequence[Spec]) -> list[np.ndarray]:
        """`synthesize` for rows that share their sampling settings and their recorded voice, if any."""
        import torch

        from engines.rowmodel import sample_text

        first = rows[0]
        chat = self.chat
        # One seed per call: the random stream a row samples from depends on
        # its batch mates anyway (ChatTTS seeds one generator per call).
        seed = _voice_seed(first)
        if first.sample is None:
            voice: dict[str, Any] = {"spk_emb": torch.stack([self._speaker(row.seed, row.speaker) for row in rows])}
        else:
            # As Chat.infer takes a recorded voice: its codes and transcript, no speaker embedding.
            voice = {"spk_smp": first.sample, "txt_smp": sample_text(chat, first.transcript or "")}
        budgets = [token_budget(row.chunks[0], self.max_new_token) for row in rows]
        # Fresh params every call: ChatTTS's defaults are shared mutable objects.
        params = chat.InferCodeParams(
            prompt="",
            temperature=first.temperature,
            top_P=first.top_p,
            top_K=first.top_k,
            max_new_token=max(budgets),
            manual_seed=seed,
            show_tqdm=False,
            **voice,
        )
        chat.context.set(False)
        # ChatTTS deletes digits and symbols it has no reading for: spell them out first.
        normed = [chat.normalizer(spoken.speak(row.chunks[0]), True, True, None) for row in rows]
        if first.refine_text:
            normed = refine(chat, first, normed, seed, self.max_new_token)
        texts = [sampling.speed_prompt(row.speed) + text for row, text in zip(rows, normed)]
        result = next(chat._infer_code(texts, False, chat.device, True, params))
        lengths = [min(int(h.size(0)), budget) for h, budget in zip(result.hiddens, budgets)]
        wavs = chat._decode_to_wavs([h[:n] for h, n in zip(result.hiddens, lengths)], True)
        result.destroy()
        return [
            np.asarray(wavs[i, : max(0, SAMPLES_PER_TOKEN * n - SAMPLES_PER_TOKEN // 2)], dtype=np.float32)
            for i, n in enumerate(lengths)
        ]


class _InferenceDecoder:
    """A Decoder whose every call runs under torch.inference_mode."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    @property
    def capacity(self) -> int:
        return int(self.inner.capacity)

    @_inference
    def join(self, rows: Sequence[tuple[str, Spec]], places: Sequence[Place] | None = None) -> None:
        self.inner.join(rows, places)

    @_inference
    def step(self) -> list[Any]:
        return self.inner.step()

    @_inference
    def leave(self, keys: Any) -> None:
        self.inner.leave(keys)

    def keys(self) -> list[str]:
        return self.inner.keys()

    def take_returned(self) -> list[str]:
        return self.inner.take_returned()

    def preemptible(self) -> int:
        return self.inner.preemptible()


def _voice_seed(row: Spec) -> int:
    """The sampling seed of a call led by `row`: its seed, or a number drawn from its speaker string or its
    recorded voice."""
    if row.sample is not None:
        return int(sample_digest(row.sample, row.transcript or "")[:8], 16)
    if row.speaker is None:
        return int(row.seed or 0)
    return int(hashlib.sha256(row.speaker.encode()).hexdigest()[:8], 16)


def _apply_speakers(original: Any) -> Any:
    """ChatTTS's `Speaker.apply`, extended to a (rows, dim) tensor: one embedding per row.

    Each row's embedding is L2-normalized on its own, as ChatTTS normalizes
    its single one, and written where that row's input is `[spk_emb]`. A 1-D
    embedding goes to ChatTTS's own code unchanged.
    """
    import torch
    import torch.nn.functional as F

    @torch.inference_mode()
    def apply(emb: Any, spk_emb: Any, input_ids: Any, spk_emb_ids: int, device: Any, inplace: bool = True) -> Any:
        if not isinstance(spk_emb, torch.Tensor) or spk_emb.dim() != 2:
            return original(emb, spk_emb, input_ids, spk_emb_ids, device, inplace)
        if spk_emb.size(0) != emb.size(0):
            raise ValueError(f"{spk_emb.size(0)} speaker embeddings for {emb.size(0)} rows")
        n = F.normalize(spk_emb, p=2.0, dim=1, eps=1e-12).to(device=device, dtype=emb.dtype)
        n = n.unsqueeze(1).expand(emb.shape)
        cond = input_ids.narrow(-1, 0, 1).eq(spk_emb_ids).expand(emb.shape)
        return torch.where(cond, n, emb, out=emb if inplace else None)

    return apply


def _select_device(setting: str) -> Any:
    import torch

    if setting == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


def _resolve_model_path(settings: Settings, chat: Any) -> Path:
    """The asset directory to load: configured, from the hub, or the tiny fallback."""
    if settings.model_path is not None:
        return Path(settings.model_path)
    hub = chat.download_models(source="huggingface")
    if hub is not None:
        return Path(hub)
    if settings.fallback_model_path is None:
        raise ModelUnavailable(
            f"the real ChatTTS weights could not be had from the Hugging Face hub ({HUB_NAME}) "
            "and TTS_MODEL_PATH is not set: make the hub reachable, or point TTS_MODEL_PATH "
            "at a local asset directory"
        )
    fallback = Path(settings.fallback_model_path)
    logger.warning(
        "REAL CHATTTS WEIGHTS UNAVAILABLE (hub %s unreachable and TTS_MODEL_PATH unset): "
        "running on the tiny random checkpoint at %s. It speaks noise.",
        HUB_NAME,
        fallback,
    )
    if not (fallback / "model.json").exists():
        from engines import tiny_checkpoint

        tiny_checkpoint.write(fallback)
    return fallback


def load_chattts(settings: Settings) -> tuple[ChatTTSEngine, ModelInfo]:
    """Load ChatTTS as `settings` say and warm it up. Raises ModelUnavailable."""
    ChatTTS = _import_chattts()  # noqa: N806 (the package's own name)
    import torch

    from engines import q4step, tuning

    threads = torch_threads(settings.torch_threads, settings.workers_on_host, host_cores())
    torch.set_num_threads(threads)
    logger.info(
        "%d torch thread(s) (%d core(s), %d worker(s) on this host; TTS_TORCH_THREADS overrides)",
        threads,
        host_cores(),
        settings.workers_on_host,
    )
    chat = ChatTTS.Chat(logging.getLogger("chattts"))
    path = _resolve_model_path(settings, chat)
    manifest_path = path / "model.json"
    manifest: dict[str, Any] = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    try:
        chat.config = chattts_config(manifest.get("config"))
    except ValueError as exc:
        raise ModelUnavailable(f"{manifest_path}: {exc}") from exc
    if "sha256" in manifest:
        chat.sha256_map = manifest["sha256"]
    device = _select_device(settings.device)
    try:
        tuned = tuning.resolve(settings, device, int(chat.config.gpt.hidden_size))
    except tuning.TuningError as exc:
        raise ModelUnavailable(str(exc)) from exc
    if not chat.load(source="custom", custom_path=str(path), compile=False, device=device):
        raise ModelUnavailable(
            f"ChatTTS could not load {path}: files missing or failing their SHA-256 check (see the log above)"
        )
    tuning.fold_weight_norm(chat)
    try:
        tuning.apply(chat, tuned, settings.native_step)
    except q4step.NativeUnavailable as exc:
        raise ModelUnavailable(str(exc)) from exc
    max_new_token = min(settings.max_new_token, int(manifest.get("max_new_token", settings.max_new_token)))
    name = manifest.get("name", HUB_NAME)
    info = ModelInfo(
        id=identity(
            {
                "sha256": chat.sha256_map,
                "config": manifest.get("config"),
                "max_new_token": max_new_token,
                "spoken": spoken.IDENTITY,
                "tuning": tuned.identity(),
            }
        ),
        name=name,
        tiny=bool(manifest.get("tiny", False)),
        engine="chattts",
        device=str(device),
        speaker_dim=int(chat.speaker.std.shape[0]),
        codec=_codec(chat),
    )
    return ChatTTSEngine(chat, max_new_token), info


def _codec(chat: Any) -> str:
    """What turns a recording into this model's speaker prompts: its DVAE (whose encoder makes the codes) and
    the codes' shape the GPT reads."""
    return identity(
        {
            "dvae": chat.sha256_map["sha256_asset_DVAE_safetensors"],
            "num_vq": int(chat.config.gpt.num_vq),
            "num_audio_tokens": int(chat.config.gpt.num_audio_tokens),
        }
    )
