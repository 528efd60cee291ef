"""The web page at ``/`` in a real headless Chromium, against a real server and SmolLM2-135M.

The browser is Debian's ``chromium`` package driven by Playwright (Playwright's own browser download
needs a CDN; ``make browser`` installs the package, and CI runs it). The page streams a chat reply
token by token, colours the tokens that came from accepted drafts, and shows the statistics. On a
server with API keys (the tiny model) it asks for the key and sends it with every call.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, Request, sync_playwright

from tests.conftest import needs_smollm2
from tests.server.harness import LiveServer, live_server, tiny_server
from verispec.server.auth import Access, KeyTable

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
    """The page on the SmolLM2 server (the tests that use it are marked ``needs_smollm2``)."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(f"{server.url}/")
    page.wait_for_function("name => document.getElementById('model').textContent === name", arg=MODEL)
    assert page.is_hidden("#key-form") and page.is_hidden("#key-forget")  # no keys: never asks
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


@needs_smollm2
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


@needs_smollm2
def test_speculation_off_sends_no_drafts(page: Page):
    page.uncheck("#speculation")
    assert page.is_disabled("#max-k")
    send(page, PROMPT, "96")
    page.wait_for_selector("#output[data-state=done]", timeout=TIMEOUT_MS)
    assert "quick brown fox" in page.inner_text("#output")
    assert page.locator("#output > span.tok.draft").count() == 0
    assert page.inner_text("#stat-draft-share") == "0.0%"
    assert page.inner_text("#stat-acceptance").endswith("(nothing drafted)")


@needs_smollm2
def test_shows_the_servers_error_message(page: Page):
    send(page, PROMPT, "0")
    page.wait_for_selector("#output[data-state=error]", timeout=TIMEOUT_MS)
    assert "max_tokens" in page.inner_text("#error")
    assert page.locator("#output .tok").count() == 0
    assert page.is_enabled("#send")


@needs_smollm2
def test_stop_aborts_the_stream(page: Page, server: LiveServer):
    send(page, "Write a long story about a lighthouse keeper.", "400")
    page.wait_for_selector("#output .tok", timeout=TIMEOUT_MS)
    page.click("#stop")
    page.wait_for_selector("#output[data-state=stopped]", timeout=10_000)
    assert page.inner_text("#status").startswith("Stopped after")
    assert page.is_enabled("#send") and page.inner_text("#error") == ""
    server.wait_idle(timeout=30)  # the server noticed the disconnect and dropped the request


KEY = "sk-page-test"


@pytest.fixture(scope="module")
def keyed_server() -> Iterator[LiveServer]:
    """The tiny model behind an API key: what matters here is the key, not the text."""
    with tiny_server("tiny", k=3, access=Access(KeyTable({KEY: "acme"}))) as live:
        yield live


def test_asks_for_the_key_and_sends_it_with_every_call(browser: Browser, keyed_server: LiveServer):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    sent: dict[str, list[str | None]] = {}  # each API call the page made: its Authorization headers

    def record(request: Request) -> None:
        path = request.url.removeprefix(keyed_server.url)
        sent.setdefault(path, []).append(request.headers.get("authorization"))

    page.on("request", record)
    page.goto(f"{keyed_server.url}/")
    page.wait_for_selector("#key-form", state="visible", timeout=10_000)
    assert page.inner_text("#model") == "needs an API key"
    assert page.get_attribute("#api-key", "type") == "password"
    assert sent["/v1/models"] == [None]

    page.fill("#api-key", "sk-wrong")
    page.click("#key-save")
    page.wait_for_function("() => document.getElementById('key-error').textContent.includes('invalid')")
    assert page.inner_text("#key-error") == "The server refused this key: invalid API key"
    assert page.is_visible("#key-form") and page.inner_text("#model") == "needs an API key"

    page.fill("#api-key", KEY)
    page.click("#key-save")
    page.wait_for_function("() => document.getElementById('model').textContent === 'tiny'")
    assert page.is_hidden("#key-form") and page.is_visible("#key-forget")
    assert page.evaluate("sessionStorage.getItem('verispec.apiKey')") == KEY
    assert page.input_value("#api-key") == ""  # not left in the field

    send(page, "hello", "4")
    page.wait_for_selector("#output[data-state=done]", timeout=TIMEOUT_MS)
    assert page.locator("#output > span.tok").count() > 0 and page.inner_text("#error") == ""
    assert sent["/v1/chat/completions"] == [f"Bearer {KEY}"]

    page.reload()  # the tab keeps the key: no question again
    page.wait_for_function("() => document.getElementById('model').textContent === 'tiny'")
    assert page.is_hidden("#key-form")
    assert sent["/v1/models"] == [None, "Bearer sk-wrong", f"Bearer {KEY}", f"Bearer {KEY}"]

    page.click("#key-forget")
    page.wait_for_selector("#key-form", state="visible", timeout=10_000)
    assert page.evaluate("sessionStorage.getItem('verispec.apiKey')") is None
    send(page, "hello", "4")  # without a key: refused, the page says so and asks again
    page.wait_for_selector("#output[data-state=error]", timeout=TIMEOUT_MS)
    assert "API key" in page.inner_text("#error") and page.is_visible("#key-form")
    context.close()
    assert errors == [], f"JavaScript errors on the page: {errors}"


def test_a_key_the_server_stops_taking_is_asked_for_again(browser: Browser, keyed_server: LiveServer):
    """A key kept from before (the server restarted with other keys): the first call's 401 brings the
    field back, with the server's reason."""
    context = browser.new_context()
    context.add_init_script("sessionStorage.setItem('verispec.apiKey', 'sk-revoked')")
    page = context.new_page()
    page.goto(f"{keyed_server.url}/")
    page.wait_for_selector("#key-form", state="visible", timeout=10_000)
    assert "refused this key: invalid API key" in page.inner_text("#key-error")
    assert page.is_visible("#key-forget")
    context.close()
