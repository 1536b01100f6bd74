"""The inspector page in headless Chromium while a bounded load runs: behind --api-key, it goes live, shows the
batch, the KV pool map and the events as they happen, and once the load is over its numbers equal /metrics and
the engine's own counters. A screenshot is kept (tmp dir, or $SCRATCHLM_TEST_ARTIFACTS/inspector.png)."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from scratchlm.server import BackgroundServer, ServerConfig, create_app
from tests.server.test_inspector import KEY, _load, metrics
from tests.server.test_playground_browser import chromium  # noqa: F401  (the fixture)

inference = pytest.importorskip("scratchlm.inference")


def test_inspector_page_matches_metrics(chromium, data_dir, tmp_path):  # noqa: F811
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (no browser download)")
    import torch

    from scratchlm.inference.kv_cache import bytes_per_block

    model = data_dir / "models" / "stories260K" / "stories260K.bin"
    cfg = inference.EngineConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                 kv_cache_memory=14 * bytes_per_block(5, 4, 8, 16, torch.float32))
    engine = inference.LLMEngine.from_pretrained(model, cfg)
    with BackgroundServer(create_app(engine, ServerConfig(api_key=KEY), model_name="stories260K")) as srv, \
            sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.set_default_timeout(60_000)
            page.goto(srv.url + "/inspector")  # no key: the page asks for it
            page.wait_for_selector("#auth", state="visible")
            assert "API key needed" in page.inner_text("#status")
            page.fill("#key", KEY)
            page.click("#connect")
            page.wait_for_function("document.getElementById('status').textContent === 'live'")
            page.wait_for_function("document.getElementById('model').textContent === 'stories260K'")
            deadline = time.monotonic() + 30
            while engine.events.num_listeners == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            steps_before = engine.events.steps
            page.evaluate("""() => {  // record the batch sizes and pool maps the page shows while the load runs
                window.__seen = {decodes: [], prefills: [], pool: 0};
                new MutationObserver(() => {
                    window.__seen.decodes.push(+document.getElementById('n-decodes').textContent);
                    window.__seen.prefills.push(+document.getElementById('n-prefills').textContent);
                    window.__seen.pool = document.querySelectorAll('#pool div').length;
                }).observe(document.querySelector('main'), {subtree: true, childList: true, characterData: true});
            }""")
            result: list = []  # playwright's sync API owns this thread's event loop: the load runs in another
            load = threading.Thread(target=lambda: result.append(
                asyncio.run(_load(srv.url, 8, {"Authorization": f"Bearer {KEY}"}))))
            load.start()
            load.join(120)
            answers = result[0]
            generated = sum(a["usage"]["completion_tokens"] for a in answers)
            page.wait_for_function(f"document.getElementById('total-generation-tokens').textContent === '{generated}'")
            page.wait_for_function(f"document.getElementById('step').textContent === '{engine.events.steps}'")
            page.wait_for_function("document.getElementById('crosscheck').textContent.includes('(agrees)')")
            shown = page.evaluate("""() => Object.fromEntries(['total-prompt-tokens', 'total-generation-tokens',
                'total-prefix-hits', 'total-prefix-queries', 'total-preemptions', 'num-running', 'num-waiting',
                'kv-free', 'kv-used', 'kv-total', 'seen-steps', 'seen-prefills', 'seen-preemptions'
                ].map((id) => [id, +document.getElementById(id).textContent]).concat([
                ['pool-cells', document.querySelectorAll('#pool div').length],
                ['pool-used-cells',
                 document.querySelectorAll('#pool .s-used, #pool .s-prefix, #pool .s-fork').length]]))""")
            seen = page.evaluate("window.__seen")
            log_text = page.inner_text("#log")
            shot = tmp_path / "inspector.png"
            page.screenshot(path=str(shot), full_page=True)
            artifacts = os.environ.get("SCRATCHLM_TEST_ARTIFACTS")
            if artifacts:
                Path(artifacts).mkdir(parents=True, exist_ok=True)
                shutil.copy(shot, Path(artifacts) / "inspector.png")
            m = metrics(srv.url)
            unauthorized = httpx.get(srv.url + "/inspector/events", timeout=10).status_code
        finally:
            browser.close()
    stats = engine.stats()
    assert unauthorized == 401
    assert shown["total-generation-tokens"] == generated == stats.generation_tokens_total
    assert generated == m["generation_tokens_total"]
    assert shown["total-prompt-tokens"] == stats.prompt_tokens_total == m["prompt_tokens_total"]
    assert shown["total-prefix-hits"] == stats.prefix_cache_hits == m["prefix_cache_hits_total"]
    assert shown["total-prefix-queries"] == stats.prefix_cache_queries == m["prefix_cache_queries_total"]
    assert shown["total-preemptions"] == stats.num_preemptions == m["num_preemptions_total"] > 0
    assert shown["num-running"] == m["num_requests_running"] == 0 and shown["num-waiting"] == 0
    assert shown["kv-free"] == m["num_kv_blocks_free"] == stats.num_free_blocks
    assert shown["kv-total"] == m["num_kv_blocks_total"] == stats.num_total_blocks
    assert max(seen["decodes"]) > 1  # batches were shown as they ran (the page renders the latest step per frame)
    # ... and every step event reached the page (none dropped): its own tallies
    assert shown["seen-steps"] == engine.events.steps - steps_before and shown["seen-prefills"] >= 9
    assert shown["seen-preemptions"] == stats.num_preemptions
    assert seen["pool"] == stats.num_total_blocks  # one cell per KV block
    assert shown["pool-used-cells"] == 0 and shown["pool-cells"] == stats.num_total_blocks  # the final map is exact
    assert "preempted" in log_text and "prefix cache hit" in log_text and "finished" in log_text
    assert shot.stat().st_size > 20_000
    print(f"screenshot: {shot}")
