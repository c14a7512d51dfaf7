"""ChatTTS's model as a decode loop calls it for its rows: prompts made, rows prefilled and stepped, audio decoded.

Each call follows ChatTTS 0.2.5's own (`Chat.infer`, `GPT.generate`,
`Chat._decode_to_wavs`) operation for operation, on a batch of rows that
each carry their own settings, voice and random stream (engines/sampler.py).
`forward`, `sample` and `draw` are the seams the tests and the bench replace
to inject faults or compare samplers.

Imports torch on construction only; the worker side alone imports engines/.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Sequence

import numpy as np

from cache import Spec
from common import spoken
from common.model import SAMPLES_PER_TOKEN, Place
from engines import kvcache, q4step
from engines.leanstep import LeanStep, supports
from engines.refine import refine
from engines.rowfaults import check_finite, is_out_of_memory
from engines.sampler import Prompt, Row, Sampler, marks, restore

# Tokens of context decoded on each side of a piece, so that its edges sound
# as they would in one decode of the whole chunk (tests/test_loop.py measures
# the joins). ChatTTS's DVAE decoder and Vocos see a few tokens either way.
LOOKAHEAD = 8


def row_seed(spec: Spec, chunk_id: str) -> int:
    """The seed of a row's generator: its voice (seed or speaker string) and its chunk, nothing else."""
    voice = str(spec.seed) if spec.speaker is None else spec.speaker
    return int(hashlib.sha256(f"{voice}\x00{chunk_id}".encode()).hexdigest()[:8], 16)


