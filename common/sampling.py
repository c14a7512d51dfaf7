"""The ranges of a request's settings (what the API takes, what the worker checks a row against again, and what a
failure says of them) and the speed's prompt; their defaults are the Spec's (cache.py)."""

from __future__ import annotations

from cache import Spec

# The temperature divides the logits before the softmax: near zero the
# quotients overflow float32 and the probabilities turn to NaN (at 1e-40, say).
# At 0.001 the logits would have to exceed 3e35 to overflow; sampling there is
# already as good as greedy, and the request's identity keeps 4 decimals.
TEMPERATURE_MIN = 0.001
TEMPERATURE_MAX = 1
# top_p in (0, 1]: ChatTTS's warper keeps at least 3 codes, so no top_p leaves none.
TOP_P_MAX = 1
TOP_K_MIN = 1
TOP_K_MAX = 100
SPEED_MIN = 1
SPEED_MAX = 9


def speed_prompt(speed: int) -> str:
    """ChatTTS's prompt for `speed` (1 to 9), which goes before each text the model speaks."""
    return f"[speed_{speed}]"


def ranges_in_words() -> str:
    """The ranges, as a failure's words say them ("temperature 0.001-1, ... speed 1-9")."""
    return (
        f"temperature {TEMPERATURE_MIN}-{TEMPERATURE_MAX}, top_p 0-{TOP_P_MAX}, top_k {TOP_K_MIN}-{TOP_K_MAX}, "
        f"speed {SPEED_MIN}-{SPEED_MAX}"
    )


def out_of_range(spec: Spec) -> str | None:
    """The first sampling setting of `spec` outside the API's ranges, as "field: why"; None when all are in.

    The web side refuses such a body (422 naming the field); the worker asks
    again of every row it is given, as a row may come from anywhere that can
    write to the queue.
    """
    checks = (
        ("temperature", TEMPERATURE_MIN <= spec.temperature <= TEMPERATURE_MAX, f"{TEMPERATURE_MIN} to 1"),
        ("top_p", 0 < spec.top_p <= TOP_P_MAX, "greater than 0 and at most 1"),
        ("top_k", TOP_K_MIN <= spec.top_k <= TOP_K_MAX, f"{TOP_K_MIN} to {TOP_K_MAX}"),
        ("speed", SPEED_MIN <= spec.speed <= SPEED_MAX, f"{SPEED_MIN} to {SPEED_MAX}"),
    )
    return next((f"{name}: must be {words}" for name, ok, words in checks if not ok), None)
