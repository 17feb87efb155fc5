"""The dashboard in a real headless Chromium (Debian's /usr/bin/chromium driven by Playwright).

Needs ``apt-get install -y --no-install-recommends chromium fonts-liberation fonts-dejavu-core`` and
``pip install playwright`` (no ``playwright install``: the system Chromium is used).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from playwright.sync_api import expect

from hivetrain.coordinator.dashboard import DashboardServer, LossPoint, PeerRow
from tests.coordinator.conftest import SnapshotHolder, make_snapshot

CHROMIUM = "/usr/bin/chromium"
APT_PACKAGES = "chromium fonts-liberation fonts-dejavu-core"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@pytest.fixture
def browser_page() -> Iterator[object]:
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} missing: apt-get install -y --no-install-recommends {APT_PACKAGES}")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, timeout=60_000)
        try:
            page = browser.new_page(viewport={"width": 1366, "height": 900})
            page.set_default_timeout(20_000)
            yield page
        finally:
            browser.close()


@pytest.mark.slow
def test_page_shows_run_and_updates_live(
    browser_page, dashboard: DashboardServer, holder: SnapshotHolder, tmp_path: Path
) -> None:
    page = browser_page
    problems: list[str] = []
    page.on("console", lambda msg: problems.append(f"console.{msg.type}: {msg.text}") if msg.type == "error" else None)
    page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))

    page.goto(dashboard.url, wait_until="load")
    assert page.title() == "hivetrain · demo-run"
    peers_text = page.inner_text("#sec-peers")
    assert "alice-3090" in peers_text and "dave-colab" in peers_text
    assert "bob's <b>laptop</b>" in peers_text  # shown as text, not markup
    assert page.locator("#sec-chart svg polyline").count() == 1
    assert page.locator("#sec-chart svg circle").count() == 24
    assert "epoch (outer steps)" in page.inner_text("#sec-chart")
    page.evaluate("window.__sameDocument = true")

    snap = make_snapshot()
    newcomer = PeerRow("12D3KooWNewcomerPeer000042", "trainer", None, 99.0, 24, 0.5, "direct", "zebra-42")
    holder.set(
        replace(
            snap,
            epoch=24,
            peers=(*snap.peers, newcomer),
            loss_curve=(*snap.loss_curve, LossPoint(snap.taken_at, 24, 1.5)),
        )
    )
    # expect() polls from Playwright's isolated world: the page's CSP forbids eval, so no wait_for_function(str)
    expect(page.locator("#sec-peers")).to_contain_text("zebra-42", timeout=20_000)
    expect(page.locator("#sec-chart svg circle")).to_have_count(25, timeout=20_000)
    assert "at epoch 24" in page.inner_text("#sec-chart")
    assert page.evaluate("window.__sameDocument") is True, "the page reloaded instead of updating in place"
    assert page.inner_text("#live-status").startswith("live · updated")
    assert problems == [], problems

    holder.fail = True  # the coordinator cannot produce a snapshot: the page says so and keeps the last data
    expect(page.locator("#live-status")).to_have_class("live err", timeout=20_000)
    assert "zebra-42" in page.inner_text("#sec-peers")
    holder.fail = False
    expect(page.locator("#live-status")).to_have_class("live ok", timeout=20_000)

    screenshot = tmp_path / "dashboard.png"
    page.screenshot(path=str(screenshot), full_page=True)
    assert screenshot.stat().st_size > 20_000
    artifacts = os.environ.get("HIVETRAIN_ARTIFACTS_DIR")
    if artifacts:
        Path(artifacts).mkdir(parents=True, exist_ok=True)
        shutil.copy(screenshot, Path(artifacts) / "dashboard.png")

    # after the clean phase above, the 503s of the simulated outage are the only console errors allowed
    unexpected = [p for p in problems if "503" not in p]
    assert unexpected == [], unexpected
