"""The browser playground end to end in headless Chromium (Debian `chromium` driven by Playwright):
type a prompt, watch the reply stream in chunk by chunk, compare it with the offline engine, and save a
screenshot as the test's artifact."""

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


def test_playground_streams_a_reply(chromium, data_dir, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (no browser download)")
    inference = pytest.importorskip("scratchlm.inference")
    model = data_dir / "models" / "stories260K" / "stories260K.bin"
    engine = inference.LLMEngine.from_pretrained(model, inference.EngineConfig(max_num_seqs=4))
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
