"""A decode loop row's state, and its next codes sampled as ChatTTS's `GPT.generate` samples them.

Sampling makes the numbers of `GPT.generate` (ChatTTS 0.2.5) on each row
alone: logits / temperature, repetition penalty 1.05 over the last 16 codes,
top-p, top-k, softmax, multinomial from a generator re-seeded with the row's
seed every step (ChatTTS re-seeds its one generator every step when given a
`manual_seed`). Four of those run for the whole batch in one call where
upstream's run per row or cost more on a CPU, each proven equal: the draws
(`Sampler.draw`), the penalty (`penalize`), and top-p and top-k from one
sort (`TopP`).

Imports torch on construction only; the worker side alone imports engines/.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from cache import Spec
from common.model import token_budget
from common.scheduling import Place

# ChatTTS's repetition penalty (InferCodeParams' default) and its window.
REPETITION_PENALTY = 1.05
# The codes the repetition penalty looks back over (ChatTTS's gen_logits: 16).
PAST_WINDOW = 16

Draw = Callable[[Sequence["Row"], Any], Any]


@dataclass
class Row:
    """One row of the loop: its sampling, its codes and hidden states so far, and where it is."""

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
    noise: Any  # (num_vq, num_audio_tokens): the Exp(1) draws of its generator (Sampler.draw)
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
class Prompt:
    """A joining row's prompt and sampling, made by the text front end before any model call.

    `speaker` is the row's speaker embedding, None for a recorded voice (which has codes instead).
    """

    key: str
    spec: Spec
    seed: int
    prompt: str
    speaker: Any
    processors: list[Callable[[Any, Any], Any]]
    warpers: list[Callable[[Any, Any], Any]]
    place: Place
    # A recorded voice's codes (codebooks, tokens), which follow the prompt's text; None for any other voice.
    codes: Any = None


Mark = tuple[int, bool, int, int]


def marks(rows: Sequence[Row]) -> list[Mark]:
    """What a step changes of each row (a step that raises, or a trial step, puts it back with `restore`):
    codes made, done, hidden states kept, cache length. A row's `codes` past `made` are never read."""
    return [(row.made, row.done, len(row.hiddens), row.length) for row in rows]


def restore(rows: Sequence[Row], kept: list[Mark]) -> None:
    for row, (made, done, hiddens, length) in zip(rows, kept):
        row.made, row.done, row.length = made, done, length
        del row.hiddens[hiddens:]


class TopP:
    """transformers' `TopPLogitsWarper` (`warper`), then its `TopKLogitsWarper` (`top_k`) where given: the very
    scores they return, without their `torch.sort` and `torch.topk` on the CPU.

    The warper sorts each line, takes the softmax and cumulative sum of the
    sorted values and removes the lowest ones whose sum stays within
    1 - top_p (a prefix of the sorted line, as the sum never decreases), all
    but its last `min_tokens_to_keep`. The sorted values are the same
    whichever sort makes them, so numpy's (far faster than torch's on a CPU
    for a batch of 626-token lines: BENCHMARKS.md) feeds the same softmax and cumsum,
    and a line loses the tokens below its first kept value: the same tokens,
    unless the values on both sides of that boundary are equal, where the
    warper's unstable sort picks among them; such a call, and any not on the
    CPU, goes to the warpers themselves.

    Top-k after top-p keeps the values not below the k-th largest that
    top-p kept, or all it kept when it kept fewer than k: the values not
    below the larger of the first kept and the k-th largest of the line.
    """

    def __init__(self, warper: Any, top_k: Any = None) -> None:
        import numpy as np
        import torch

        self.np, self.torch, self.warper, self.top_k = np, torch, warper, top_k
        self.top_p, self.keep, self.fill = float(warper.top_p), int(warper.min_tokens_to_keep), warper.filter_value
        if top_k is not None and top_k.filter_value != self.fill:
            raise ValueError("top-k fused after top-p must fill what it removes as top-p does")

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        torch = self.torch
        if scores.device.type != "cpu" or scores.dtype != torch.float32 or scores.size(-1) <= self.keep:
            return self.warpers(input_ids, scores)
        values = torch.from_numpy(self.np.sort(scores.detach().numpy(), axis=-1))
        remove = values.softmax(dim=-1).cumsum(dim=-1) <= (1 - self.top_p)
        remove[..., -self.keep :] = False
        removed = remove.sum(dim=-1, keepdim=True)
        first_kept = values.gather(1, removed)
        last_removed = values.gather(1, (removed - 1).clamp(min=0))
        if bool(((removed > 0) & (last_removed == first_kept)).any()):
            return self.warpers(input_ids, scores)
        if self.top_k is not None:
            k = min(self.top_k.top_k, values.size(-1))
            first_kept = torch.maximum(first_kept, values.narrow(1, values.size(-1) - k, 1))
        return scores.masked_fill(scores < first_kept, self.fill)

    def warpers(self, input_ids: Any, scores: Any) -> Any:
        """The warpers themselves: top-p, then top-k where given."""
        scores = self.warper(input_ids, scores)
        return scores if self.top_k is None else self.top_k(input_ids, scores)


