"""The web page at ``/`` in a real headless Chromium, against a real server and SmolLM2-135M.

The browser is Debian's ``chromium`` package driven by Playwright (Playwright's own browser download
needs a CDN; ``make browser`` installs the package, and CI runs it). The page streams a chat reply
token by token, colours the tokens that came from accepted drafts, and shows the statistics.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from tests.conftest import needs_smollm2
from tests.server.harness import LiveServer, live_server

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
MODEL = "smollm2-135m-instruct"
# SmolLM2 answers this by copying the sentence, which prompt lookup (ngram) drafts from the prompt.
PROMPT = (
    "Repeat the following sentence exactly, twice: "
    "The quick brown fox jumps over the lazy dog near the old river bank."
)
TIMEOUT_MS = 120_000

pytestmark = [
    pytest.mark.slow,
    needs_smollm2,
    pytest.mark.skipif(
        not CHROMIUM.is_file(),
        reason=f"no headless browser: {CHROMIUM} is missing (`make browser` installs Debian's chromium)",
    ),
]


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    import verispec

    engine = verispec.load(MODEL, method="ngram", num_speculative_tokens=4, depth="fixed")
    with live_server(engine, name=MODEL) as live:
        yield live


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser: Browser, server: LiveServer) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(f"{server.url}/")
    page.wait_for_function("name => document.getElementById('model').textContent === name", arg=MODEL)
    yield page
    context.close()
    assert errors == [], f"JavaScript errors on the page: {errors}"


WATCH_OUTPUT = """() => {
    const output = document.getElementById("output");
    window.spansWhileRunning = [];
    new MutationObserver(() => {
        if (output.dataset.state === "running") window.spansWhileRunning.push(output.children.length);
    }).observe(output, { childList: true });
}"""
"""Records how many token spans ``#output`` holds at each change while the response streams."""


def send(page: Page, prompt: str, max_tokens: str) -> None:
    page.fill("#prompt", prompt)
    page.fill("#max-tokens", max_tokens)
    page.click("#send")


def test_streams_tokens_and_colours_accepted_drafts(page: Page, tmp_path: Path):
    page.evaluate(WATCH_OUTPUT)
    send(page, PROMPT, "96")
    page.wait_for_selector("#output[data-state=done]", timeout=TIMEOUT_MS)
    seen = page.evaluate("window.spansWhileRunning")
    assert len(set(seen)) > 1, seen  # the text grew in several steps while streaming, not all at the end
    page.screenshot(path=str(tmp_path / "web_page.png"), full_page=True)

    text = page.inner_text("#output")
    assert "quick brown fox" in text, text
    assert page.inner_text("#error") == ""
    assert page.get_attribute("#output", "data-finish-reason") in ("stop", "length")
    tokens = page.locator("#output > span.tok")
    assert page.locator("#output > *").count() == tokens.count() > 0  # one span per token, nothing else
    drafts = page.locator("#output > span.tok.draft").count()
    assert drafts > 0, "no token is marked as an accepted draft"
    assert page.locator("#output > span.tok.target").count() > 0  # at least the bonus tokens
    draft_bg, target_bg = (
        page.eval_on_selector(f"#output > span.tok.{kind}", "e => getComputedStyle(e).backgroundColor")
        for kind in ("draft", "target")
    )
    assert draft_bg != target_bg  # drafts really look different

    # Every token counts, an end-of-sequence token with no text (hence no span) included.
    assert tokens.count() <= int(page.inner_text("#stat-tokens")) <= tokens.count() + 1
    assert re.fullmatch(r"\d+\.\d%", page.inner_text("#stat-draft-share"))
    assert re.fullmatch(r"\d+\.\d", page.inner_text("#stat-tps"))
    acceptance = page.inner_text("#stat-acceptance")
    assert re.fullmatch(r"\d+\.\d%", acceptance) and float(acceptance[:-1]) > 0
    assert float(page.inner_text("#stat-mean-length")) > 1  # drafts were accepted: over a token a step
    assert page.locator("#stat-positions li").count() > 0
    assert page.is_enabled("#send") and page.is_disabled("#stop")


def test_speculation_off_sends_no_drafts(page: Page):
    page.uncheck("#speculation")
    assert page.is_disabled("#max-k")
    send(page, PROMPT, "96")
    page.wait_for_selector("#output[data-state=done]", timeout=TIMEOUT_MS)
    assert "quick brown fox" in page.inner_text("#output")
    assert page.locator("#output > span.tok.draft").count() == 0
    assert page.inner_text("#stat-draft-share") == "0.0%"
    assert page.inner_text("#stat-acceptance").endswith("(nothing drafted)")


def test_shows_the_servers_error_message(page: Page):
    send(page, PROMPT, "0")
    page.wait_for_selector("#output[data-state=error]", timeout=TIMEOUT_MS)
    assert "max_tokens" in page.inner_text("#error")
    assert page.locator("#output .tok").count() == 0
    assert page.is_enabled("#send")


def test_stop_aborts_the_stream(page: Page, server: LiveServer):
    send(page, "Write a long story about a lighthouse keeper.", "400")
    page.wait_for_selector("#output .tok", timeout=TIMEOUT_MS)
    page.click("#stop")
    page.wait_for_selector("#output[data-state=stopped]", timeout=10_000)
    assert page.inner_text("#status").startswith("Stopped after")
    assert page.is_enabled("#send") and page.inner_text("#error") == ""
    server.wait_idle(timeout=30)  # the server noticed the disconnect and dropped the request
