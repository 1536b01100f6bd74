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
