"""`EngineConfig.quantization` / `--quantization`: the engine loads through the quantization layer."""

from __future__ import annotations

import argparse

import pytest
import torch

from scratchlm.config import add_dataclass_arguments, dataclass_from_args
from scratchlm.inference import LLM, EngineConfig, SamplingParams
from scratchlm.inference.quantization.modules import QuantLinear


def test_bad_quantization_name_fails_before_loading():
    with pytest.raises(ValueError, match="quantization='int3'"):
        EngineConfig(quantization="int3")


def test_cli_flag_reaches_the_config():
    parser = argparse.ArgumentParser()
    add_dataclass_arguments(parser, EngineConfig)
    cfg = dataclass_from_args(EngineConfig, parser.parse_args(["--quantization", "int8"]))
    assert cfg.quantization == "int8"


def test_llm_with_int8_quantizes_every_linear_and_generates(data_dir):
    torch.set_num_threads(1)
    path = data_dir / "models" / "stories260K" / "stories260K.bin"
    fp32 = LLM(path, kv_cache_memory=1 << 22)
    int8 = LLM(path, kv_cache_memory=1 << 22, quantization="int8")
    linears = [m for m in int8.engine.runner.model.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 5 * 7 + 1  # q, k, v, o, w1, w2, w3 in each of the 5 layers, plus the LM head
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    a = fp32.generate([[1]], params, use_tqdm=False)[0].outputs[0].token_ids
    b = int8.generate([[1]], params, use_tqdm=False)[0].outputs[0].token_ids
    # int8 weights are close, not equal: greedy agrees on the early tokens of a 260K model
    assert a[:8] == b[:8]
