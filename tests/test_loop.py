"""The continuous decode loop (engines/loop.py, runtime/decode_loop.py) on the real tiny ChatTTS.

Upstream equivalence stands in for real weights: a row alone in the loop
makes the very codes and hidden states of ChatTTS's own `_infer_code`
(what `Chat.infer(split_text=False)` runs) on the same text, voice and seed,
and one decode of them gives `Chat.infer`'s samples up to its trim; the same
holds for a static call. Both are checked on the tiny checkpoint and on
ChatTTS at its real size with random weights.
"""

from __future__ import annotations

import io
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator, cast

import numpy as np
import pytest
import soundfile
import torch
from redis import Redis

import jobs
from cache import Spec
from common import audio
from common.keys import chunk_key, pieces_key
from common.model import SAMPLES_PER_TOKEN, decode_all, token_budget
from common.scheduling import Place
from common.settings import from_env
from engines import kvcache, rowfaults, tiny_checkpoint
from engines.chattts import ChatTTSEngine, _voice_seed, load_chattts
from engines.leanstep import LeanStep
from engines.loop import ChatTTSLoop
from engines.refine import refine
from engines.rowmodel import row_seed, sample_text
from runtime.decode_loop import LOOK_EVERY, Tally
from work import queueing
from work.pool import Pool

# Every test here loads a checkpoint (the tiny one, or full-size random weights).
pytestmark = pytest.mark.slow

# Tokens a chunk of the full-size random checkpoint: its random weights never draw the end token, so every row
# runs to this cap (the real cost of a step, few steps).
FULL_TOKENS = 20
TEXTS = [
    "Hello world, this is the loop test.",
    "Another sentence joins the loop here.",
    "A third one, fairly long, that keeps going for a while.",
    "Short one.",
    "你好，世界。这是第五句。",
    "Six is a number.",
    "The seventh sentence has more words in it than most.",
    "Eight.",
]


def _exact(directory: Path) -> tuple[ChatTTSEngine, Any]:
    """The checkpoint in `directory` loaded as the equivalence tests need it: exact float32, one thread."""
    env = {"TTS_MODEL_PATH": str(directory), "TTS_TORCH_THREADS": "1", "TTS_DTYPE": "float32", "TTS_QUANTIZE": "none"}
    return load_chattts(from_env(env))


@pytest.fixture(scope="module")
def full_engine(tmp_path_factory: pytest.TempPathFactory) -> tuple[ChatTTSEngine, Any]:
    """ChatTTS at its real size with random weights (about 1 GB), capped at FULL_TOKENS tokens a chunk."""
    directory = tiny_checkpoint.write(
        tmp_path_factory.mktemp("full") / "model", full_size=True, max_new_token=FULL_TOKENS
    )
    return _exact(directory)


@pytest.fixture(params=["tiny", "full-size"])
def either(request: pytest.FixtureRequest) -> tuple[ChatTTSEngine, Any]:
    """The tiny checkpoint, then the full-size random one: upstream equivalence holds on both."""
    return cast(
        tuple[ChatTTSEngine, Any], request.getfixturevalue("engine" if request.param == "tiny" else "full_engine")
    )


def _loop(engine: ChatTTSEngine, capacity: int = 4, stream: int = 24) -> ChatTTSLoop:
    loop = engine.loop(capacity, stream)
    loop.record = {}
    return loop


def _spy_forwards(loop: ChatTTSLoop, seen: Callable[[Any, Any], None]) -> None:
    """Call `seen(embeddings, mask)` before each of the loop's model forwards: prefills and steps."""
    forward = loop.model.forward

    def spy(emb: Any, mask: Any, positions: Any, cache_position: Any, cache: Any) -> tuple[Any, Any]:
        seen(emb, mask)
        return forward(emb, mask, positions, cache_position, cache)

    loop.model.forward = spy  # type: ignore[method-assign]


def _rec(loop: ChatTTSLoop) -> dict[str, tuple[Any, list[Any]]]:
    assert loop.record is not None
    return loop.record


def _alone(engine: ChatTTSEngine, key: str, spec: Spec) -> torch.Tensor:
    loop = _loop(engine)
    with torch.inference_mode():
        decode_all(loop, [(key, spec)])
    return _rec(loop)[key][0]


def _lasting(engine: tuple[ChatTTSEngine, Any], spec: Spec, tokens: int) -> Spec:
    """`spec` with the first seed from its own on whose every chunk runs `tokens` tokens or more alone (random
    weights end some rows within a few tokens; which ones moves with the model id)."""
    for seed in range(int(spec.seed or 0), 100):
        candidate = replace(spec, seed=seed)
        if all(len(_alone(engine[0], cid, candidate.row(i))) >= tokens for i, cid in enumerate(candidate.chunk_ids())):
            return candidate
    raise AssertionError(f"no seed under 100 makes every chunk last {tokens} tokens")


def _recorded(engine: ChatTTSEngine) -> dict[str, Any]:
    """A recorded voice: the speaker prompt the model's DVAE encoder makes of 3 s of a generated WAV (a gliding
    tone with a tremolo, read back as the service reads uploads), and its transcript."""
    t = np.arange(3 * 24_000) / 24_000
    tone = 0.4 * np.sin(2 * np.pi * (180 + 40 * t) * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 4 * t))
    wav = io.BytesIO()
    soundfile.write(wav, tone, 24_000, format="WAV", subtype="PCM_16")
    samples, _ = soundfile.read(io.BytesIO(wav.getvalue()), dtype="float32")
    return {"sample": engine.encode_sample(samples), "transcript": "The sample says this, 3 times.", "seed": None}


