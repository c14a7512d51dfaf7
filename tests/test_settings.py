"""Settings from the environment: defaults, and clear errors naming the variable."""

from __future__ import annotations

import pytest

from settings import Settings, SettingsError, from_env


def test_defaults() -> None:
    s = from_env({})
    assert s == Settings()
    assert s.redis_url == "redis://127.0.0.1:6379/0"
    assert s.model_path is None


def test_values_are_read(tmp_path: object) -> None:
    s = from_env({"REDIS_URL": "rediss://:pw@host:6380/2", "PORT": "9000", "TTS_MODEL_PATH": str(tmp_path),
                  "TTS_DEVICE": "cuda:1", "TTS_MAX_CHARS": "100", "TTS_RESULT_TTL": "60", "TTS_DEFAULT_SEED": "7"})
    assert (s.redis_url, s.port, s.model_path, s.device) == ("rediss://:pw@host:6380/2", 9000, str(tmp_path), "cuda:1")
    assert (s.max_chars, s.result_ttl, s.default_seed) == (100, 60, 7)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        pytest.param("PORT", "http", id="port-word"),
        pytest.param("PORT", "70000", id="port-range"),
        pytest.param("REDIS_URL", "localhost:6379", id="redis-no-scheme"),
        pytest.param("TTS_MODEL_PATH", "/no/such/dir", id="model-path-missing"),
        pytest.param("TTS_DEVICE", "gpu", id="device"),
        pytest.param("TTS_MAX_CHARS", "0", id="max-chars-zero"),
        pytest.param("TTS_RESULT_TTL", "-5", id="ttl-negative"),
        pytest.param("TTS_DEFAULT_SEED", "1.5", id="seed-float"),
        pytest.param("TTS_ENGINE", "espeak", id="engine"),
    ],
)
def test_bad_value_names_the_variable(name: str, value: str) -> None:
    with pytest.raises(SettingsError) as info:
        from_env({name: value})
    assert name in str(info.value)
    assert "expected" in str(info.value)
