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

from cache import Spec, sample_digest
from common import sampling, spoken
from common.model import SAMPLES_PER_TOKEN
from common.scheduling import Place
from engines import kvcache, q4step
from engines.leanstep import LeanStep, supports
from engines.refine import refine
from engines.rowfaults import check_finite, is_out_of_memory
from engines.sampler import Prompt, Row, Sampler, marks, restore

# Tokens of context decoded on each side of a piece, so that its edges sound
# as they would in one decode of the whole chunk (tests/test_loop.py measures
# the joins). ChatTTS's DVAE decoder and Vocos see a few tokens either way.
LOOKAHEAD = 8


# What ChatTTS's `Speaker.decorate_code_prompts` removes from a text: a transcript may not carry them either.
_PROMPT_TOKENS = ("[Stts]", "[spk_emb]", "[empty_spk]")


def row_seed(spec: Spec, chunk_id: str) -> int:
    """The seed of a row's generator: its voice (seed, speaker string or recorded voice) and its chunk, nothing
    else."""
    if spec.sample is not None:
        voice = "sample:" + sample_digest(spec.sample, spec.transcript or "")
    else:
        voice = str(spec.seed) if spec.speaker is None else spec.speaker
    return int(hashlib.sha256(f"{voice}\x00{chunk_id}".encode()).hexdigest()[:8], 16)


def sample_text(chat: Any, transcript: str) -> str:
    """A recorded voice's transcript as its prompt carries it (ChatTTS's `txt_smp`): read by the text front end
    as a row's text is, without the tokens that mark a prompt's parts."""
    text = chat.normalizer(spoken.speak(transcript), True, True, None)
    for token in _PROMPT_TOKENS:
        text = text.replace(token, "")
    return text.strip()


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
        line = sampling.speed_prompt(spec.speed) + text
        if spec.sample is None:
            emb_spk = self.speaker(spec.seed, spec.speaker)
            prompt = chat.speaker.decorate_code_prompts([line], "", None, emb_spk)[0]
            codes = None
        else:
            # A recorded voice, as Chat.infer takes spk_smp and txt_smp: no speaker embedding ([empty_spk]), the
            # transcript before the text, the recording's codes after it.
            emb_spk = None
            prompt = chat.speaker.decorate_code_prompts([line], "", sample_text(chat, spec.transcript or ""), None)[0]
            codes = chat.speaker.decode_prompt(spec.sample)
        processors, warpers = self.sampler.warpers_of(spec.top_p, spec.top_k)
        return Prompt(key, spec, seed, prompt, emb_spk, processors, warpers, place, codes)

    def prefill(self, prompts: Sequence[Prompt]) -> tuple[list[Row], Any]:
        """Prefill rows in one forward and sample their first codes, as GPT.generate's first step does for a
        batch: prompts left-padded to the longest, the mask and position ids over each row's real tokens.

        Changes no state of the loop's; raises RowsNotFinite for rows whose output is not finite.
        """
        torch, chat = self.torch, self.chat
        input_ids, attention_mask, text_mask = self._encode(prompts)
        emb = chat.embed(input_ids, text_mask)
        emb_spk = self._speakers(prompts)
        if emb_spk is not None:
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

    def _encode(self, prompts: Sequence[Prompt]) -> tuple[Any, Any, Any]:
        """The rows' input ids, attention mask and text mask, left-padded to the longest, as ChatTTS's tokenizer
        makes them: for rows without a recorded voice, one `Tokenizer.encode` of them all; with one, each row
        encoded alone with its recording's codes after its text (as `Chat.infer` does with `spk_smp`), then
        padded as that call pads."""
        torch, chat = self.torch, self.chat
        if all(p.codes is None for p in prompts):
            return chat.tokenizer.encode([p.prompt for p in prompts], self.num_vq, prompt=None, device=chat.device_gpt)
        rows = [chat.tokenizer.encode([p.prompt], self.num_vq, prompt=p.codes, device=chat.device_gpt) for p in prompts]
        width = max(int(ids.shape[1]) for ids, _, _ in rows)
        pad = torch.nn.functional.pad
        return (
            torch.cat([pad(ids, (0, 0, width - ids.shape[1], 0)) for ids, _, _ in rows]),
            torch.cat([pad(mask, (width - mask.shape[1], 0)) for _, mask, _ in rows]),
            torch.cat([pad(text, (width - text.shape[1], 0)) for _, _, text in rows]),
        )

    def _speakers(self, prompts: Sequence[Prompt]) -> Any:
        """What `Speaker.apply` writes at the rows' `[spk_emb]` tokens, or None where no row has one.

        One row: its 1-D embedding takes ChatTTS's own Speaker.apply path, as Chat.infer does (a recorded
        voice has none, and Chat.infer applies none). Several: one embedding a row (engines.chattts extends
        Speaker.apply to that, as the static path uses it); a recorded voice's row has no `[spk_emb]` token,
        so zeros stand in for it.
        """
        speakers = [p.speaker for p in prompts]
        if len(prompts) == 1 or all(s is None for s in speakers):
            return speakers[0]
        shape = next(s for s in speakers if s is not None)
        return self.torch.stack([self.torch.zeros_like(shape) if s is None else s for s in speakers])

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