class RowModel:
    """ChatTTS's text front end, GPT and decoder, called on a decode loop's rows."""

    def __init__(
        self,
        chat: Any,
        speaker: Callable[[int | None, str | None], Any],
        max_new_token: int,
        lookahead: int = LOOKAHEAD,
    ) -> None:
        import torch

        self.torch = torch
        self.chat = chat
        self.speaker = speaker
        self.max_new_token = max_new_token
        self.lookahead = lookahead
        self.sampler = Sampler(chat)
        self.num_vq = self.sampler.num_vq
        # Steps run engines/leanstep.py where it applies; False: transformers' forward always (benches compare).
        self.lean = True
        # Steps of an int4-weight GPT run engines/q4step.c where it builds; False: torch's kernels.
        self.native = True
        self._lean: tuple[Any, bool, LeanStep | None] = (None, True, None)  # (GPT, native, its step)

    def prompt(self, key: str, spec: Spec, place: Place) -> Prompt:
        """The row's prompt, speaker and sampling, made by ChatTTS's text front end before any model call;
        raises whatever the front end raises on its text or voice."""
        chat = self.chat
        seed = row_seed(spec, key)
        text = chat.normalizer(spoken.speak(spec.chunks[0]), True, True, None)
        if spec.refine_text:
            text = refine(chat, spec, [text], seed, self.max_new_token)[0]
        emb_spk = self.speaker(spec.seed, spec.speaker)
        prompt = chat.speaker.decorate_code_prompts([f"[speed_{spec.speed}]{text}"], "", None, emb_spk)[0]
        processors, warpers = self.sampler.warpers_of(spec.top_p, spec.top_k)
        return Prompt(key, spec, seed, prompt, emb_spk, processors, warpers, place)

    def prefill(self, prompts: Sequence[Prompt]) -> tuple[list[Row], Any]:
        """Prefill rows in one forward and sample their first codes, as GPT.generate's first step does for a
        batch: prompts left-padded to the longest, the mask and position ids over each row's real tokens.

        Changes no state of the loop's; raises RowsNotFinite for rows whose output is not finite.
        """
        torch, chat = self.torch, self.chat
        input_ids, attention_mask, text_mask = chat.tokenizer.encode(
            [p.prompt for p in prompts], self.num_vq, prompt=None, device=chat.device_gpt
        )
        emb = chat.embed(input_ids, text_mask)
        # One row: a 1-D embedding takes ChatTTS's own Speaker.apply path, as Chat.infer does; several: one
        # embedding a row (engines.chattts extends Speaker.apply to that, as the static path uses it).
        emb_spk = prompts[0].speaker if len(prompts) == 1 else torch.stack([p.speaker for p in prompts])
        chat.speaker.apply(emb, emb_spk, input_ids, chat.tokenizer.spk_emb_ids, chat.gpt.device_gpt)
        width = int(input_ids.shape[1])
        position_ids = attention_mask.long().cumsum(-1) - 1
        position_ids.masked_fill_(attention_mask.eq(0), 1)
        hidden, cache = self.forward(emb, attention_mask.bool(), position_ids, torch.arange(0, width), None)
        check_finite(hidden)
        lengths = attention_mask.sum(1).tolist()
        joined = [self.sampler.row(p, self.max_new_token, int(n)) for p, n in zip(prompts, lengths)]
        self.sample(joined, hidden)
        return joined, cache

    def step(self, rows: list[Row], cache: Any) -> Any:
        """Forward `rows` (whose cache is `cache`) by their last codes and sample their next; the new cache.

        `cache` itself is left as it was, and so are the rows when this raises.
        """
        torch, chat = self.torch, self.chat
        kept = marks(rows)
        try:
            width = kvcache.width_of(cache)
            last = torch.stack([row.codes[row.made - 1] for row in rows]).unsqueeze(1)  # (B, 1, 4)
            emb = torch.stack([chat.gpt.emb_code[i](last[:, :, i]) for i in range(self.num_vq)], 3).sum(3)
            lengths = torch.tensor([row.length + 1 for row in rows])
            mask = torch.arange(width + 1).unsqueeze(0) >= (width + 1 - lengths).unsqueeze(1)
            positions = (lengths - 1).unsqueeze(1)
            hidden, cache = self.forward(emb, mask, positions, torch.arange(width, width + 1), kvcache.shallow(cache))
            check_finite(hidden)
            for row in rows:
                row.length += 1
            self.sample(rows, hidden)
        except BaseException:
            restore(rows, kept)
            raise
        return cache

    def trial(self, rows: list[Row], cache: Any) -> BaseException | None:
        """Step `rows` (whose cache is `cache`) and put them back as they were; what that raised (None when it
        did not, or when it ran out of memory: no row's own fault)."""
        kept = marks(rows)
        try:
            self.step(rows, cache)
        except Exception as exc:
            return None if is_out_of_memory(exc) else exc
        finally:
            restore(rows, kept)
        return None

    def forward(self, emb: Any, mask: Any, positions: Any, cache_position: Any, cache: Any) -> tuple[Any, Any]:
        """One Llama forward, its inputs cast as GPT.generate casts them; the last position's hidden state.

        A step (one position, a cache) runs `lean_step()` where there is one: the same numbers, without
        transformers' per-call machinery and its copy of the cache to append a column."""
        torch, gpt = self.torch, self.chat.gpt
        # A step of left-padded rows (its mask is on the CPU: no device sync) gets the 4-D mask that
        # transformers would build from the 2-D one, ready: the same mask, without its general builder
        # (create_causal_mask), a visible part of a small model's step. Without padding, the 2-D mask
        # as upstream passes it, which lets attention skip the mask.
        padded = emb.shape[1] == 1 and not bool(mask.all())
        inputs = gpt._GenerationInputs(
            position_ids=positions, cache_position=cache_position, attention_mask=mask, inputs_embeds=emb
        )
        inputs.to(gpt.device_gpt, gpt.gpt.dtype)
        if padded:
            inputs.attention_mask = inputs.attention_mask.bool()[:, None, None, :]
        lean = self.lean_step() if emb.shape[1] == 1 and cache is not None else None
        if lean is not None:
            # CastingLlama casts the embeddings to its inner model's dtype; a plain LlamaModel takes them as cast.
            embeds = inputs.inputs_embeds.to(getattr(gpt.gpt, "inner_dtype", inputs.inputs_embeds.dtype))
            hidden = lean(embeds, inputs.position_ids, inputs.attention_mask if padded else None, cache)
            return hidden.to(gpt.device, dtype=torch.float), cache
        outputs = gpt.gpt(
            attention_mask=inputs.attention_mask,
            position_ids=inputs.position_ids,
            past_key_values=cache,
            inputs_embeds=inputs.inputs_embeds,
            use_cache=True,
            output_attentions=False,
            cache_position=inputs.cache_position,
        )
        hidden = outputs.last_hidden_state.to(gpt.device, dtype=torch.float)
        return hidden, outputs.past_key_values

    def lean_step(self) -> LeanStep | None:
        """The lean step (engines/leanstep.py) of the chat's GPT as it is now; None where steps run transformers'
        forward: a GPT on another device than the CPU, compiled, or one LeanStep does not reproduce."""
        if not self.lean:
            return None
        gpt = self.chat.gpt.gpt
        if self._lean[0] is not gpt or self._lean[1] != self.native:
            inner = getattr(gpt, "inner", gpt)
            compiled = getattr(gpt, "_forward", inner) is not inner
            usable = self.chat.gpt.device_gpt.type == "cpu" and not compiled and supports(inner)
            native = q4step.for_llama(inner) if usable and self.native else None
            self._lean = (gpt, self.native, LeanStep(inner, native) if usable else None)
        return self._lean[2]

    def sample(self, rows: Sequence[Row], hidden: Any) -> None:
        """Sample each row's next codes from the last position of `hidden` (rows, positions, dim)."""
        self.sampler.sample(rows, hidden, self.draw)

    def draw(self, rows: Sequence[Row], probs: Any) -> Any:
        """One code per line of `probs` (rows * num_vq lines, in row order), each row from its own noise
        (Sampler.draw)."""
        return self.sampler.draw(rows, probs)

    def decode(self, hiddens: Sequence[Any], start: int, end: int, last: bool) -> np.ndarray:
        """Samples of tokens [start, end) of a row, decoded with `lookahead` tokens of context each side.

        A clip of T tokens has 512*T - 256 samples (the vocoder's centre
        padding): the last piece of a row stops there.
        """
        if end <= start:
            return np.zeros(0, dtype=np.float32)
        first = max(0, start - self.lookahead)
        stop = len(hiddens) if last else min(len(hiddens), end + self.lookahead)
        window = self.torch.stack(list(hiddens[first:stop]))
        wav = np.asarray(self.chat._decode_to_wavs([window], True)[0], dtype=np.float32)
        a = SAMPLES_PER_TOKEN * (start - first)
        b = SAMPLES_PER_TOKEN * (end - first) - (SAMPLES_PER_TOKEN // 2 if last else 0)
        return wav[a:b]
