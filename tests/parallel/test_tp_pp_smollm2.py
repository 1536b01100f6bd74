"""SmolLM2-135M under TP and PP equals the single-process engine.

In its own module: test_tp_pp.py's module-scoped `parallel_engine` keeps its last TP/PP engine (and the
process group) alive until that module ends, and a second spawned engine in the same process is refused.
"""

from __future__ import annotations

import pytest
import torch

from scratchlm.inference import SamplingParams


@pytest.mark.distributed
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (2, 2)], ids=["tp2", "pp2", "tp2xpp2"])
def test_smollm2_greedy_equals_single_process(default_model_path, tp, pp) -> None:
    """SmolLM2-135M (9 query / 3 KV heads: TP=2 shards them 6+3 / 2+1), 30 layers."""
    from scratchlm.inference import LLM

    torch.set_num_threads(1)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    params = [SamplingParams(temperature=0, max_tokens=24),
              SamplingParams(temperature=0, max_tokens=24),
              SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=24)]
    ref = [o.outputs[0].token_ids for o in LLM(default_model_path).generate(prompts, params, use_tqdm=False)]
    llm = LLM(default_model_path, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.engine.runner.shutdown()
    assert got == ref
