"""Greedy ids against the references: stories260K's golden ids and HF transformers on SmolLM2 (GGUF)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from scratchlm.inference import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, a small robot",
    "List three colors:",
]


def test_stories260k_golden_greedy(data_dir: Path) -> None:
    golden = json.loads((data_dir / "models/stories260K/golden_greedy.json").read_text())
    llm = LLM(data_dir / "models/stories260K/stories260K.bin", block_size=8, max_num_batched_tokens=64)
    out = llm.generate([golden["prompt_ids"]], SamplingParams(temperature=0, max_tokens=256, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == golden["ids"][len(golden["prompt_ids"]):]
    assert out.text.strip().startswith(golden["text"].strip()[:40].split("\n")[0][:20].strip())


@pytest.fixture(scope="module")
def smollm2(default_model_path: Path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(default_model_path.parent, gguf_file=default_model_path.name,
                                              torch_dtype=torch.float32).eval()
    llm = LLM(default_model_path, max_num_batched_tokens=48, block_size=8)
    return hf, llm


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """HF `generate`, greedy; it stops at the model's EOS (min_new_tokens would mask EOS instead, which
    changes the argmax), so callers compare up to HF's length."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long), pad_token_id=0)
    return out[0, len(ids):].tolist()


def check_prompts(smollm2, prompts: list[str], n: int) -> None:
    hf, llm = smollm2
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        theirs = hf_greedy(hf, out.prompt_token_ids, n)
        assert len(theirs) >= 8, f"HF stopped after {len(theirs)} tokens: too short a check for {prompt!r}"
        assert out.outputs[0].token_ids[: len(theirs)] == theirs, prompt


def test_smollm2_greedy_equals_hf_generate(smollm2) -> None:
    """Two prompts batched together (chunked prefill of 48 tokens, blocks of 8) = HF, one at a time."""
    check_prompts(smollm2, PROMPTS[:2], 16)


@pytest.mark.slow
def test_smollm2_greedy_equals_hf_generate_more_prompts(smollm2) -> None:
    check_prompts(smollm2, PROMPTS, 48)