def _upstream_voice(engine: ChatTTSEngine, spec: Spec) -> dict[str, Any]:
    """InferCodeParams' voice fields for `spec`'s voice, as a caller of Chat.infer gives them."""
    if spec.sample is not None:
        return {"spk_smp": spec.sample, "txt_smp": sample_text(engine.chat, spec.transcript or "")}
    return {"spk_emb": engine._speaker(spec.seed, spec.speaker)}


def _upstream_params(engine: ChatTTSEngine, spec: Spec, seed: int) -> Any:
    chat = engine.chat
    return chat.InferCodeParams(
        prompt=f"[speed_{spec.speed}]",
        **_upstream_voice(engine, spec),
        temperature=spec.temperature,
        top_P=spec.top_p,
        top_K=spec.top_k,
        manual_seed=seed,
        max_new_token=token_budget(spec.chunks[0], engine.max_new_token),
        show_tqdm=False,
    )


@pytest.mark.parametrize(
    "voice", [{"seed": 7}, {"speaker": "from-seed-5"}, {"sample": "recorded"}], ids=["seed", "speaker", "recorded"]
)
def test_a_row_alone_in_the_loop_makes_what_chat_infer_makes(
    either: tuple[ChatTTSEngine, Any], voice: dict[str, Any]
) -> None:
    eng, info = either
    if "speaker" in voice:
        voice = {"speaker": eng.speaker(5), "seed": None}
    if "sample" in voice:
        voice = _recorded(eng)
    spec = Spec(chunks=(TEXTS[0],), model=info.id, temperature=0.5, top_k=12, **voice)
    chat = eng.chat
    loop = _loop(eng)
    with torch.inference_mode():
        decode_all(loop, [("c0", spec)])
        codes, hiddens = _rec(loop)["c0"]
        params = _upstream_params(eng, spec, row_seed(spec, "c0"))
        chat.context.set(False)
        normed = chat.normalizer(TEXTS[0], True, True, None)
        upstream = next(chat._infer_code([normed], False, chat.device, True, params))
        assert torch.equal(upstream.ids[0], codes)
        assert torch.equal(upstream.hiddens[0], torch.stack(hiddens))
        # Chat.infer decodes the same hidden states and drops every |x| <= 1e-5;
        # the loop cuts at 512*T - 256 instead (the vocoder's padding).
        params = _upstream_params(eng, spec, row_seed(spec, "c0"))
        wav = chat.infer(
            normed, skip_refine_text=True, split_text=False, do_text_normalization=False, params_infer_code=params
        )[0]
        raw = chat._decode_to_wavs([torch.stack(hiddens)], True)[0]
    assert np.array_equal(wav, raw[np.abs(raw) > np.float32(1e-5)])
    assert np.array_equal(
        loop.model.decode(hiddens, 0, len(hiddens), last=True),
        raw[: SAMPLES_PER_TOKEN * len(hiddens) - SAMPLES_PER_TOKEN // 2],
    )


@pytest.mark.parametrize("voice", ["seed", "recorded"])
def test_a_row_alone_in_a_static_call_makes_what_chat_infer_makes(
    either: tuple[ChatTTSEngine, Any], voice: str
) -> None:
    eng, info = either
    spec = Spec(chunks=(TEXTS[1],), model=info.id, **({"seed": 3} if voice == "seed" else _recorded(eng)))
    chat = eng.chat
    with torch.inference_mode():
        ours = eng.synthesize([spec])[0]
        normed = chat.normalizer(TEXTS[1], True, True, None)
        wav = chat.infer(
            normed,
            skip_refine_text=True,
            split_text=False,
            do_text_normalization=False,
            params_infer_code=_upstream_params(eng, spec, _voice_seed(spec)),
        )[0]
    kept = ours[np.abs(ours) > np.float32(1e-5)]
    assert len(kept) > 0 and np.array_equal(wav[: len(kept)], kept)


def test_rows_that_join_a_running_loop_get_the_tokens_they_get_alone(
    engine: tuple[ChatTTSEngine, Any], record_property: Any
) -> None:
    """Eight rows in different voices and sampling settings join a loop of 4 at different steps; each row's
    generator is its own, so its codes are those it makes alone. The identity share is recorded (float32,
    CPU: every row so far; the batch's matmuls may round differently from a batch of one elsewhere)."""
    eng, info = engine
    settings: list[dict[str, Any]] = [
        {"temperature": 0.3},
        {"temperature": 0.7, "top_k": 5},
        {"top_p": 0.9},
        {"temperature": 0.1},
    ]
    specs = {f"k{i}": Spec(chunks=(text,), model=info.id, seed=i, **settings[i % 4]) for i, text in enumerate(TEXTS)}
    alone = {key: _alone(eng, key, spec) for key, spec in specs.items()}
    loop = _loop(eng)
    waiting = list(specs.items())
    with torch.inference_mode():
        loop.join(waiting[:2])
        waiting = waiting[2:]
        step = 0
        while loop.keys() or waiting:
            step += 1
            if waiting and step % 5 == 0:
                free = loop.capacity - len(loop.keys())
                loop.join(waiting[:free])
                waiting = waiting[free:]
            loop.step()
    same = [key for key in specs if torch.equal(alone[key], _rec(loop)[key][0])]
    record_property("identical_share", f"{len(same)}/{len(specs)}")
    assert max(len(rows) for rows in loop.steps) == 4, "the loop ran full"
    assert len(same) >= len(specs) - 1, f"identical alone and joined: {same}"


def test_rows_of_different_temperature_top_k_and_voice_share_one_step(engine: tuple[ChatTTSEngine, Any]) -> None:
    eng, info = engine
    rows = [
        ("a", Spec(chunks=(TEXTS[2],), model=info.id, seed=1, temperature=0.3, top_k=20)),
        ("b", Spec(chunks=(TEXTS[2],), model=info.id, seed=2, temperature=0.9, top_k=3)),
        ("c", Spec(chunks=(TEXTS[2],), model=info.id, speaker=eng.speaker(4), seed=None, top_p=0.5)),
        ("d", Spec(chunks=(TEXTS[2],), model=info.id, temperature=0.5, **_recorded(eng))),
    ]
    loop = _loop(eng)
    forwards: list[int] = []
    _spy_forwards(loop, lambda emb, _mask: forwards.append(int(emb.shape[0])))
    with torch.inference_mode():
        decode_all(loop, rows)
    # One prefill of the four rows together (the recorded voice's codes make its prompt the longest, the others
    # left-padded to it), then forwards of all four.
    assert forwards[:2] == [4, 4]
    assert loop.steps[0] == ["a", "b", "c", "d"]
    codes = {key: _rec(loop)[key][0] for key, _ in rows}
    assert not torch.equal(codes["a"][:8], codes["b"][:8]), "each row samples with its own settings"
    for key, spec in rows:
        assert torch.equal(codes[key], _alone(eng, key, spec))


def test_rows_that_join_together_are_prefilled_in_one_forward_and_make_what_they_make_alone(
    engine: tuple[ChatTTSEngine, Any], record_property: Any
) -> None:
    """Four rows of different lengths join at once: one prefill forward, left-padded to the longest prompt, as
    ChatTTS pads a batch; each row's codes are those it makes alone (share recorded, as above)."""
    eng, info = engine
    rows = [(f"t{i}", Spec(chunks=(TEXTS[i],), model=info.id, seed=10 + i)) for i in (0, 3, 4, 6)]
    loop = _loop(eng)
    shapes: list[tuple[int, int]] = []
    padded: list[bool] = []

    def spy(emb: Any, mask: Any) -> None:
        shapes.append(tuple(emb.shape[:2]))
        padded.append(not bool(mask.all()))

    _spy_forwards(loop, spy)
    with torch.inference_mode():
        decode_all(loop, rows)
    assert shapes[0][0] == 4 and padded[0], "one prefill of the four rows, the shorter ones left-padded"
    assert shapes[1] == (4, 1), shapes[:2]
    same = [key for key, spec in rows if torch.equal(_rec(loop)[key][0], _alone(eng, key, spec))]
    record_property("identical_share", f"{len(same)}/{len(rows)}")
    assert len(same) >= len(rows) - 1, f"identical alone and prefilled together: {same}"


def test_a_padded_step_hands_the_gpt_the_mask_transformers_would_build(
    engine: tuple[ChatTTSEngine, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step of left-padded rows passes a ready 4-D mask: the GPT's hidden states equal, bit for bit, those it
    makes from the 2-D padding mask it would expand itself; a step without padding passes none."""
    eng, info = engine
    gpt, hidden = eng.chat.gpt.gpt, int(eng.chat.config.gpt.hidden_size)
    lengths = torch.tensor([20, 13, 7, 17])
    width = 20
    mask = torch.arange(width).unsqueeze(0) >= (width - lengths).unsqueeze(1)
    positions = (mask.long().cumsum(-1) - 1).masked_fill(~mask, 1)
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        prompt = torch.randn(4, width, hidden, generator=generator)
        out = gpt(inputs_embeds=prompt, attention_mask=mask.float(), position_ids=positions, use_cache=True)
        step = torch.cat([mask, torch.ones(4, 1, dtype=torch.bool)], 1).float()
        emb = torch.randn(4, 1, hidden, generator=generator)
        made = {
            name: gpt(
                inputs_embeds=emb,
                attention_mask=given,
                position_ids=lengths.unsqueeze(1),
                past_key_values=kvcache.shallow(out.past_key_values),
                use_cache=True,
                cache_position=torch.tensor([width]),
            ).last_hidden_state
            for name, given in (("2-D", step), ("4-D", step.bool()[:, None, None, :]))
        }
    assert torch.equal(made["2-D"], made["4-D"])
    # Steps on the CPU run engines/leanstep.py, which hands SDPA the mask transformers' SDPA attention gets.
    masks: dict[str, list[int]] = {"alone": [], "together": []}
    rows = [(f"m{i}", Spec(chunks=(TEXTS[i],), model=info.id, seed=20 + i)) for i in (0, 4)]
    call = LeanStep.__call__
    for name, batch in (("alone", rows[:1]), ("together", rows)):
        seen = masks[name]

        def spy(self: LeanStep, emb: Any, positions: Any, mask: Any, cache: Any, seen: list[int] = seen) -> Any:
            seen.append(0 if mask is None else mask.ndim)
            return call(self, emb, positions, mask, cache)

        monkeypatch.setattr(LeanStep, "__call__", spy)
        with torch.inference_mode():
            decode_all(_loop(eng), batch)
    alone, together = masks["alone"], masks["together"]
    assert len(alone) > 1 and set(alone) == {0}, "one row alone: no padding, no mask (attention skips it)"
    assert 4 in together, "left-padded rows: steps take the ready 4-D mask"


def test_pieces_join_cleanly_against_one_decode(engine: tuple[ChatTTSEngine, Any], record_property: Any) -> None:
    """Pieces of 8 tokens with LOOKAHEAD context against one decode of all the row's tokens."""
    eng, info = engine
    loop = _loop(eng, stream=8)
    with torch.inference_mode():
        pieces = decode_all(loop, [("j", Spec(chunks=(TEXTS[6],), model=info.id, seed=9))])["j"]
        hiddens = _rec(loop)["j"][1]
        whole = audio.fade_edges(loop.model.decode(hiddens, 0, len(hiddens), last=True), True, True)
    joined = np.concatenate([p.samples for p in pieces])
    assert len(pieces) >= 3 and [p.index for p in pieces] == list(range(len(pieces))) and pieces[-1].last
    assert len(joined) == len(whole) == SAMPLES_PER_TOKEN * len(hiddens) - SAMPLES_PER_TOKEN // 2
    snr = 10 * np.log10(np.sum(whole**2) / max(np.sum((joined - whole) ** 2), 1e-30))
    edges = np.cumsum([len(p.samples) for p in pieces])[:-1]
    steps = np.abs(np.diff(joined))
    at_joins = max(steps[e - 1] for e in edges)
    record_property("snr_db", round(float(snr), 1))
    record_property("join_step_vs_largest_step", round(float(at_joins / steps.max()), 3))
    assert snr > 60
    assert at_joins <= steps.max()


def _in_process_worker(redis: Redis, redis_url: str, model: tuple[ChatTTSEngine, Any], **env: str) -> Any:
    eng, info = model
    settings = from_env({"REDIS_URL": redis_url, "TTS_BATCH_SIZE": "3", "TTS_STREAM_TOKENS": "8", **env})
    return jobs.bind(eng, info, settings, redis), settings


def test_stored_chunks_are_their_announced_pieces_joined(
    engine: tuple[ChatTTSEngine, Any], redis: Redis, redis_url: str
) -> None:
    """A real rq worker (burst, in-process) makes two requests through the loop: each chunk's stored audio
    is byte for byte its pieces list joined (the list then dropped), and every piece was announced on its request's
    channel."""
    from worker import TTSWorker

    state, settings = _in_process_worker(redis, redis_url, engine)
    q = queueing.queue(redis, settings)
    specs = [
        _lasting(engine, Spec(chunks=(TEXTS[0], TEXTS[3]), model=engine[1].id, seed=1), 20),
        _lasting(engine, Spec(chunks=(TEXTS[5],), model=engine[1].id, seed=2, temperature=0.6), 20),
    ]
    listen = redis.pubsub(ignore_subscribe_messages=True)
    submitted = [queueing.submit(q, spec, settings) for spec in specs]
    listen.subscribe(*[f"tts:events:{job.id}" for job in submitted])
    # What each piece stored in its list held (the list is dropped once its chunk is stored).
    listed: dict[str, list[bytes]] = {}
    store_piece = state.loop.pool.piece

    def piece(token: str, cid: str, index: int, pcm: bytes) -> int:
        n = store_piece(token, cid, index, pcm)
        if n >= 0:
            listed[cid] = [*listed.get(cid, [])[:n], pcm]
        return n

    state.loop.pool.piece = piece
    TTSWorker([q], connection=redis, serializer=queueing.SERIALIZER, settings=settings, state=state).work(burst=True)
    news = []
    quiet = 0
    while quiet < 5:  # subscribe confirmations read as None too: stop after five empty reads in a row
        message = listen.get_message(timeout=0.1)
        quiet = quiet + 1 if message is None else 0
        if message is not None:
            news.append(json.loads(message["data"]))
    for job, spec in zip(submitted, specs):
        assert job.get_status(refresh=True) == "finished"
        for cid in spec.chunk_ids():
            pieces = listed[cid]
            assert len(pieces) >= 2 and b"".join(pieces) == redis.get(chunk_key(cid))
            assert not redis.exists(pieces_key(cid))  # the stored chunk replaced them
            announced = [e["n"] for e in news if e.get("event") == "piece" and e["chunk"] == cid]
            assert announced == list(range(len(pieces)))


def test_a_canceled_row_leaves_at_the_next_look_and_a_shared_one_stays(
    engine: tuple[ChatTTSEngine, Any], redis: Redis, redis_url: str
) -> None:
    """Two requests share a chunk; the loop holds the shared chunk and one of the canceled request's own.
    After the cancel, the first step that ends a look (LOOK_EVERY) after it drops the canceled row, and
    the loop keeps decoding the shared one to the end."""
    state, settings = _in_process_worker(redis, redis_url, engine, TTS_BATCH_SIZE="4")
    q = queueing.queue(redis, settings)
    shared = "The shared sentence is here."

    def lasting(seed: int) -> bool:
        # Random weights end some rows within a few tokens: not these. Both rows must outlast the steps that
        # fit in a look's interval after the cancel (a step of the tiny model is a millisecond or two), or the
        # shared row may end on its own before the cancel is seen.
        spec = Spec(chunks=(TEXTS[2], shared), model=engine[1].id, seed=seed)
        return all(len(_alone(engine[0], cid, spec.row(i))) >= 40 for i, cid in enumerate(spec.chunk_ids()))

    seed = next(s for s in range(1, 100) if lasting(s))
    canceled = Spec(chunks=(TEXTS[2], shared), model=engine[1].id, seed=seed)
    other = Spec(chunks=(shared,), model=engine[1].id, seed=seed)
    for spec in (canceled, other):
        queueing.submit(q, spec, settings)
    own, shared_id = canceled.chunk_ids()
    run = Tally()
    with torch.inference_mode():
        state.loop.advance(run)
        assert sorted(state.loop.decoder.keys()) == sorted([own, shared_id])
        state.loop.advance(run)
        canceled_at = time.monotonic()
        queueing.cancel(q, canceled.request_id(), canceled.chunk_ids(), settings.result_ttl)
        kept_until = []  # when each step that kept the canceled row ended
        rows = state.loop.decoder.keys
        while own in rows() and shared_id in rows():
            state.loop.advance(run)
            if own in rows():
                kept_until.append(time.monotonic())
        assert state.loop.decoder.keys() == [shared_id]
        # A step ending a look's interval after the cancel would have dropped it.
        assert all(t < canceled_at + LOOK_EVERY for t in kept_until), (kept_until, canceled_at)
        assert Pool(redis, "tts", 60).live(state.loop.token, [own]) == [False]
        while state.loop.decoder.keys():
            state.loop.advance(run)
    assert redis.exists(chunk_key(shared_id)) and not redis.exists(chunk_key(own)), (run.tokens, own)
    assert not redis.exists(f"tts:claim:tts:{own}"), "the canceled row's lease was given up"


def test_refinement_is_chat_infers_own_pass_and_both_schedulers_take_it(engine: tuple[ChatTTSEngine, Any]) -> None:
    """engines.refine (both schedulers' one refinement pass) gives what Chat.infer(refine_text_only=True)
    gives for the same prompt and seed; a row asking for it makes audio on either scheduler."""
    chat = engine[0].chat
    spec = Spec(chunks=("Hello there, a refined sentence.",), model=engine[1].id, seed=3, refine_text=True, oral=2)
    text = "hello there, a refined sentence."
    with torch.inference_mode():
        ours = refine(chat, spec, [text], 7, 48)
        theirs = chat.infer(
            [text],
            refine_text_only=True,
            do_text_normalization=False,
            split_text=False,
            params_refine_text=chat.RefineTextParams(
                prompt="[oral_2]", manual_seed=7, max_new_token=48, show_tqdm=False
            ),
        )
    assert ours == (theirs if isinstance(theirs, list) else [theirs]) and ours[0].strip()
    for continuous in (False, True):
        with torch.inference_mode():
            pieces = decode_all(engine[0].decoder(2, 24, continuous), [("refined", spec.row(0))])["refined"]
        assert pieces and pieces[-1].last and sum(len(p.samples) for p in pieces) > 0, continuous


def test_a_poison_request_fails_alone_and_its_batch_mates_finish_without_a_retry(
    engine: tuple[ChatTTSEngine, Any], redis: Redis, redis_url: str
) -> None:
    """A request whose row cannot be sampled (temperature 1e-40: the API refuses it, the queue may still hold
    it) joins the loop with another request's rows: it fails with its reason, the other finishes on its
    first run, and no lease is left behind."""
    from work.status import FAILURES, failure
    from worker import TTSWorker

    state, settings = _in_process_worker(redis, redis_url, engine)
    q = queueing.queue(redis, settings)
    good = _lasting(engine, Spec(chunks=(TEXTS[0], TEXTS[3]), model=engine[1].id, seed=1), 20)
    poison = Spec(chunks=(TEXTS[5],), model=engine[1].id, seed=2, temperature=1e-40)
    good_job = queueing.submit(q, good, settings)  # runs first, and claims the poison row beside its own
    poison_job = queueing.submit(q, poison, settings)
    poison_job.retries_left = 0  # its words are kept once its retries are spent: spend them now
    poison_job.save()
    TTSWorker([q], connection=redis, serializer=queueing.SERIALIZER, settings=settings, state=state).work(burst=True)
    good_job.refresh()
    assert good_job.get_status() == "finished" and good_job.retries_left == 2
    assert all(redis.exists(chunk_key(cid)) for cid in good.chunk_ids())
    assert poison_job.get_status(refresh=True) == "failed"
    assert failure(poison_job) == FAILURES["RowSettingsOutOfRange"]
    assert not redis.keys("tts:claim:*") and not state.loop.making


def test_claimed_rows_the_decoder_cannot_take_fail_alone_and_hold_no_lease(
    engine: tuple[ChatTTSEngine, Any], redis: Redis, redis_url: str
) -> None:
    """The decoder raises on a join (its own fault, not a row's): the rows it holds go on, the rows just
    claimed fail with the reason, and their leases are neither kept nor renewed."""
    state, settings = _in_process_worker(redis, redis_url, engine)
    q = queueing.queue(redis, settings)
    first = _lasting(engine, Spec(chunks=(TEXTS[2],), model=engine[1].id, seed=1), 30)
    queueing.submit(q, first, settings)
    run = Tally()
    with torch.inference_mode():
        state.loop.advance(run)
        assert state.loop.decoder.keys() == first.chunk_ids()
        later = Spec(chunks=(TEXTS[4], TEXTS[6]), model=engine[1].id, seed=3)
        queueing.submit(q, later, settings)

        def broken(rows: Any, places: Any = None) -> None:
            raise RuntimeError("the decoder's own fault")

        state.loop.decoder.join = broken
        state.loop.next_claim = 0.0
        state.loop.advance(run)
        assert state.loop.decoder.keys() == first.chunk_ids(), "the row in the loop goes on"
        assert set(state.loop.making) == set(first.chunk_ids())
        for cid in later.chunk_ids():
            assert not redis.exists(f"tts:claim:tts:{cid}")
        assert Pool(redis, "tts", 60).failures(later.chunk_ids()) == dict.fromkeys(later.chunk_ids(), "RuntimeError")
        while state.loop.decoder.keys():
            state.loop.advance(run)
    assert redis.exists(chunk_key(first.chunk_ids()[0]))


def test_out_of_memory_puts_rows_back_in_the_pool_and_every_chunk_is_still_made(
    engine: tuple[ChatTTSEngine, Any], redis: Redis, redis_url: str
) -> None:
    """Forwards of more than one row run out of memory: the rows that do not fit go back to the pool (no
    lease held), the loop holds one row at a time, and every chunk is made; none fails."""
    state, settings = _in_process_worker(redis, redis_url, engine)
    q = queueing.queue(redis, settings)
    spec = Spec(chunks=(TEXTS[0], TEXTS[1], TEXTS[3]), model=engine[1].id, seed=4)
    queueing.submit(q, spec, settings)
    loop = state.loop.decoder.inner
    forward = loop.model.forward

    def one_row_fits(emb: Any, *args: Any) -> Any:
        if emb.shape[0] > 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return forward(emb, *args)

    loop.model.forward = one_row_fits
    run = Tally()
    with torch.inference_mode():
        state.loop.advance(run)
        assert len(state.loop.decoder.keys()) == 1 and state.loop.decoder.capacity == 1
        held = state.loop.decoder.keys()[0]
        for cid in set(spec.chunk_ids()) - {held}:
            assert cid not in state.loop.making and not redis.exists(f"tts:claim:tts:{cid}"), "back in the pool"
        deadline = time.monotonic() + 120
        while not all(redis.exists(chunk_key(cid)) for cid in spec.chunk_ids()):
            assert time.monotonic() < deadline, "the chunks were not all made"
            state.loop.advance(run)
    assert not Pool(redis, "tts", 60).failures(spec.chunk_ids())


def test_one_draw_for_the_batch_is_a_multinomial_per_row_from_its_own_seed(engine: tuple[ChatTTSEngine, Any]) -> None:
    """The batched draw (`RowModel.draw`) gives, line for line, the code that `torch.multinomial` with the
    row's generator re-seeded (as ChatTTS samples) gives, whatever the probabilities and the batch mates."""
    eng, info = engine
    loop = _loop(eng)
    nv, width = loop.model.num_vq, int(eng.chat.gpt.num_audio_tokens)
    with torch.inference_mode():
        loop.join([(f"r{i}", Spec(chunks=(TEXTS[i],), model=info.id, seed=i)) for i in range(3)])
        rows = list(loop._rows) + list(loop._ended)
        torch.manual_seed(0)
        for trial in range(50):
            logits = torch.randn(len(rows) * nv, width) * (1 + trial % 5)
            logits[torch.rand(logits.shape) < 0.8] = -torch.inf  # as top-k and top-p leave them
            logits[:, trial % width] = 0.0  # never a line without a candidate
            probs = torch.softmax(logits, dim=-1)
            batched = loop.model.draw(rows, probs).view(len(rows), nv)
            for i, row in enumerate(rows):
                own = probs.narrow(0, i * nv, nv)
                generator = torch.Generator().manual_seed(row.seed)
                assert torch.equal(batched[i], torch.multinomial(own, 1, generator=generator).view(-1)), (trial, i)
                assert torch.equal(loop.model.draw([row], own), batched[i]), "a row's draw never depends on its mates"


def _lasting_seeds(eng: ChatTTSEngine, info: Any, text: str, tokens: int, seeds: range) -> Iterator[int]:
    """Seeds whose row of `text` makes at least `tokens` tokens alone (random weights end some rows early)."""
    return (s for s in seeds if len(_alone(eng, f"s{s}", Spec(chunks=(text,), model=info.id, seed=s))) >= tokens)


def test_a_parked_row_makes_the_codes_it_makes_unparked(engine: tuple[ChatTTSEngine, Any]) -> None:
    """A loop of 2 holds a request's chunks 1 and 2; a new request's first row joins beyond the 2 slots (the
    reserve) and steps at once, chunk 2 (the worst placed) is parked, its KV cache kept, and steps again when
    the first row ends. Every row's codes are those it makes without the newcomer, and alone."""
    eng, info = engine
    seeds = _lasting_seeds(eng, info, TEXTS[2], 40, range(1, 60))
    s1, s2 = next(seeds), next(seeds)
    longs = [(f"l{s}", Spec(chunks=(TEXTS[2],), model=info.id, seed=s)) for s in (s1, s2)]
    places = [Place(1, 0), Place(2, 0)]
    newcomer = ("f", Spec(chunks=(TEXTS[3],), model=info.id, seed=3))

    def run(reserve: int, join_at: int | None) -> ChatTTSLoop:
        loop = eng.loop(2, 24, reserve=reserve)
        loop.record = {}
        with torch.inference_mode():
            loop.join(longs, places)
            while loop.keys():
                if len(loop.steps) == join_at:
                    loop.join([newcomer], [Place(0, 5)])
                    assert loop.parked() == [longs[1][0]]
                    with pytest.raises(ValueError):
                        loop.join([("g", newcomer[1])], [Place(0, 6)])  # past capacity + reserve
                loop.step()
        return loop

    plain, preempted = run(0, None), run(1, 5)
    assert max(len(keys) for keys in preempted.steps) == 2, "never more than `capacity` rows a step"
    assert preempted.steps[5] == [longs[0][0], "f"], "the first row steps right after its prefill"
    parked_for = [i for i, keys in enumerate(preempted.steps) if longs[1][0] not in keys and i < 40]
    assert parked_for and parked_for[0] == 5 and len(parked_for) < 40, parked_for
    for key, _ in longs:
        assert torch.equal(_rec(preempted)[key][0], _rec(plain)[key][0]), key
    assert torch.equal(_rec(preempted)["f"][0], _alone(eng, "f", newcomer[1]))


def _preempting(eng: ChatTTSEngine, info: Any, clock: Any = None) -> tuple[ChatTTSLoop, list[tuple[str, Spec]]]:
    """A loop of 2 slots (reserve 2) stepping two long later rows of a request; the rows."""
    seeds = _lasting_seeds(eng, info, TEXTS[2], 40, range(1, 60))
    longs = [(f"l{s}", Spec(chunks=(TEXTS[2],), model=info.id, seed=s)) for s in (next(seeds), next(seeds))]
    extra = {"clock": clock} if clock is not None else {}
    loop = eng.loop(2, 24, reserve=2, **extra)
    loop.record = {}
    with torch.inference_mode():
        loop.join(longs, [Place(1, 0), Place(2, 0)])
        for _ in range(3):
            loop.step()
    return loop, longs


def test_out_of_memory_gives_a_parked_row_back_first_and_stops_preemption_for_a_while(
    engine: tuple[ChatTTSEngine, Any],
) -> None:
    """A newcomer parks the worst placed of two long rows; the next step runs out of memory once: the parked
    row is given back unmade (its cache is memory the batch can use), nobody fails, the stepping rows make
    their own codes, and no first row joins beyond the slots until OOM_HOLD has passed."""
    eng, info = engine
    now = [0.0]
    loop, longs = _preempting(eng, info, clock=lambda: now[0])
    newcomer = ("f", Spec(chunks=(TEXTS[3],), model=info.id, seed=3))
    forward, short = loop.model.forward, [False]

    def once_short(emb: Any, *args: Any) -> Any:
        if short[0]:
            short[0] = False
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return forward(emb, *args)

    loop.model.forward = once_short  # type: ignore[method-assign, assignment]
    with torch.inference_mode():
        loop.join([newcomer], [Place(0, 5)])
        assert loop.parked() == [longs[1][0]]
        short[0] = True
        assert not [p.error for p in loop.step() if p.error is not None]
        assert loop.take_returned() == [longs[1][0]], "the parked row, not a stepping one"
        assert loop.parked() == [] and sorted(loop.keys()) == sorted([longs[0][0], "f"])
        assert loop.preemptible() == 0
        with pytest.raises(ValueError):
            loop.join([("g", Spec(chunks=(TEXTS[4],), model=info.id, seed=4))], [Place(0, 6)])
        now[0] += rowfaults.OOM_HOLD
        assert loop.preemptible() == 1, "one later row steps: one first row may preempt it again"
        while loop.keys():
            assert all(p.error is None for p in loop.step())
    assert torch.equal(_rec(loop)[longs[0][0]][0], _alone(eng, *longs[0]))
    assert torch.equal(_rec(loop)["f"][0], _alone(eng, *newcomer))


def test_a_failing_row_frees_its_slot_for_a_parked_row_and_a_parked_row_leaves_with_its_request(
    engine: tuple[ChatTTSEngine, Any],
) -> None:
    """Two newcomers park both long rows; one newcomer's step raises: it fails alone, the best placed parked
    row steps again at once and makes its own codes. The other parked row leaves (its request is gone)."""
    eng, info = engine
    loop, longs = _preempting(eng, info)
    sample = loop.model.sample

    def faulty(rows: list[Any], hidden: Any) -> None:
        if any(row.key == "bad" and row.made >= 2 for row in rows):
            raise RuntimeError("a fault of row 'bad'")
        sample(rows, hidden)

    loop.model.sample = faulty  # type: ignore[method-assign, assignment]
    good = (
        "good",
        Spec(chunks=(TEXTS[3],), model=info.id, seed=next(_lasting_seeds(eng, info, TEXTS[3], 20, range(1, 60)))),
    )
    bad = (
        "bad",
        Spec(chunks=(TEXTS[4],), model=info.id, seed=next(_lasting_seeds(eng, info, TEXTS[4], 10, range(1, 60)))),
    )
    with torch.inference_mode():
        loop.join([good, bad], [Place(0, 5), Place(0, 6)])
        assert sorted(loop.parked()) == sorted(key for key, _ in longs)
        while "bad" not in loop._failed:
            assert not [p for p in loop.step() if p.error is not None]
        assert loop.parked() == [longs[1][0]], "the best placed parked row took the failed row's slot at once"
        errors = [(p.key, p.error) for p in loop.step() if p.error is not None]
        assert errors == [("bad", f"{rowfaults.ROW_RAISED} (RuntimeError)")]
        assert loop.steps[-1] == ["good", longs[0][0]]
        loop.leave([longs[1][0]])
        assert loop.parked() == [] and set(loop.keys()) == {"good", longs[0][0]}
        while loop.keys():
            assert all(p.error is None for p in loop.step())
    assert torch.equal(_rec(loop)[longs[0][0]][0], _alone(eng, *longs[0]))
    assert torch.equal(_rec(loop)["good"][0], _alone(eng, *good))


def test_without_a_reserve_a_full_loop_parks_nothing(engine: tuple[ChatTTSEngine, Any]) -> None:
    eng, info = engine
    loop = eng.loop(1, 24)
    with torch.inference_mode():
        loop.join([("a", Spec(chunks=(TEXTS[2],), model=info.id, seed=1))])
        with pytest.raises(ValueError):
            loop.join([("b", Spec(chunks=(TEXTS[3],), model=info.id, seed=2))])
    assert loop.parked() == []


@pytest.fixture(scope="module")
def uncapped(tmp_path_factory: pytest.TempPathFactory) -> tuple[ChatTTSEngine, Any]:
    """The tiny checkpoint with its 48-token cap lifted: each row runs to its own budget or end token, as real
    rows do (`python -m engines.tiny_checkpoint DIR --max-new-token 2048`)."""
    directory = tiny_checkpoint.write(tmp_path_factory.mktemp("uncapped") / "model", max_new_token=2048)
    return _exact(directory)


@pytest.mark.parametrize("reserve", ["4", "0"], ids=["reserve", "no-reserve"])
def test_a_short_request_behind_a_long_one_joins_at_the_next_look(
    uncapped: tuple[ChatTTSEngine, Any], redis: Redis, redis_url: str, reserve: str, record_property: Any
) -> None:
    """A long request's rows hold both slots of a worker's loop; a short request arrives. With a reserve (the
    default), its first row is claimed at the loop's next look at the pool and steps in the step after its
    prefill, the long request's worst placed row parked meanwhile; without one, it waits for a row to end."""
    eng, info = uncapped
    state, settings = _in_process_worker(redis, redis_url, uncapped, TTS_BATCH_SIZE="2", TTS_PREEMPT_ROWS=reserve)
    q = queueing.queue(redis, settings)
    texts = (TEXTS[6], TEXTS[2], TEXTS[0])

    def request(seed: int) -> Spec:
        return Spec(chunks=texts, model=info.id, seed=seed)

    def long_enough(seed: int) -> bool:
        spec = request(seed)
        return all(len(_alone(eng, cid, spec.row(i))) >= 60 for i, cid in enumerate(spec.chunk_ids()[:2]))

    long = request(next(s for s in range(1, 60) if long_enough(s)))
    short = Spec(chunks=(TEXTS[5],), model=info.id, seed=next(_lasting_seeds(eng, info, TEXTS[5], 8, range(1, 60))))
    key = short.chunk_ids()[0]
    run = Tally()
    queueing.submit(q, long, settings)
    loop = state.loop.decoder.inner
    with torch.inference_mode():
        state.loop.advance(run)
        assert loop.keys() == long.chunk_ids()[:2], "the long request holds every slot"
        state.loop.advance(run)
        queueing.submit(q, short, settings)
        due, late = state.loop.next_claim, 0
        while not any(key in keys for keys in loop.steps):
            began = time.monotonic()
            state.loop.advance(run)
            late += began >= due and not any(key in keys for keys in loop.steps)
        held = loop.keys()
        while state.loop.advance(run):
            pass
    record_property("advances_late", late)
    if reserve == "0":
        assert late > 0 and not set(long.chunk_ids()[:2]) <= set(held), "it waited for a long row to end"
    else:
        assert late == 0, f"{late} advance(s) after the look was due went without the short row"
        assert loop.parked() == [] and set(held) >= set(long.chunk_ids()[:2]) | {key}, held
        waited = [i for i, keys in enumerate(loop.steps) if long.chunk_ids()[1] not in keys and key in keys]
        record_property("steps_the_parked_row_lost", len(waited))
    for cid in long.chunk_ids() + short.chunk_ids():
        assert redis.exists(chunk_key(cid)), cid
