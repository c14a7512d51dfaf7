"""Who reads /metrics and /metrics/process (web/context.py guard_operator): the operators' key when it is set,
never a tenant under isolated tenancy."""

from __future__ import annotations

from typing import Any, Callable

import pytest
from conftest import HTTP, Stack

ALICE, BOB = "alice-metrics-key-01234567", "bob-metrics-key-0123456789"
OPERATOR = "operators-metrics-key-0123456789"
TENANTS = f"alice={ALICE},bob={BOB}"
ROUTES = ("/metrics", "/metrics/process")


def test_a_tenant_cannot_read_the_metrics_of_an_isolated_service(stack_factory: Callable[..., Stack]) -> None:
    stack = stack_factory(TTS_ENGINE="tone", TTS_API_KEYS=TENANTS, TTS_TENANCY="isolated", TTS_METRICS_KEY=OPERATOR)
    stack.start_web()
    for route in ROUTES:
        for key, status in ((BOB, 403), (ALICE, 403), (None, 401), (BOB + "x", 401), (OPERATOR, 200)):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            r = HTTP.get(stack.url + route, headers=headers)
            assert r.status_code == status, (route, key and key[:5], r.text)
            if status == 200:
                assert "tts_build_info" in r.text
            else:
                assert r.json()["detail"] and "tts_" not in r.text
                assert OPERATOR not in r.text and BOB not in r.text
    # The operators' key is no tenant's: it opens nothing else.
    r = HTTP.get(stack.url + "/v1/voices", headers={"Authorization": f"Bearer {OPERATOR}"})
    assert r.status_code == 401
    assert stack.web is not None and OPERATOR not in stack.web.output()


@pytest.mark.parametrize(
    ("env", "key", "status"),
    [
        pytest.param({}, None, 200, id="no-keys-open"),
        pytest.param({"TTS_API_KEYS": TENANTS}, BOB, 200, id="shared-any-tenant"),
        pytest.param({"TTS_API_KEYS": TENANTS}, None, 401, id="shared-no-key"),
        pytest.param({"TTS_API_KEYS": TENANTS, "TTS_TENANCY": "isolated"}, BOB, 403, id="isolated-no-operator-key"),
        pytest.param({"TTS_API_KEYS": TENANTS, "TTS_METRICS_KEY": OPERATOR}, BOB, 403, id="shared-with-operator-key"),
        pytest.param({"TTS_API_KEYS": TENANTS, "TTS_METRICS_KEY": OPERATOR}, OPERATOR, 200, id="operator"),
        pytest.param({"TTS_METRICS_KEY": OPERATOR}, None, 401, id="operator-key-without-tenants"),
        pytest.param({"TTS_METRICS_KEY": OPERATOR}, OPERATOR, 200, id="operator-without-tenants"),
    ],
)
def test_who_reads_the_metrics(
    web_client: Callable[..., Any], env: dict[str, str], key: str | None, status: int
) -> None:
    client = web_client(TTS_ENGINE="tone", **env)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    for route in ROUTES:
        assert client.get(route, headers=headers).status_code == status, route
    doc = client.get("/openapi.json", headers=headers).json()
    answers = set(doc["paths"]["/metrics"]["get"]["responses"])
    closed = "TTS_METRICS_KEY" in env or env.get("TTS_TENANCY") == "isolated"
    assert ({"401", "403"} <= answers) is closed


def test_the_operators_key_is_not_a_tenants() -> None:
    from common.settings import SettingsError, from_env

    with pytest.raises(SettingsError, match="TTS_METRICS_KEY") as info:
        from_env({"TTS_API_KEYS": f"alice={OPERATOR}", "TTS_METRICS_KEY": OPERATOR})
    assert OPERATOR not in str(info.value)
    with pytest.raises(SettingsError, match="TTS_METRICS_KEY"):
        from_env({"TTS_METRICS_KEY": "short"})
