"""The rollouts dashboard in headless Chromium against a real server.

Two aliases: ``assistant`` (automatic, its canary failing half its streams) and ``manual``
(weights by hand). The page must plot every version's series, show the automatic rollback
and its reason once it happens, and promote the manual alias from its button. Waits are on
what the page shows (``wait_for_function``/``wait_for_selector`` with a deadline); the
screenshot is kept in the test's tmp dir (``dashboard.png``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, Page

from tests.server import ServerProcess

pytestmark = pytest.mark.browser

WAIT_MS = 30_000
CONFIG = """
[[alias]]
name = "assistant"
rollout = "auto"
[[alias.version]]
name = "v1"
model = "words"
weight = 50
stable = true
[[alias.version]]
name = "v2"
model = "words"
weight = 50
fault_error_rate = 0.5
fault_latency_ms = 5

[[alias]]
name = "manual"
rollout = "manual"
[[alias.version]]
name = "old"
model = "words"
weight = 95
stable = true
[[alias.version]]
name = "new"
model = "words"
weight = 5
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    config = tmp_path_factory.mktemp("dashboard") / "models.toml"
    config.write_text(CONFIG)
    with ServerProcess("--no-model", "--models-config", str(config)) as server:
        yield server.wait_ready()


@pytest.fixture
def page(browser: Browser, server: ServerProcess) -> Iterator[Page]:
    context = browser.new_context(
        base_url=server.base_url, viewport={"width": 1280, "height": 1400}
    )
    context.set_default_timeout(WAIT_MS)
    page = context.new_page()
    page.goto("/dashboard?interval_ms=250")
    yield page
    context.close()


def _drive_until_rolled_back(server: ServerProcess) -> None:
    """Paced native streams (so each has inter-token gaps), each read to its end."""
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        for n in range(400):
            for model in ("assistant", "manual"):
                body = {
                    "model": model,
                    "prompt": "one two three",
                    "interval_ms": 1,
                    "user": f"u{n}",
                }
                created = client.post("/v1/streams", json=body)
                assert created.status_code == 201, created.text
                client.get(created.json()["events_url"])  # the whole stream, to its end
            state = client.get("/v1/admin/rollouts").json()["rollouts"][0]["state"]
            if state == "rolled_back":
                return
    raise AssertionError("the faulty canary was never rolled back")


def test_dashboard_plots_versions_shows_the_rollback_and_promotes_by_hand(
    page: Page, server: ServerProcess, tmp_path: Path
) -> None:
    _drive_until_rolled_back(server)
    assistant = page.locator('section[data-alias="assistant"]')
    assistant.locator(".state.rolled_back").wait_for()
    page.wait_for_function("window.dashboard.polls >= 3")
    for chart in ("ttft", "itl", "errors", "weight"):
        lines = assistant.locator(f'svg[data-chart="{chart}"] polyline')
        assert {lines.nth(i).get_attribute("data-version") for i in range(lines.count())} == {
            "v1",
            "v2",
        }, chart
    rollback = assistant.locator('tr[data-action="roll_back"]')
    rollback.wait_for()
    assert "error: " in rollback.inner_text()
    assert "auto" in rollback.inner_text()
    assert "v1 100% · v2 0%" in assistant.locator(".weights").inner_text()

    manual = page.locator('section[data-alias="manual"]')
    manual.locator('button[data-action="promote"]').click()
    manual.locator('tr[data-action="step"]').wait_for()
    assert "old 75% · new 25%" in manual.locator(".weights").inner_text()
    assert page.locator("#error").inner_text() == ""
    manual.locator('button[data-action="start"]').click()  # manual: refused, and said so
    page.wait_for_function("document.getElementById('error').textContent.includes('by hand')")
    page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
    assert (tmp_path / "dashboard.png").stat().st_size > 0
