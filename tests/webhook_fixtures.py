"""Fixtures of the webhook tests, registered by a test module's `pytest_plugins = ["webhook_fixtures"]`.

Apart from webhook_helpers.py because a plugin module must not be imported by name before pytest registers it
(pytest could no longer rewrite its asserts)."""

from __future__ import annotations

from typing import Iterator

import pytest
from webhook_helpers import Receiver


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    made = Receiver()
    yield made
    made.stop()
