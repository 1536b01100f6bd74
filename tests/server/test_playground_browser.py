"""The browser playground end to end in headless Chromium (Debian `chromium` driven by Playwright):
type a prompt, watch the reply stream in chunk by chunk, compare it with the offline engine, and save a
screenshot as the test's artifact; press Stop mid-reply and check the reply is marked stopped with its stats."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from scratchlm.server import BackgroundServer, ServerConfig, create_app

CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "/usr/lib/chromium/chromium", "/usr/bin/chromium-browser")


def find_chromium() -> str | None:
    return next((p for p in CHROMIUM_CANDIDATES if Path(p).is_file()), None)


@pytest.fixture(scope="module")
def chromium(request) -> str:
    """Chromium's path; installs the Debian package when absent (only with --run-slow: it takes minutes)."""
    path = find_chromium()
    if path is None:
        if not request.config.getoption("--run-slow"):
            pytest.skip("chromium is not installed; run with --run-slow to let this test `apt-get install` it")
        if shutil.which("apt-get") is None or os.geteuid() != 0:
            pytest.skip("chromium is not installed and apt-get is unavailable (needs root)")
        subprocess.run(["apt-get", "install", "-y", "chromium"], check=True, timeout=900,
                       env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
        path = find_chromium()
        assert path is not None, "apt-get install chromium did not provide a chromium binary"
    return path


def paced(engine, seconds: float):
    """`engine` with each step at least `seconds` apart, so the browser sees the reply arrive in pieces even
    when a busy machine would let one render batch many tokens (stories260K decodes hundreds per second)."""
    import time

    step = engine.step

    def slow_step():
        time.sleep(seconds)
        return step()

    engine.step = slow_step
    return engine


def test_playground_streams_a_reply(chromium, data_dir, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (no browser download)")
    inference = pytest.importorskip("scratchlm.inference")
    model = data_dir / "models" / "stories260K" / "stories260K.bin"
    engine = paced(inference.LLMEngine.from_pretrained(model, inference.EngineConfig(max_num_seqs=4)), 0.02)
    offline = inference.LLM(str(model))
    prompt_text = "Once upon a time, there was a little dog"
    max_tokens = 120
    chat_prompt = offline.engine.apply_chat_template([{"role": "user", "content": prompt_text}])
    [expected] = offline.generate([chat_prompt], inference.SamplingParams(temperature=0, max_tokens=max_tokens),
                                  use_tqdm=False)
    expected_text = expected.outputs[0].text.strip()
    assert len(expected_text) > 40

    with BackgroundServer(create_app(engine, ServerConfig(), model_name="stories260K")) as srv, \
            sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 800})
            page.set_default_timeout(60_000)
            page.goto(srv.url + "/")
            page.wait_for_function("document.getElementById('model').textContent.startsWith('stories260K')")
            # temperature 0 (greedy), a fixed max_tokens
            page.eval_on_selector("#temperature", "el => { el.value = '0'; el.dispatchEvent(new Event('input')); }")
            page.fill("#max-tokens", str(max_tokens))
            # record every change of the reply's text while it streams
            page.evaluate("""() => {
                window.__lengths = [];
                new MutationObserver(() => {
                    const r = document.querySelector('.msg.assistant .body');
                    if (r) window.__lengths.push(r.textContent.length);
                }).observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true});
            }""")
            page.fill("#prompt", prompt_text)
            page.press("#prompt", "Enter")
            page.wait_for_selector(".msg.assistant[data-done='true']")
            reply = page.inner_text(".msg.assistant .body").strip()
            lengths = page.evaluate("window.__lengths")
            stats = page.inner_text("#stats")
            shot = tmp_path / "playground.png"
            page.screenshot(path=str(shot), full_page=True)
            artifacts = os.environ.get("SCRATCHLM_TEST_ARTIFACTS")
            if artifacts:
                Path(artifacts).mkdir(parents=True, exist_ok=True)
                shutil.copy(shot, Path(artifacts) / "playground.png")
        finally:
            browser.close()

    assert reply == expected_text
    partial = sorted({n for n in lengths if 0 < n < len(reply)})
    assert len(partial) >= 5, f"the reply did not stream in pieces: text lengths seen {lengths}"
    assert f"{len(expected.outputs[0].token_ids)} tokens in" in stats
    assert shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")