class Sampler:
    """ChatTTS's sampling of a batch of rows, each with its own settings and random stream."""

    def __init__(self, chat: Any) -> None:
        import torch
        from ChatTTS.model.processors import CustomRepetitionPenaltyLogitsProcessorRepeat, gen_logits
        from transformers.generation import TopKLogitsWarper, TopPLogitsWarper

        self.repeat_type, self.top_p_type = CustomRepetitionPenaltyLogitsProcessorRepeat, TopPLogitsWarper
        self.top_k_type = TopKLogitsWarper
        self.torch = torch
        self.gpt = chat.gpt
        self.device = chat.device
        self.gen_logits = gen_logits
        self.num_vq = int(chat.config.gpt.num_vq)
        self.eos = int(chat.config.gpt.num_audio_tokens) - 1
        self.min_new_token = chat.InferCodeParams().min_new_token
        self._warpers: dict[tuple[float, int], tuple[list[Any], list[Any]]] = {}

    def warpers_of(self, top_p: float, top_k: int) -> tuple[list[Any], list[Any]]:
        """ChatTTS's (processors, warpers) for these settings, as GPT.generate makes them (one set per key)."""
        if (top_p, top_k) not in self._warpers:
            warpers, processors = self.gen_logits(
                num_code=self.eos, top_P=top_p, top_K=top_k, repetition_penalty=REPETITION_PENALTY
            )
            if [type(w) for w in warpers] == [self.top_p_type, self.top_k_type]:
                warpers = [TopP(warpers[0], warpers[1])]  # GPT.generate's pair, as gen_logits makes it
            else:
                warpers = [TopP(w) if isinstance(w, self.top_p_type) else w for w in warpers]
            self._warpers[(top_p, top_k)] = (processors, warpers)
        return self._warpers[(top_p, top_k)]

    def row(self, prompt: Prompt, max_new_token: int, length: int) -> Row:
        """A prefilled prompt's row, no codes sampled yet, its noise drawn; `length` real cache positions."""
        torch, spec = self.torch, prompt.spec
        budget = token_budget(spec.chunks[0], max_new_token)
        row = Row(
            key=prompt.key,
            seed=prompt.seed,
            budget=budget,
            temperature=torch.tensor([spec.temperature] * self.num_vq, device=self.device).view(-1, 1),
            processors=prompt.processors,
            warpers=prompt.warpers,
            warp_key=(spec.top_p, spec.top_k),
            noise=None,
            codes=torch.zeros(budget, self.num_vq, dtype=torch.long, device=self.device),
            length=length,
            place=prompt.place,
        )
        row.noise = self.noise(row)
        return row

    def sample(self, rows: Sequence[Row], hidden: Any, draw: Draw) -> None:
        """Sample each row's next codes from the last position of `hidden` (rows, positions, dim) with `draw`
        (`Sampler.draw`, or a stand-in for it): a row ends at its end token or its budget."""
        last_hidden = hidden.narrow(1, -1, 1).squeeze(1)
        probs = self._probs(rows, self._scores(rows, hidden))
        drawn = draw(rows, self.torch.cat(probs)).view(len(rows), self.num_vq)
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

    def draw(self, rows: Sequence[Row], probs: Any) -> Any:
        """One code per line of `probs` (rows * num_vq lines, in row order), each row from its own noise: one call.

        `torch.multinomial(p, 1, generator)` is `argmax(p / q)` with q drawn by
        `exponential_(1, generator)` over p's shape (its one-sample path), and
        ChatTTS re-seeds its generator with the same seed before every draw: a
        row's q is the same at every step. So each row draws its q once, when it
        joins (`noise`), and a step divides and takes the argmax of every row
        at once: the very codes of a multinomial per row, its own stream.
        """
        return self.torch.argmax(probs / self.torch.cat([row.noise for row in rows]), dim=-1)

    def noise(self, row: Row) -> Any:
        """The row's q (num_vq, num_audio_tokens): the Exp(1) draws `torch.multinomial` makes from its
        generator seeded with the row's seed."""
        torch, gpt = self.torch, self.gpt
        q = torch.empty(self.num_vq, gpt.num_audio_tokens, dtype=torch.float, device=gpt.device)
        return q.exponential_(1, generator=torch.Generator(device=gpt.device).manual_seed(row.seed))

    def _scores(self, rows: Sequence[Row], hidden: Any) -> list[Any]:
        """Each row's logits at the last position of `hidden`, (num_vq, num_audio_tokens), over its temperature."""
        import torch.nn.utils.parametrize as P

        torch, gpt, nv = self.torch, self.gpt, self.num_vq
        # GPT.generate runs the heads over every position and keeps the last; a prefill's other positions are
        # never read, so only the last goes through them (the same products for it: tests/test_loop.py).
        hidden = hidden.narrow(1, -1, 1)
        with P.cached():
            logits = torch.empty(hidden.size(0), 1, gpt.num_audio_tokens, nv, dtype=torch.float, device=gpt.device)
            for vq in range(nv):
                logits[..., vq] = gpt.head_code[vq](hidden)
        logits = logits.squeeze_(1).float().permute(0, 2, 1)
        logits = logits.reshape(-1, logits.size(2))
        return [logits.narrow(0, i * nv, nv) / row.temperature for i, row in enumerate(rows)]

    def _probs(self, rows: Sequence[Row], scores: list[Any]) -> list[Any]:
        """Each row's probabilities from its scores: the repetition penalty over its own history, then the
        warpers (top_p, top_k), the end-token mask and the softmax, as GPT.generate applies them to its batch.

        Each works on each line of scores alone, so rows that share their
        settings go through in one call: the same numbers as a call per row,
        in a fraction of the calls. The penalty reads the last PAST_WINDOW
        codes: rows with fewer go alone.
        """
        import torch.nn.functional as F

        torch, nv = self.torch, self.num_vq
        probs: list[Any] = [None] * len(rows)
        groups: dict[tuple[float, int], list[int]] = {}
        for i, row in enumerate(rows):
            groups.setdefault(row.warp_key, []).append(i)
        for members in groups.values():
            self._penalize(rows, members, scores)
            stacked = torch.cat([scores[i] for i in members])
            for warp in rows[members[0]].warpers:
                stacked = warp(None, stacked)
            for j, i in enumerate(members):
                if rows[i].made < self.min_new_token:
                    stacked[j * nv : (j + 1) * nv, self.eos] = -torch.inf
            stacked = F.softmax(stacked, dim=-1)
            for j, i in enumerate(members):
                probs[i] = stacked.narrow(0, j * nv, nv)
        return probs

    def _penalize(self, rows: Sequence[Row], members: list[int], scores: list[Any]) -> None:
        """Apply the processors of rows sharing their settings to their scores, in place in `scores`: ChatTTS's
        repetition penalty to every row in one call (`penalize`), any other processor row by row."""
        torch, nv = self.torch, self.num_vq
        processors = rows[members[0]].processors
        repeat: Any = processors[0] if len(processors) == 1 else None
        if isinstance(repeat, self.repeat_type) and repeat.past_window == PAST_WINDOW:
            vocab = scores[members[0]].size(1)
            # Each row's last PAST_WINDOW codes, fewer padded with `vocab`, which penalize counts apart.
            window = torch.full((len(members) * nv, PAST_WINDOW), vocab, dtype=torch.long, device=self.device)
            for j, i in enumerate(members):
                n = min(rows[i].made, PAST_WINDOW)
                if n:
                    window[j * nv : (j + 1) * nv, PAST_WINDOW - n :] = rows[i].codes.narrow(0, rows[i].made - n, n).T
            lines = penalize(repeat.penalty, window, torch.cat([scores[i] for i in members]))
            for j, i in enumerate(members):
                scores[i] = lines.narrow(0, j * nv, nv)
            return
        for i in members:
            history = rows[i].codes.narrow(0, 0, rows[i].made).permute(1, 0)
            for process in processors:
                scores[i] = process(history, scores[i])


