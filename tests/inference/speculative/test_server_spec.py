"""Speculative decoding through the server: `--speculative` reaches EngineConfig from the serve flags, and
a server on a speculative engine answers concurrent OpenAI requests with the plain engine's greedy text."""

from __future__ import annotations

import argparse
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from scratchlm.config import dataclass_from_args
from scratchlm.inference import LLM, EngineConfig, LLMEngine, SamplingParams
from scratchlm.server import BackgroundServer, ServerConfig, create_app

PROMPTS = ["Once upon a time", "Lily and Tom went to the park. Lily and Tom", "The dog", "One day, a little bird"]


def test_serve_flags_reach_engine_config() -> None:
    from scratchlm.server.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--speculative", "layers:2", "--num-speculative-tokens", "3"])
    cfg = dataclass_from_args(EngineConfig, args)
    assert cfg.speculative == "layers:2" and cfg.num_speculative_tokens == 3


@pytest.mark.slow  # a subprocess start-up: ~15 s on the loaded machine
def test_serve_rejects_a_bad_method() -> None:
    res = subprocess.run([sys.executable, "-m", "scratchlm", "serve", "--speculative", "beam:3"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2
    assert "unknown method 'beam'" in res.stderr and "ngram" in res.stderr


@pytest.mark.parametrize("spec", ["ngram", pytest.param("layers:3", marks=pytest.mark.slow)])
def test_server_greedy_equals_plain_engine(data_dir, spec: str) -> None:
    path = data_dir / "models" / "stories260K" / "stories260K.bin"
    ref = LLM(str(path), max_num_seqs=8).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24),
                                                  use_tqdm=False)
    engine = LLMEngine.from_pretrained(path, EngineConfig(max_num_seqs=8, speculative=spec))
    engine.speculator.adaptive = False  # always draft, so the server path surely verifies
    with BackgroundServer(create_app(engine, ServerConfig(), model_name="stories260K"), start_timeout_s=60) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)

        def ask(prompt: str) -> str:
            stream = client.completions.create(model="stories260K", prompt=prompt, max_tokens=24, temperature=0,
                                               stream=True)
            return "".join(c.choices[0].text for c in stream)

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            texts = list(pool.map(ask, PROMPTS))
    assert texts == [r.outputs[0].text for r in ref]
    assert engine.speculator.stats.accepted > 0
