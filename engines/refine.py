"""ChatTTS's text refinement pass (`refine_text`), as Chat.infer runs it: one place for both schedulers."""

from __future__ import annotations

from typing import Any, Sequence

from cache import Spec


def refine(chat: Any, spec: Spec, texts: Sequence[str], seed: int, max_new_token: int) -> list[str]:
    """`texts` (normalized) rewritten by ChatTTS's refiner with `spec`'s oral/laugh/break prompt and `seed`.

    At most min(384, max_new_token) tokens each (Chat.infer's refine
    default); the break tokens the refiner emits are dropped, as Chat.infer
    drops them.
    """
    prompt = "".join(
        f"[{name}_{value}]"
        for name, value in (("oral", spec.oral), ("laugh", spec.laugh), ("break", spec.break_))
        if value is not None
    )
    params = chat.RefineTextParams(
        prompt=prompt, max_new_token=min(384, max_new_token), manual_seed=seed, show_tqdm=False
    )
    refined = chat._refine_text(list(texts), chat.device, params)
    ids = [i[i.less(chat.tokenizer.break_0_ids)] for i in refined.ids]
    out = list(chat.tokenizer.decode(ids))
    refined.destroy()
    return out