def test_playground_stop_marks_the_reply_and_keeps_its_stats(chromium, data_dir):
    """Stop mid-reply: the reply keeps its text (a prefix of the greedy answer), is marked "stopped", the stats
    line stays (tokens so far), and no request of the page fails (the favicon is served)."""
    import httpx

    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (no browser download)")
    inference = pytest.importorskip("scratchlm.inference")
    model = data_dir / "models" / "stories260K" / "stories260K.bin"
    # ~25 tokens/s, so that Stop lands mid-reply on any machine
    engine = paced(inference.LLMEngine.from_pretrained(model, inference.EngineConfig(max_num_seqs=4)), 0.04)
    offline = inference.LLM(str(model))
    prompt_text = "Once upon a time, there was a little dog"
    chat_prompt = offline.engine.apply_chat_template([{"role": "user", "content": prompt_text}])
    [expected] = offline.generate([chat_prompt], inference.SamplingParams(temperature=0, max_tokens=200),
                                  use_tqdm=False)
    failed: list[str] = []
    with BackgroundServer(create_app(engine, ServerConfig(), model_name="stories260K")) as srv, \
            sync_api.sync_playwright() as p:
        icon = httpx.get(srv.url + "/favicon.ico", timeout=10)
        assert icon.status_code == 200 and icon.headers["content-type"].startswith("image/svg+xml")
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.set_default_timeout(60_000)
            page.on("response", lambda r: failed.append(f"{r.status} {r.url}") if r.status >= 400 else None)
            page.goto(srv.url + "/")
            page.wait_for_function("document.getElementById('model').textContent.startsWith('stories260K')")
            page.eval_on_selector("#temperature", "el => { el.value = '0'; el.dispatchEvent(new Event('input')); }")
            page.fill("#max-tokens", "200")
            page.fill("#prompt", prompt_text)
            page.press("#prompt", "Enter")
            page.wait_for_function("(document.querySelector('.msg.assistant .body') || {}).textContent?.length > 10")
            page.click("#stop")
            page.wait_for_selector(".msg.assistant[data-stopped='true']")
            reply = page.inner_text(".msg.assistant .body")
            mark = page.text_content(".msg.assistant .who .mark")
            stats = page.inner_text("#stats")
            assert page.is_enabled("#send") and not page.is_enabled("#stop")
            page.wait_for_timeout(300)  # a late favicon request would show up here
        finally:
            browser.close()
    full = expected.outputs[0].text
    assert reply and full.startswith(reply) and len(reply) < len(full.rstrip()), (reply, full)
    assert mark == "stopped"
    assert stats.startswith("stopped: ") and " tokens in " in stats, stats
    assert int(stats.split()[1]) > 0
    assert not failed, failed


@pytest.mark.parametrize("width", [360, 412])
def test_playground_fits_a_phone_screen(chromium, width, tmp_path):
    """At phone widths the settings column stacks under the chat: nothing sticks out past the screen's right edge
    and no horizontal scrolling (issue 30, item 14)."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (no browser download)")
    from tests.server.conftest import fake_server

    with fake_server() as (srv, _), sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": width, "height": 780}, device_scale_factor=2, is_mobile=True,
                                    has_touch=True)
            page.set_default_timeout(30_000)
            page.goto(srv.url + "/")
            page.wait_for_function("document.getElementById('model').textContent.startsWith('fake-echo')")
            sticking_out = page.evaluate("""() => {
                const w = document.documentElement.clientWidth;
                return [...document.querySelectorAll('aside input, aside button, #prompt, #send, #stop, #log')]
                    .map(el => [el.id || el.tagName, el.getBoundingClientRect().right])
                    .filter(([, right]) => right > w + 0.5);
            }""")
            scroll = page.evaluate("[document.documentElement.scrollWidth, document.documentElement.clientWidth]")
            page.screenshot(path=str(tmp_path / f"playground-{width}.png"), full_page=True)
        finally:
            browser.close()
    assert sticking_out == [], f"cut off at {width} px: {sticking_out}"
    assert scroll[0] <= scroll[1], f"horizontal scrolling at {width} px: {scroll}"