def penalize(penalty: float, window: Any, lines: Any) -> Any:
    """ChatTTS's `CustomRepetitionPenaltyLogitsProcessorRepeat` of one row applied to each line of `lines`
    (lines, vocab) with that line's codes in `window` (lines, PAST_WINDOW), entries equal to vocab being none.

    The processor counts each code of a row's window (`one_hot(...).sum`)
    and scales a score by penalty ** count (multiplied where negative,
    divided where not; a count of 0 scales by 1, which changes nothing).
    Here the counts come from one `scatter_add_` over every line, and only
    the scores of the codes in the windows are scaled: the same integers, so
    the same float operations on each of them as the processor applied to
    the row alone, and no `pow` over the other 610 scores of a line. Windows
    are padded on the left, so a line's last entry is a code wherever any
    is: a padding entry stands for it (written twice, the same value), or
    for code 0 with a count of 0 in a line without codes. (Applied to a
    batch of over 156 rows at once, the processor itself would leave the
    lines past its 625th unpenalized; a row here never depends on its
    batch.)
    """
    import torch

    real = window < lines.size(1)
    codes = torch.where(real, window, torch.where(real[:, -1:], window[:, -1:], 0))
    counts = torch.zeros(lines.shape, dtype=torch.long, device=lines.device).scatter_add_(1, codes, real.long())
    alpha = torch.pow(penalty, counts.gather(1, codes))
    scores = lines.gather(1, codes)
    return lines.clone(memory_format=torch.contiguous_format).scatter_(
        1, codes, torch.where(scores < 0, scores.multiply(alpha), scores.divide(alpha))
    )
