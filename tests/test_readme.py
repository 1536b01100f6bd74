"""The README's first examples, the ones a newcomer copies, ask for a good answer: greedy or a low temperature
(a 135M model at the API's default temperature 1.0 answers nonsense; issue 17, item 7)."""

from __future__ import annotations

import json
import re
from pathlib import Path

README = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")


def test_first_curl_example_is_greedy_or_low_temperature():
    m = re.search(r"curl \S+/v1/(?:chat/)?completions.*?-d '(\{.*?\})'", README, re.S)
    assert m, "no curl example in the README"
    body = json.loads(m.group(1))
    assert body.get("temperature", 1.0) <= 0.3, body


def test_first_python_examples_are_greedy_or_low_temperature():
    create = re.search(r"\.create\((.*?)\):", README, re.S)
    assert create and (t := re.search(r"temperature=([\d.]+)", create.group(1))), "OpenAI example without temperature"
    assert float(t.group(1)) <= 0.3
    first_params = re.search(r"llm\.generate\(.*?SamplingParams\((.*?)\)", README, re.S)
    assert first_params and re.search(r"temperature=0\b", first_params.group(1)), first_params


def test_readme_says_why():
    assert "Why `temperature` 0" in README and "default is 1.0" in README


def test_every_api_example_sets_max_tokens():
    """Without max_tokens a looping 135M model streams until the context fills (issue 30, item 10)."""
    calls = re.findall(r"\.(?:create|parse)\((.*?)\)(?::|\n)", README, re.S)
    assert len(calls) >= 2, calls
    for call in calls:
        assert re.search(r"max_tokens=\d+", call), call
    for body in re.findall(r"-d '(\{.*?\})'", README, re.S):
        assert "max_tokens" in json.loads(body), body
    for params in re.findall(r"SamplingParams\((.*?)\)", README, re.S):
        assert "max_tokens=" in params, params


def test_readme_says_what_happens_without_max_tokens():
    assert "Why `max_tokens`" in README and "end of the context" in README and "--default-max-tokens" in README


def test_make_run_port_example_opens_the_same_port():
    for m in re.finditer(r'ARGS="--port (\d+)"(.{0,300})', README, re.S):
        urls = re.findall(r"http://127\.0\.0\.1:(\d+)", m.group(2))
        assert urls and urls[0] == m.group(1), m.group(0)


def test_readme_family_table_lists_every_registered_family():
    """The README's model paragraph names what loads: every HF model_type and GGUF architecture in the registry."""
    from scratchlm.model.families import families

    table = "\n".join(line for line in README.splitlines() if line.startswith("| ") and "`" in line)
    for family in families():
        for name in (*family.hf_model_types, *family.gguf_archs):
            assert f"`{name}`" in table, f"{family.name}: {name} missing from the README's family table"


def test_readme_does_not_overstate_bench_all_quick():
    from scratchlm import bench

    assert "every benchmark's smoke run" not in README
    plan = bench._plan(bench.available(), quick=True)
    ran = [n for n, argv, _ in plan if argv is not None]
    assert f"the smoke runs of the {len(set(ran))} benchmarks that have one" in README
