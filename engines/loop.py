"""ChatTTS's GPT decode as a loop that rows join and leave between steps (continuous batching).

Rows that join together are prefilled together (exactly as `GPT.generate`
prefills a batch: left-padded to the longest prompt; a row that joins alone,
as it prefills a batch of one), and their KV cache is merged into the
running batch's: the batch cache is left-padded to its longest row, each
row's real positions right-aligned, and
the attention mask and position ids say which columns are real. A step feeds
every row its last token (one Llama forward), samples each row's next four
codes with the row's own settings and random stream, and drops the columns no
row uses any more. A row ends at its end token or at its token budget
(`common.model.token_budget`).

Sampling follows `GPT.generate` (ChatTTS 0.2.5) operation for operation:
logits / temperature, repetition penalty 1.05 over the last 16 codes, top-p,
top-k, softmax, multinomial from a generator re-seeded with the row's seed
every step (ChatTTS re-seeds its one generator every step when given a
`manual_seed`), the whole batch's draws in one call (`_draw`). A row alone
in the loop therefore makes the very tokens that
`Chat.infer(split_text=False)` makes with `manual_seed=row_seed(spec)`.

Every `stream_tokens` tokens (and at its end) a row's new audio is decoded
with `lookahead` tokens of context on both sides and handed out as a Piece.

Slots (`_balance`): the loop steps the `capacity` best placed rows
(`common.model.Place`: the pool's fair order) and takes up to `reserve` first
rows beyond them, one for each later row stepping (`preemptible`). A row
placed worse than `capacity` others is parked: it leaves the batch with its
KV cache (its real positions), codes and noise kept, and merges back, best
placed first, when a slot frees. Nothing a row samples depends on when it
steps, so a parked row makes the codes it makes unparked.

Imports torch on construction only; the worker side alone imports engines/.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from cache import Spec
from common import audio
from common.model import SAMPLES_PER_TOKEN, Piece, Place, token_budget
from engines import spoken
from engines.refine import refine

# Tokens of context decoded on each side of a piece, so that its edges sound
# as they would in one decode of the whole chunk (tests/test_loop.py measures
# the joins). ChatTTS's DVAE decoder and Vocos see a few tokens either way.
LOOKAHEAD = 8
# ChatTTS's repetition penalty (InferCodeParams' default) and its window.
REPETITION_PENALTY = 1.05
# The codes the repetition penalty looks back over (ChatTTS's gen_logits: 16).
PAST_WINDOW = 16


def row_seed(spec: Spec, chunk_id: str) -> int:
    """The seed of a row's generator: its voice (seed or speaker string) and its chunk, nothing else."""
    voice = str(spec.seed) if spec.speaker is None else spec.speaker
    return int(hashlib.sha256(f"{voice}\x00{chunk_id}".encode()).hexdigest()[:8], 16)


@dataclass
class _Row:
    key: str
    seed: int
    budget: int
    temperature: Any  # tensor (4, 1), as GPT.generate divides
    # ChatTTS's logits processors (the repetition penalty: they read the row's
    # history) and warpers (top_p, top_k: they read only the scores), and the
    # key of the warpers, which rows sharing it apply in one call.
    processors: list[Callable[[Any, Any], Any]]
    warpers: list[Callable[[Any, Any], Any]]
    warp_key: tuple[float, int]
    noise: Any  # (num_vq, num_audio_tokens): the Exp(1) draws of its generator (ChatTTSLoop._draw)
    codes: Any  # (budget, 4) long: the codes sampled so far
    length: int  # real positions in the KV cache
    hiddens: list[Any] = field(default_factory=list)
    place: Place = Place(0, 0)
    # While parked: its KV cache, a batch of one with its real positions only.
    parked: Any = None
    made: int = 0  # codes sampled (a row ends before adding its end token)
    sent: int = 0  # tokens handed out in pieces
    pieces: int = 0
    done: bool = False


