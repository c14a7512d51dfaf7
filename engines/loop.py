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

Rows fail alone. A row whose settings are out of range, whose text the front
end cannot read, whose model output is not finite, or whose part of a
prefill or step raises leaves with an error piece (`Piece.error`, a reason
work/status.py words), and the other rows go on as if it had never joined:
a batched prefill or step that raises is retried without the row that caused
it, found by bisecting when the exception names none. Out of memory fails
nobody: the newest rows are given back unmade (`take_returned`) and the loop
holds fewer rows for a while (`OOM_HOLD`).

Slots (`_balance`): the loop steps the `capacity` best placed rows
(`common.model.Place`: the pool's fair order) and takes up to `reserve` first
rows beyond them, one for each later row stepping (`preemptible`). A row
placed worse than `capacity` others is parked: it leaves the batch with its
KV cache (its real positions), codes and noise kept, and merges back, best
placed first, when a slot frees. Nothing a row samples depends on when it
steps, so a parked row makes the codes it makes unparked. A row that fails
or leaves goes wherever it is, parked or not; out of memory gives back
parked rows first, and no first row preempts for a while after it.

Imports torch on construction only; the worker side alone imports engines/.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from cache import Spec
from common import audio, sampling
from common.model import SAMPLES_PER_TOKEN, Piece, Place, token_budget
from engines import spoken
from engines.refine import refine
from engines.rowfaults import (
    BAD_INPUT,
    BAD_SETTINGS,
    NOT_FINITE,
    ROW_RAISED,
    TOO_BIG,
    Capacity,
    RowsNotFinite,
    check_finite,
    culprits,
    is_out_of_memory,
    reason,
)

# Tokens of context decoded on each side of a piece, so that its edges sound
# as they would in one decode of the whole chunk (tests/test_loop.py measures
# the joins). ChatTTS's DVAE decoder and Vocos see a few tokens either way.
LOOKAHEAD = 8
# ChatTTS's repetition penalty (InferCodeParams' default) and its window.
REPETITION_PENALTY = 1.05
# The codes the repetition penalty looks back over (ChatTTS's gen_logits: 16).
PAST_WINDOW = 16

logger = logging.getLogger("engine")


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


@dataclass
class _Prompt:
    """A joining row's prompt and sampling, made by the text front end before any model call."""

    key: str
    spec: Spec
    seed: int
    prompt: str
    speaker: Any
    processors: list[Callable[[Any, Any], Any]]
    warpers: list[Callable[[Any, Any], Any]]
    place: Place


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
        clock: Callable[[], float] = time.monotonic,
        reserve: int = 0,
    ) -> None:
        import torch
        from ChatTTS.model.processors import gen_logits

        self.torch = torch
        self.chat = chat
        self.speaker = speaker
        self.max_new_token = max_new_token
        self._capacity = Capacity(capacity, clock)
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
        # Rows that failed (key -> reason), each handed out as an error piece by the next step.
        self._failed: dict[str, str] = {}
        # Rows per step (keys), and each ended row's codes and hidden states
        # when `record` is set: for the tests and the bench, never in service.
        self.steps: list[list[str]] = []
        self.record: dict[str, tuple[Any, list[Any]]] | None = None

    # -- joining -------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """The rows the loop takes now: its limit, or fewer for a while after it ran out of memory."""
        return self._capacity.now()

    def join(self, rows: Sequence[tuple[str, Spec]], places: Sequence[Place] | None = None) -> None:
        """Prefill `rows` together (one forward, left-padded as ChatTTS pads a batch), sample each one's first
        codes, and add those that did not end at once to the running batch; then the worst placed rows beyond
        `capacity` are parked (`_balance`). `places`: default, first rows in the order given.

        A row that cannot be made fails alone (an error piece at the next
        step); one that does not fit in memory is given back (`take_returned`).
        Raises ValueError only when the rows are more than the free slots and
        the first rows `preemptible()` allows, or `places` are not one a row.
        """
        room = max(0, self.capacity - len(self.keys())) + self.preemptible()
        if len(rows) > room:
            raise ValueError(f"{len(rows)} rows do not fit in the {room} free slot(s) of {self.capacity}")
        if places is None:
            places = [Place(0, self._joined + i) for i in range(len(rows))]
        elif len(places) != len(rows):
            raise ValueError(f"{len(places)} places for {len(rows)} rows")
        self._joined += len(rows)
        prepared = (self._prepare(key, spec, place) for (key, spec), place in zip(rows, places))
        self._join_prompts([p for p in prepared if p is not None])
        self._balance()

    def take_returned(self) -> list[str]:
        """The rows given back unmade since the last call (out of memory): the caller puts them back in the pool."""
        return self._capacity.take_returned()

    def _prepare(self, key: str, spec: Spec, place: Place) -> _Prompt | None:
        """The row's prompt, speaker and sampling; None when it failed (or, out of memory, was given back)."""
        chat = self.chat
        problem = sampling.out_of_range(spec)
        if problem is not None:
            logger.warning("row %s fails alone: %s", key, problem)
            self._fail(key, BAD_SETTINGS)
            return None
        seed = row_seed(spec, key)
        try:
            text = chat.normalizer(spoken.speak(spec.chunks[0]), True, True, None)
            if spec.refine_text:
                text = refine(chat, spec, [text], seed, self.max_new_token)[0]
            emb_spk = self.speaker(spec.seed, spec.speaker)
            prompt = chat.speaker.decorate_code_prompts([f"[speed_{spec.speed}]{text}"], "", None, emb_spk)[0]
            processors, warpers = self._warpers_of(spec.top_p, spec.top_k)
        except Exception as exc:
            if is_out_of_memory(exc):
                self._no_room(key)
            else:
                logger.exception("row %s fails alone: its text or voice could not be prepared", key)
                self._fail(key, reason(BAD_INPUT, exc))
            return None
        return _Prompt(key, spec, seed, prompt, emb_spk, processors, warpers, place)

    def _join_prompts(self, prompts: list[_Prompt]) -> None:
        """Prefill `prompts` together and add them; when that raises, each half alone, down to single rows:
        a row whose prefill raises alone fails, one whose output is not finite fails at once."""
        if not prompts:
            return
        try:
            joined, cache = self._prefill(prompts)
            self._add(joined, cache)
            return
        except RowsNotFinite as exc:
            bad = set(exc.indices)
            for i in exc.indices:
                self._fail(prompts[i].key, NOT_FINITE)
            self._join_prompts([p for i, p in enumerate(prompts) if i not in bad])
            return
        except Exception as exc:
            if is_out_of_memory(exc) and len(prompts) == 1:
                self._no_room(prompts[0].key)
                return
            if len(prompts) == 1:
                logger.exception("row %s fails alone: its prefill raised", prompts[0].key)
                self._fail(prompts[0].key, reason(ROW_RAISED, exc))
                return
            logger.warning("a prefill of %d rows raised (%s): each half alone", len(prompts), type(exc).__name__)
        half = len(prompts) // 2
        self._join_prompts(prompts[:half])
        self._join_prompts(prompts[half:])

    def _add(self, joined: list[_Row], cache: Any) -> None:
        """Prefilled rows into the loop: those that ended at their first token wait for the next step, the rest
        join the batch."""
        going = [i for i, row in enumerate(joined) if not row.done]
        if going:
            if len(going) < len(joined):
                cache = self._select(cache, going)
            self._merge([joined[i] for i in going], cache)
        self._ended += [row for row in joined if row.done]

    def _prefill(self, prompts: Sequence[_Prompt]) -> tuple[list[_Row], Any]:
        """Prefill rows in one forward and sample their first codes, as GPT.generate's first step does for a
        batch: prompts left-padded to the longest, the mask and position ids over each row's real tokens.

        Changes nothing of the loop's; raises RowsNotFinite for rows whose output is not finite.
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
        hidden, cache = self._forward(emb, attention_mask.bool(), position_ids, torch.arange(0, width), None)
        check_finite(hidden)
        lengths = attention_mask.sum(1).tolist()
        joined = []
        for p, length in zip(prompts, lengths):
            spec = p.spec
            row = _Row(
                key=p.key,
                seed=p.seed,
                budget=token_budget(spec.chunks[0], self.max_new_token),
                temperature=torch.tensor([spec.temperature] * self.num_vq, device=chat.device).view(-1, 1),
                processors=p.processors,
                warpers=p.warpers,
                warp_key=(spec.top_p, spec.top_k),
                noise=None,
                codes=None,
                length=int(length),
                place=p.place,
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
        """Add prefilled rows' cache to the batch's, left-padding whichever is shorter.

        All or nothing: the batch's cache changes only once every layer is
        merged (running out of memory half way leaves it as it was).
        """
        torch = self.torch
        if self._cache is None:
            self._cache, self._rows = cache, list(rows)
            return
        width = self._width()
        total = max(width, int(cache.layers[0].keys.shape[2]))
        merged = []
        for mine, theirs in zip(self._cache.layers, cache.layers):
            for name in ("keys", "values"):
                a, b = getattr(mine, name), getattr(theirs, name)
                a = torch.nn.functional.pad(a, (0, 0, total - a.shape[2], 0))
                b = torch.nn.functional.pad(b, (0, 0, total - b.shape[2], 0))
                merged.append((mine, name, torch.cat([a, b], dim=0)))
        for layer, name, tensor in merged:
            setattr(layer, name, tensor)
        self._rows += rows

    def _select(self, cache: Any, indices: list[int]) -> Any:
        """`cache` with only these batch rows."""
        index = self.torch.tensor(indices)
        for layer in cache.layers:
            for name in ("keys", "values"):
                setattr(layer, name, getattr(layer, name).index_select(0, index))
        return cache

    def _width(self) -> int:
        return _width_of(self._cache)

    # -- stepping ------------------------------------------------------------

    def step(self) -> list[Piece]:
        """Advance every row by one token; the pieces that are ready, and an error piece for each failed row."""
        out = [Piece(key, np.zeros(0, np.float32), 0, True, 0, error=reason) for key, reason in self._failed.items()]
        self._failed.clear()
        for row in self._ended:
            out += self._pieces_of([row])
        self._ended.clear()
        self._balance()
        if not self._rows:
            return out
        self.steps.append([row.key for row in self._rows])
        self._advance()
        rows = self._rows
        out += self._pieces_of(rows)
        if any(row.done for row in rows):
            self._keep([i for i, row in enumerate(rows) if not row.done])
        self._balance()
        return out

    def _advance(self) -> None:
        """One forward and sample of every row in the batch, committed only when it succeeds.

        A row whose output is not finite fails; when the step raises, the rows
        that raise without the others (bisecting) fail and the rest step again;
        out of memory gives back a parked row (its cache is memory the batch
        can use), or when none is parked the newest row, and steps again; so
        does a fault no row causes alone, giving back the newest row.
        """
        while self._rows:
            try:
                self._cache = self._step_rows(self._rows, self._cache)
                return
            except RowsNotFinite as exc:
                bad = set(exc.indices)
                for i in exc.indices:
                    self._fail(self._rows[i].key, NOT_FINITE)
                self._keep([i for i in range(len(self._rows)) if i not in bad])
            except Exception as exc:
                if is_out_of_memory(exc):
                    if self._parked:
                        self._give_back_parked()
                    else:
                        self._give_back_newest()
                    continue
                logger.warning("a step of %d rows raised (%s): finding the row", len(self._rows), type(exc).__name__)
                found = culprits(list(range(len(self._rows))), exc, self._trial)
                if not found:
                    # No row fails alone: too many rows together is the fault.
                    self._give_back_newest()
                    continue
                for i, error in found.items():
                    logger.error("row %s fails alone: its step raised %r", self._rows[i].key, error)
                    self._fail(self._rows[i].key, reason(ROW_RAISED, error))
                self._keep([i for i in range(len(self._rows)) if i not in found])

    def _step_rows(self, rows: list[_Row], cache: Any) -> Any:
        """Forward `rows` (whose cache is `cache`) by their last codes and sample their next; the new cache.

        `cache` itself is left as it was, and so are the rows when this raises.
        """
        torch, chat = self.torch, self.chat
        marks = _marks(rows)
        try:
            width = _width_of(cache)
            last = torch.stack([row.codes[row.made - 1] for row in rows]).unsqueeze(1)  # (B, 1, 4)
            emb = torch.stack([chat.gpt.emb_code[i](last[:, :, i]) for i in range(self.num_vq)], 3).sum(3)
            lengths = torch.tensor([row.length + 1 for row in rows])
            mask = torch.arange(width + 1).unsqueeze(0) >= (width + 1 - lengths).unsqueeze(1)
            positions = (lengths - 1).unsqueeze(1)
            hidden, cache = self._forward(emb, mask, positions, torch.arange(width, width + 1), _shallow(cache))
            check_finite(hidden)
            for row in rows:
                row.length += 1
            self._sample(rows, hidden)
        except BaseException:
            _restore(rows, marks)
            raise
        return cache

    def _trial(self, indices: list[int]) -> BaseException | None:
        """Step these batch rows apart from the rest, changing nothing; what that raised (None when it did not,
        or when it ran out of memory: no row's own fault)."""
        rows = [self._rows[i] for i in indices]
        marks = _marks(rows)
        try:
            self._step_rows(rows, self._select(_shallow(self._cache), indices))
        except Exception as exc:
            return None if is_out_of_memory(exc) else exc
        finally:
            _restore(rows, marks)
        return None

    def _pieces_of(self, rows: Sequence[_Row]) -> list[Piece]:
        """Each row's next piece, if ready; a row whose audio cannot be decoded fails (out of memory: is given
        back) and leaves the batch."""
        out: list[Piece] = []
        for row in rows:
            try:
                piece = self._piece(row)
            except Exception as exc:
                row.done = True
                if is_out_of_memory(exc):
                    self._short_of_memory([row.key])
                else:
                    logger.exception("row %s fails alone: decoding its audio raised", row.key)
                    self._fail(row.key, reason(ROW_RAISED, exc))
                continue
            if piece is not None:
                out.append(piece)
        return out

    # -- failing, and running out of memory ------------------------------------

    def _fail(self, key: str, reason: str) -> None:
        """The row leaves with `reason`: the next step hands out its error piece."""
        self._failed[key] = reason

    def _give_back_newest(self) -> None:
        """Out of memory in a step: the newest row leaves unmade, or fails when it is the only one."""
        row = self._rows[-1]
        if len(self._rows) == 1:
            logger.error("row %s fails: it does not fit in memory alone", row.key)
            self._fail(row.key, TOO_BIG)
            self._short_of_memory([])
        else:
            self._short_of_memory([row.key])
        self._keep(list(range(len(self._rows) - 1)))

    def _give_back_parked(self) -> None:
        """Out of memory in a step: the worst placed parked row leaves unmade (the pool's fair order would
        step it last), its cache freed; the loop steps no more rows than it steps now for a while."""
        row = max(self._parked, key=lambda r: r.place)
        self._parked.remove(row)
        row.parked = None
        self._short_of_memory([row.key])

    def _no_room(self, key: str) -> None:
        """Out of memory for a joining row: given back while the loop holds others (it may fit once they
        leave), failed when it had the device to itself."""
        if self._rows or self._parked or self._ended:
            self._short_of_memory([key])
        else:
            logger.error("row %s fails: it does not fit in memory alone", key)
            self._fail(key, TOO_BIG)
            self._short_of_memory([])

    def _short_of_memory(self, keys: list[str]) -> None:
        """Out of memory: `keys` are given back unmade and the loop steps no more rows than it holds now (parked
        rows apart) for a while."""
        held = len(self._rows) + len(self._ended) - sum(1 for row in self._rows if row.key in keys)
        self._capacity.short(held, keys)

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
        resume the best placed parked row. Out of memory for a resumed row's cache, it stays parked and the
        loop steps no more rows than it steps now for a while."""
        capacity = self.capacity
        if len(self._rows) > capacity:
            ranked = sorted(range(len(self._rows)), key=lambda i: self._rows[i].place)
            self._park(sorted(ranked[capacity:]))
        while self._parked and len(self._rows) < self.capacity:
            row = min(self._parked, key=lambda r: r.place)
            try:
                self._merge([row], row.parked)
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                self._short_of_memory([])
                return
            self._parked.remove(row)
            row.parked = None

    def _park(self, indices: list[int]) -> None:
        """Take these batch rows out of the batch, each with its own KV cache (its real positions only); out of
        memory for those caches, the rows are given back unmade instead (`take_returned`)."""
        try:
            caches = [self._cache_of(i, self._rows[i].length) for i in indices]
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            self._short_of_memory([self._rows[i].key for i in indices])
        else:
            for i, cache in zip(indices, caches):
                self._rows[i].parked = cache
                self._parked.append(self._rows[i])
        gone = set(indices)
        self._keep([i for i in range(len(self._rows)) if i not in gone])

    def _cache_of(self, i: int, length: int) -> Any:
        """A copy of batch row `i`'s last `length` cache columns, as a cache of its own (a batch of one)."""
        part = _shallow(self._cache)
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
        for key in gone:
            self._failed.pop(key, None)
        kept = [i for i, row in enumerate(self._rows) if row.key not in gone]
        if len(kept) != len(self._rows):
            self._keep(kept)
            self._balance()

    def keys(self) -> list[str]:
        return [row.key for row in self._rows + self._parked + self._ended] + list(self._failed)

    def parked(self) -> list[str]:
        """The rows held but not stepping now (see `_balance`)."""
        return [row.key for row in self._parked]

    def preemptible(self) -> int:
        """How many first rows may join beyond `capacity` now: one for each stepping later row (a first row
        would only wait parked behind first rows), while the reserve has room; none for a while after the
        loop ran out of memory (`Capacity.pressed`)."""
        if self._capacity.pressed():
            return 0
        later = sum(1 for row in self._rows if not row.place.first)
        return max(0, min(later, self.reserve - len(self._parked)))


_Mark = tuple[int, bool, int, int]


def _marks(rows: Sequence[_Row]) -> list[_Mark]:
    """What a step changes of each row (a step that raises, or a trial step, puts it back with `_restore`):
    codes made, done, hidden states kept, cache length. A row's `codes` past `made` are never read."""
    return [(row.made, row.done, len(row.hiddens), row.length) for row in rows]


def _restore(rows: Sequence[_Row], marks: list[_Mark]) -> None:
    for row, (made, done, hiddens, length) in zip(rows, marks):
        row.made, row.done, row.length = made, done, length
        del row.hiddens[hiddens:]


def _width_of(cache: Any) -> int:
    """Columns of a KV cache (0 for none)."""
    return int(cache.layers[0].keys.shape[2]) if cache is not None else 0


def _shallow(cache: Any) -> Any:
    """A copy of `cache` whose layers can take new tensors (a forward's update, a row selection) while the
    original keeps its own: the tensors themselves are shared, not copied."""
    if cache is None:
        return None
    out = copy.copy(cache)
    out.layers = [copy.copy(layer) for layer in cache.layers]
    return out
