"""Headless Chromium for browser tests: the system (Debian) chromium driven by Playwright.

Nothing is downloaded at run time: `playwright install` is never run; .ci/run installs the apt package.
Without chromium the tests are skipped locally, and fail in CI (CI=true), where it must be present.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


class Browser:
    def __init__(self, browser: Any) -> None:
        self.browser = browser
        self.errors: list[str] = []  # uncaught errors of every page, checked by the tests

    def new_page(self, url: str) -> Any:
        page = self.browser.new_page(viewport={"width": 1400, "height": 900})
        page.set_default_timeout(20000)
        page.on("pageerror", lambda e: self.errors.append(str(e)))
        page.goto(url)
        return page


@contextmanager
def open_browser() -> Iterator[Browser]:
    if not (os.path.exists(CHROMIUM) or shutil.which("chromium")):
        message = "chromium is not installed (apt-get install -y chromium)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            yield Browser(browser)
        finally:
            browser.close()