class ChatTTSLoop:
    """Continuous batching over ChatTTS's GPT: up to `capacity` rows, each with its own sampling and random stream."""

    def __init__(
        self,
        chat: Any,
        speaker: Callable[[int | None, str | None], Any],
        max_new_token: int,
        capacity: int,
        stream_tokens: int,
        lookahead: int = LOOKAHEAD,
        reserve: int = 0,
    ) -> None:
        import torch
        from ChatTTS.model.processors import gen_logits

        self.torch = torch
        self.chat = chat
        self.speaker = speaker
        self.max_new_token = max_new_token
        self.capacity = capacity
        self.reserve = reserve
        self.stream_tokens = stream_tokens
        self.lookahead = lookahead
        self.num_vq = int(chat.config.gpt.num_vq)
        self.eos = int(chat.config.gpt.num_audio_tokens) - 1
        self.gen_logits = gen_logits
        self.min_new_token = chat.InferCodeParams().min_new_token
        self._rows: list[_Row] = []  # in batch order
        self._ended: list[_Row] = []  # ended at their first token: never in the batch
        self._parked: list[_Row] = []  # held, their state kept, but not stepping (`_balance`)
        self._joined = 0  # rows joined so far: the default places' order
        self._cache: Any = None
        self._warpers: dict[tuple[float, int], tuple[list[Any], list[Any]]] = {}
        # Rows per step (keys), and each ended row's codes and hidden states
        # when `record` is set: for the tests and the bench, never in service.
        self.steps: list[list[str]] = []
        self.record: dict[str, tuple[Any, list[Any]]] | None = None

    # -- joining -------------------------------------------------------------

    def join(self, rows: Sequence[tuple[str, Spec]], places: Sequence[Place] | None = None) -> None:
        """Prefill `rows` together (one forward, left-padded as ChatTTS pads a batch), sample each one's first
        codes, and add those that did not end at once to the running batch; then the worst placed rows beyond
        `capacity` are parked (`_balance`). `places`: default, first rows in the order given."""
        room = max(0, self.capacity - len(self.keys())) + self.preemptible()
        if len(rows) > room:
            raise ValueError(f"{len(rows)} rows do not fit in the {room} free slot(s) of {self.capacity}")
        if not rows:
            return
        if places is None:
            places = [Place(0, self._joined + i) for i in range(len(rows))]
        self._joined += len(rows)
        joined, cache = self._prefill(rows)
        for row, place in zip(joined, places):
            row.place = place
        for row in joined:
            if row.done:
                self._ended.append(row)
        going = [i for i, row in enumerate(joined) if not row.done]
        if going:
            if len(going) < len(joined):
                cache = self._select(cache, going)
            self._merge([joined[i] for i in going], cache)
        self._balance()

    def _prefill(self, rows: Sequence[tuple[str, Spec]]) -> tuple[list[_Row], Any]:
        """Prefill rows in one forward and sample their first codes, as GPT.generate's first step does for a
        batch: prompts left-padded to the longest, the mask and position ids over each row's real tokens."""
        torch, chat = self.torch, self.chat
        seeds = [row_seed(spec, key) for key, spec in rows]
        prompts, speakers = [], []
        for (_, spec), seed in zip(rows, seeds):
            text = chat.normalizer(spoken.speak(spec.chunks[0]), True, True, None)
            if spec.refine_text:
                text = refine(chat, spec, [text], seed, self.max_new_token)[0]
            emb_spk = self.speaker(spec.seed, spec.speaker)
            speakers.append(emb_spk)
            prompts += chat.speaker.decorate_code_prompts([f"[speed_{spec.speed}]{text}"], "", None, emb_spk)
        input_ids, attention_mask, text_mask = chat.tokenizer.encode(
            prompts, self.num_vq, prompt=None, device=chat.device_gpt
        )
        emb = chat.embed(input_ids, text_mask)
        # One row: a 1-D embedding takes ChatTTS's own Speaker.apply path, as Chat.infer does; several: one
        # embedding a row (engines.chattts extends Speaker.apply to that, as the static path uses it).
        emb_spk = speakers[0] if len(rows) == 1 else torch.stack(speakers)
        chat.speaker.apply(emb, emb_spk, input_ids, chat.tokenizer.spk_emb_ids, chat.gpt.device_gpt)
        width = int(input_ids.shape[1])
        position_ids = attention_mask.long().cumsum(-1) - 1
        position_ids.masked_fill_(attention_mask.eq(0), 1)
        hidden, cache = self._forward(emb, attention_mask.bool(), position_ids, torch.arange(0, width), None)
        lengths = attention_mask.sum(1).tolist()
        joined = []
        for (key, spec), seed, length in zip(rows, seeds, lengths):
            processors, warpers = self._warpers_of(spec.top_p, spec.top_k)
            row = _Row(
                key=key,
                seed=seed,
                budget=token_budget(spec.chunks[0], self.max_new_token),
                temperature=torch.tensor([spec.temperature] * self.num_vq, device=chat.device).view(-1, 1),
                processors=processors,
                warpers=warpers,
                warp_key=(spec.top_p, spec.top_k),
                noise=None,
                codes=None,
                length=int(length),
            )
            row.codes = torch.zeros(row.budget, self.num_vq, dtype=torch.long, device=chat.device)
            row.noise = self._noise(row)
            joined.append(row)
        self._sample(joined, hidden)
        return joined, cache

    def _warpers_of(self, top_p: float, top_k: int) -> tuple[list[Any], list[Any]]:
        """ChatTTS's (processors, warpers) for these settings, as GPT.generate makes them (one set per key)."""
        if (top_p, top_k) not in self._warpers:
            warpers, processors = self.gen_logits(
                num_code=self.eos, top_P=top_p, top_K=top_k, repetition_penalty=REPETITION_PENALTY
            )
            self._warpers[(top_p, top_k)] = (processors, warpers)
        return self._warpers[(top_p, top_k)]

    def _merge(self, rows: list[_Row], cache: Any) -> None:
        """Add prefilled rows' cache to the batch's, left-padding whichever is shorter."""
        torch = self.torch
        if self._cache is None:
            self._cache, self._rows = cache, list(rows)
            return
        width = self._width()
        total = max(width, int(cache.layers[0].keys.shape[2]))
        for mine, theirs in zip(self._cache.layers, cache.layers):
            for name in ("keys", "values"):
                a, b = getattr(mine, name), getattr(theirs, name)
                a = torch.nn.functional.pad(a, (0, 0, total - a.shape[2], 0))
                b = torch.nn.functional.pad(b, (0, 0, total - b.shape[2], 0))
                setattr(mine, name, torch.cat([a, b], dim=0))
        self._rows += rows

    def _select(self, cache: Any, indices: list[int]) -> Any:
        """`cache` with only these batch rows."""
        index = self.torch.tensor(indices)
        for layer in cache.layers:
            for name in ("keys", "values"):
                setattr(layer, name, getattr(layer, name).index_select(0, index))
        return cache

    def _width(self) -> int:
        return int(self._cache.layers[0].keys.shape[2]) if self._cache is not None else 0

    # -- stepping ------------------------------------------------------------

    def step(self) -> list[Piece]:
        torch = self.torch
        out: list[Piece] = []
        for row in self._ended:
            piece = self._piece(row)
            if piece is not None:  # always, for an ended row
                out.append(piece)
        self._ended.clear()
        if not self._rows:
            return out
        self.steps.append([row.key for row in self._rows])
        chat, rows = self.chat, self._rows
        width = self._width()
        last = torch.stack([row.codes[row.made - 1] for row in rows]).unsqueeze(1)  # (B, 1, 4)
        emb = torch.stack([chat.gpt.emb_code[i](last[:, :, i]) for i in range(self.num_vq)], 3).sum(3)
        lengths = torch.tensor([row.length + 1 for row in rows])
        mask = torch.arange(width + 1).unsqueeze(0) >= (width + 1 - lengths).unsqueeze(1)
        positions = (lengths - 1).unsqueeze(1)
        hidden, self._cache = self._forward(emb, mask, positions, torch.arange(width, width + 1), self._cache)
        for row in rows:
            row.length += 1
        self._sample(rows, hidden)
        for row in rows:
            piece = self._piece(row)
            if piece is not None:
                out.append(piece)
        if any(row.done for row in rows):
            self._keep([i for i, row in enumerate(rows) if not row.done])
            self._balance()
        return out

    def _forward(self, emb: Any, mask: Any, positions: Any, cache_position: Any, cache: Any) -> tuple[Any, Any]:
        """One Llama forward, its inputs cast as GPT.generate casts them; the last position's hidden state."""
        torch, gpt = self.torch, self.chat.gpt
        inputs = gpt._GenerationInputs(
            position_ids=positions, cache_position=cache_position, attention_mask=mask, inputs_embeds=emb
        )
        inputs.to(gpt.device_gpt, gpt.gpt.dtype)
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

    def _sample(self, rows: Sequence[_Row], hidden: Any) -> None:
        """Sample each row's next codes from the last position of `hidden` (rows, positions, dim)."""
        import torch.nn.functional as F
        import torch.nn.utils.parametrize as P

        torch, gpt = self.torch, self.chat.gpt
        with P.cached():
            logits = torch.empty(
                hidden.size(0), hidden.size(1), gpt.num_audio_tokens, self.num_vq, dtype=torch.float, device=gpt.device
            )
            for vq in range(self.num_vq):
                logits[..., vq] = gpt.head_code[vq](hidden)
        logits = logits.narrow(1, -1, 1).squeeze_(1).float().permute(0, 2, 1)
        logits = logits.reshape(-1, logits.size(2))
        last_hidden = hidden.narrow(1, -1, 1).squeeze(1)
        nv = self.num_vq
        # The temperature, then the repetition penalty over each row's own
        # history, then the warpers (top_p, top_k), the end-token mask and the
        # softmax, as GPT.generate applies them to its batch. Each works on each
        # line of scores alone, so rows that share their settings go through
        # in one call: the same numbers as a call per row, in a fraction of the
        # calls (a call per row was a third of a step at 8 rows). The penalty
        # reads the last PAST_WINDOW codes: rows with fewer go alone.
        scores = [logits.narrow(0, i * nv, nv) / row.temperature for i, row in enumerate(rows)]
        probs: list[Any] = [None] * len(rows)
        groups: dict[tuple[float, int], list[int]] = {}
        for i, row in enumerate(rows):
            groups.setdefault(row.warp_key, []).append(i)
        for members in groups.values():
            processors = rows[members[0]].processors
            full = [i for i in members if rows[i].made >= PAST_WINDOW]
            if full and processors:
                history = torch.cat([rows[i].codes.narrow(0, rows[i].made - PAST_WINDOW, PAST_WINDOW).T for i in full])
                lines = torch.cat([scores[i] for i in full])
                for process in processors:
                    lines = process(history, lines)
                for j, i in enumerate(full):
                    scores[i] = lines.narrow(0, j * nv, nv)
            for i in members:
                if rows[i].made < PAST_WINDOW or not processors:
                    history = rows[i].codes.narrow(0, 0, rows[i].made).permute(1, 0)
                    for process in processors:
                        scores[i] = process(history, scores[i])
            stacked = torch.cat([scores[i] for i in members])
            for warp in rows[members[0]].warpers:
                stacked = warp(None, stacked)
            for j, i in enumerate(members):
                if rows[i].made < self.min_new_token:
                    stacked[j * nv : (j + 1) * nv, self.eos] = -torch.inf
            stacked = F.softmax(stacked, dim=-1)
            for j, i in enumerate(members):
                probs[i] = stacked.narrow(0, j * nv, nv)
        drawn = self._draw(rows, torch.cat(probs)).view(len(rows), nv)
        ended = drawn.eq(self.eos).any(1).tolist()
        for i, row in enumerate(rows):
            if ended[i]:
                row.done = True
                continue
            row.codes[row.made] = drawn[i]
            row.hiddens.append(last_hidden[i].clone())
            row.made += 1
            if row.made >= row.budget:
                row.done = True

    def _draw(self, rows: Sequence[_Row], probs: Any) -> Any:
        """One code per line of `probs` (rows * num_vq lines, in row order), each row from its own noise: one call.

        `torch.multinomial(p, 1, generator)` is `argmax(p / q)` with q drawn by
        `exponential_(1, generator)` over p's shape (its one-sample path), and
        ChatTTS re-seeds its generator with the same seed before every draw: a
        row's q is the same at every step. So each row draws its q once, when it
        joins (`_noise`), and a step divides and takes the argmax of every row
        at once: the very codes of a multinomial per row, its own stream.
        """
        return self.torch.argmax(probs / self.torch.cat([row.noise for row in rows]), dim=-1)

    def _noise(self, row: _Row) -> Any:
        """The row's q (num_vq, num_audio_tokens): the Exp(1) draws `torch.multinomial` makes from its
        generator seeded with the row's seed."""
        torch, gpt = self.torch, self.chat.gpt
        q = torch.empty(self.num_vq, gpt.num_audio_tokens, dtype=torch.float, device=gpt.device)
        return q.exponential_(1, generator=torch.Generator(device=gpt.device).manual_seed(row.seed))

    def _keep(self, indices: list[int]) -> None:
        """Keep only these batch rows, and drop the cache columns no remaining row uses."""
        torch = self.torch
        self._rows = [self._rows[i] for i in indices]
        if not self._rows:
            self._cache = None
            return
        index = torch.tensor(indices)
        width = self._width()
        unused = width - max(row.length for row in self._rows)
        for layer in self._cache.layers:
            for name in ("keys", "values"):
                kept = getattr(layer, name).index_select(0, index)
                setattr(layer, name, kept.narrow(2, unused, width - unused).contiguous() if unused else kept)

    # -- slots ---------------------------------------------------------------

    def _balance(self) -> None:
        """Step the `capacity` best placed rows: park the worst placed beyond them, and while a slot is free
        resume the best placed parked row."""
        if len(self._rows) > self.capacity:
            ranked = sorted(range(len(self._rows)), key=lambda i: self._rows[i].place)
            self._park(sorted(ranked[self.capacity :]))
        while self._parked and len(self._rows) < self.capacity:
            row = min(self._parked, key=lambda r: r.place)
            self._parked.remove(row)
            cache, row.parked = row.parked, None
            self._merge([row], cache)

    def _park(self, indices: list[int]) -> None:
        """Take these batch rows out of the batch, each with its own KV cache (its real positions only)."""
        for i in indices:
            row = self._rows[i]
            row.parked = self._cache_of(i, row.length)
            self._parked.append(row)
        gone = set(indices)
        self._keep([i for i in range(len(self._rows)) if i not in gone])

    def _cache_of(self, i: int, length: int) -> Any:
        """A copy of batch row `i`'s last `length` cache columns, as a cache of its own (a batch of one)."""
        part = copy.copy(self._cache)
        part.layers = [copy.copy(layer) for layer in self._cache.layers]
        for layer in part.layers:
            for name in ("keys", "values"):
                kv = getattr(layer, name)
                setattr(layer, name, kv.narrow(0, i, 1).narrow(2, kv.shape[2] - length, length).clone())
        return part

    # -- audio ---------------------------------------------------------------

    def _piece(self, row: _Row) -> Piece | None:
        """The row's next piece, if `stream_tokens` tokens (plus look-ahead) are ready or the row ended."""
        if not row.done and row.made - row.sent < self.stream_tokens + self.lookahead:
            return None
        end = row.made if row.done else row.sent + self.stream_tokens
        samples = self.decode(row.hiddens, row.sent, end, last=row.done)
        samples = audio.fade_edges(samples, head=row.pieces == 0, tail=row.done)
        piece = Piece(row.key, samples, row.pieces, row.done, row.made)
        if row.done and self.record is not None:
            self.record[row.key] = (row.codes[: row.made].clone(), list(row.hiddens))
        row.sent, row.pieces = end, row.pieces + 1
        return piece

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

    # -- leaving -------------------------------------------------------------

    def leave(self, keys: Iterable[str]) -> None:
        gone = set(keys)
        self._ended = [row for row in self._ended if row.key not in gone]
        self._parked = [row for row in self._parked if row.key not in gone]
        kept = [i for i, row in enumerate(self._rows) if row.key not in gone]
        if len(kept) != len(self._rows):
            self._keep(kept)
            self._balance()

    def keys(self) -> list[str]:
        return [row.key for row in self._rows + self._parked + self._ended]

    def parked(self) -> list[str]:
        """The rows held but not stepping now (see `_balance`)."""
        return [row.key for row in self._parked]

    def preemptible(self) -> int:
        """How many first rows may join beyond `capacity` now: one for each stepping later row (a first row
        would only wait parked behind first rows), while the reserve has room."""
        later = sum(1 for row in self._rows if not row.place.first)
        return max(0, min(later, self.reserve - len(self._parked)))
