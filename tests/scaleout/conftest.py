"""Fixtures of the scale-out tests: a flushed Redis database per test, headless Chromium."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import redis
from playwright.sync_api import Browser, sync_playwright

from tests.redis_server import RedisServer
from tests.web.chromium import launch_chromium

_DATABASES = itertools.count(1)


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """A flushed database of the session's Redis."""
    url = f"redis://127.0.0.1:{redis_server.port}/{next(_DATABASES) % 16}"
    with redis.Redis.from_url(url) as client:
        client.flushdb()
    return url


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as driver:
        browser = launch_chromium(driver)
        yield browser
        browser.close()
