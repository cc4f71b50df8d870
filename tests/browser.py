"""A real browser for the tests of the dashboard and the report: Debian's Chromium driven by
Playwright for Python (the test set-up installs the ``chromium`` package when it runs as root
with apt-get; Playwright's own browser downloads are never used).

``browser_page(tmp_path)`` yields a Playwright page, or skips the test with the reason when
Playwright or the browser is missing. The flags keep a headless Chromium off the network: a
machine without one otherwise stalls on its background requests."""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator

import pytest

CHROMIUM = os.environ.get("ABS_TEST_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@contextlib.contextmanager
def browser_page(tmp_path: Path) -> Iterator["object"]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("Playwright for Python is not installed (pip install -e '.[test]')")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"no Chromium at {CHROMIUM}: install Debian's 'chromium' package (scripts/test does so as root) "
                    "or point ABS_TEST_CHROMIUM at a Chromium binary")
    profile = tmp_path / "chromium-profile"
    profile.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(str(profile), executable_path=CHROMIUM, headless=True,
                                                         args=ARGS, viewport={"width": 1280, "height": 900})
        try:
            page = context.pages[0] if context.pages else context.new_page()
            page.set_default_timeout(60_000)
            yield page
        finally:
            context.close()
