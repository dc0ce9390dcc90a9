"""Launching the system's Chromium, headless, for the browser tests."""

from __future__ import annotations

from collections.abc import Sequence

from playwright.sync_api import Browser, Playwright

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking")


def launch_chromium(playwright: Playwright, extra_args: Sequence[str] = ()) -> Browser:
    return playwright.chromium.launch(
        executable_path=CHROMIUM, headless=True, args=[*CHROMIUM_ARGS, *extra_args]
    )
