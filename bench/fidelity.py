"""How close a tuned ChatTTS stays to float32: first-step logits, sampled codes and decoder output.

The rule every engine switch meets before it is on by default (tuning.py):
on the same checkpoint, speaker, seed and text, the first-step logits of the
tuned GPT reach a cosine similarity of at least MIN_COSINE with float32's.
How many of the first sampled steps match is reported beside it: sampling
amplifies any difference once one code differs, so it is a symptom, not the
rule. Calls ChatTTS 0.2.5's internals (tokenizer, embed, GPT, decoder)
directly, never the service's engine. Imports torch: benches and tests only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import torch.nn.utils.parametrize as P

from cache import DEFAULT_SPEED, DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P
from common import sampling

MIN_COSINE = 0.99
# The service's own defaults (cache.Spec): the sampling the users get.
SAMPLING = {
    "prompt": sampling.speed_prompt(DEFAULT_SPEED),
    "temperature": DEFAULT_TEMPERATURE,
    "top_P": DEFAULT_TOP_P,
    "top_K": DEFAULT_TOP_K,
}


@dataclass(frozen=True)
class Fidelity:
    """One variant against float32 on one text.

    cosine: first-step logits, all codebooks flattened. matching: of the first
    `steps` sampled steps, how many equal float32's in every codebook,
    position by position; prefix: how many leading steps do. decoder_cosine:
    the decoder's mel output for float32's codes, variant decoder against
    float32's.
    """

    cosine: float
    matching: int
    prefix: int
    steps: int
    decoder_cosine: float

    @property
    def passes(self) -> bool:
        return self.cosine >= MIN_COSINE


def speaker_embedding(chat: Any, seed: int) -> torch.Tensor:
    """A voice drawn from `seed` on the CPU, as the engine draws it."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    std, mean = chat.speaker.std.float().cpu(), chat.speaker.mean.float().cpu()
    return torch.randn(std.shape[0], generator=generator) * std + mean


@torch.inference_mode()
def first_logits(chat: Any, text: str, spk_emb: torch.Tensor) -> torch.Tensor:
    """The GPT's logits for the first audio code after `text`: (num_vq, num_audio_tokens), float32."""
    prompts = chat.speaker.decorate_code_prompts([text], SAMPLING["prompt"], None, spk_emb)
    input_ids, attention_mask, text_mask = chat.tokenizer.encode(
        prompts, chat.config.gpt.num_vq, device=chat.device_gpt
    )
    emb = chat.embed(input_ids, text_mask)
    chat.speaker.apply(emb, spk_emb, input_ids, chat.tokenizer.spk_emb_ids, chat.device_gpt)
    # The prefill as ChatTTS's `generate` makes it (its inputs, mask buffer and arguments), so that a compiled
    # GPT runs the graph the sampled steps below run first instead of compiling one of its own.
    length = input_ids.shape[1]
    mask = torch.ones((input_ids.shape[0], length + 1), dtype=torch.bool, device=input_ids.device)
    mask.narrow(1, 0, length).copy_(attention_mask)
    inputs = chat.gpt._prepare_generation_inputs(input_ids, None, mask.narrow(1, 0, length))
    inputs.inputs_embeds = emb
    inputs.to(chat.device_gpt, chat.gpt.gpt.dtype)
    out = chat.gpt.gpt(
        attention_mask=inputs.attention_mask,
        position_ids=inputs.position_ids,
        past_key_values=inputs.past_key_values,
        inputs_embeds=inputs.inputs_embeds,
        use_cache=True,
        output_attentions=False,
        cache_position=inputs.cache_position,
    )
    hidden = out.last_hidden_state[:, -1].float()
    with P.cached():
        return torch.stack([head(hidden)[0] for head in chat.gpt.head_code]).float()


@torch.inference_mode()
def sampled_codes(chat: Any, text: str, spk_emb: torch.Tensor, seed: int, steps: int) -> tuple[torch.Tensor, Any]:
    """The first `steps` audio codes sampled for `text` under `seed`, (T <= steps, num_vq), and their hiddens."""
    chat.context.set(False)
    params = chat.InferCodeParams(spk_emb=spk_emb, manual_seed=seed, max_new_token=steps, show_tqdm=False, **SAMPLING)
    result = next(chat._infer_code([text], False, chat.device, True, params))
    return result.ids[0].cpu(), result.hiddens[0]


@torch.inference_mode()
def decoded(decoder: Any, hiddens: torch.Tensor) -> torch.Tensor:
    """Mel frames `decoder` makes from one text's GPT hiddens (T, hidden), float32 on the CPU."""
    return decoder(hiddens.permute(1, 0).unsqueeze(0).float()).float().cpu()


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def compare(
    chat: Any, base: tuple[Any, Any], variant: tuple[Any, Any], text: str, seed: int = 2, steps: int = 64
) -> Fidelity:
    """`variant` (gpt, decoder) against `base` (float32) on `chat`, which holds `base` again afterwards.

    Each pair is swapped into `chat.gpt.gpt` and `chat.decoder` in turn.
    """
    spk_emb = speaker_embedding(chat, seed)
    runs = []
    try:
        for gpt, decoder in (base, variant):
            chat.gpt.gpt, chat.decoder = gpt, decoder
            runs.append((first_logits(chat, text, spk_emb), *sampled_codes(chat, text, spk_emb, seed, steps)))
    finally:
        chat.gpt.gpt, chat.decoder = base
    (logits0, codes0, hiddens0), (logits1, codes1, _) = runs
    same = [i < len(codes0) and i < len(codes1) and bool(torch.equal(codes0[i], codes1[i])) for i in range(steps)]
    prefix = same.index(False) if False in same else steps
    return Fidelity(
        cosine=cosine(logits0, logits1),
        matching=sum(same),
        prefix=prefix,
        steps=steps,
        decoder_cosine=cosine(decoded(base[1], hiddens0), decoded(variant[1], hiddens0)),
    )
