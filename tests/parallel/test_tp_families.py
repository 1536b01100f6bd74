"""Tensor (and pipeline) parallelism on the model's own modules, for every kind of feature, against HF transformers.

Tiny random HF checkpoints of the families (`tests/model/families/tiny.py`; HF's forward and `generate` are the
oracle). In-process: each rank's shard is read from the safetensors through the family's tensor rules
(`launch.load_shard`), sharded into the model's modules (`ShardedLM`), and the ranks run as threads whose
collectives are a test-local rendezvous (no process group): TP = 2 (DeepSeek's MLA too) and TP = 2 x PP = 2 logits
within 1e-4 of HF and of one rank, greedy ids equal HF's. `distributed`: real TP = 2 engines (spawned ranks,
gloo), greedy ids and the sampled tokens' logprobs against HF.
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path

import pytest
import torch

from scratchlm.model import ModelConfig, load
from scratchlm.parallel.launch import check_engine_config, load_shard
from scratchlm.parallel.layout import check_cp_features, plan_layout, read_model_config
from scratchlm.parallel.tensor import ShardedLM, check_shardable, module_shards
from tests.model.families.tiny import FAMILIES, save_tiny

CASES = sorted(FAMILIES)
MLA_CASES = ["deepseek_v2", "deepseek_v3_yarn"]  # MLA split by query head (q_proj straight from x, YaRN)
PROMPT = [5, 17, 3, 99, 42, 7, 150, 8, 23, 61, 2, 77, 9, 31, 44, 12, 100, 6, 59]  # longer than every window


@pytest.fixture(autouse=True)
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tp_families"))


@functools.cache
def _checkpoint(name: str, root: str):
    directory = Path(root) / name
    return directory, save_tiny(name, directory)


class _Hub:
    """The TP group of a few threads: each posts its tensor, all read every rank's (no process group needed)."""

    def __init__(self, n: int):
        self.slots: list[torch.Tensor | None] = [None] * n
        self.barrier = threading.Barrier(n, timeout=60)

    def exchange(self, rank: int, t: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = t.clone()
        self.barrier.wait()
        parts = list(self.slots)
        self.barrier.wait()  # nobody posts the next collective before every rank has read this one
        return parts


class _ThreadComm:
    """The two collectives `ShardedLM` uses, over a `_Hub`."""

    def __init__(self, layout, hub: _Hub):
        self.layout, self.hub = layout, hub

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout.tp == 1:
            return x
        parts = self.hub.exchange(self.layout.tp_rank, x)
        return x.copy_(torch.stack(parts).sum(0))

    def all_gather_cols(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout.tp == 1:
            return x
        return torch.cat(self.hub.exchange(self.layout.tp_rank, x), dim=1)


def _run_threads(fns, hub: _Hub) -> list:
    """Run one function per rank in threads; the first error is re-raised here (the peers' barrier is broken)."""
    out, errors = [None] * len(fns), []

    def run(i):
        try:
            out[i] = fns[i]()
        except BaseException as e:
            errors.append(e)
            hub.barrier.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return out


def _sharded_models(directory: Path, tp: int, pp: int) -> list[list[ShardedLM]]:
    """[stage][tp rank] models, each from its own shard of the checkpoint."""
    config = read_model_config(directory)
    stages = []
    for stage in range(pp):
        hub = _Hub(tp)
        ranks = []
        for t in range(tp):
            layout = plan_layout(config, tp, pp, stage * tp + t)
            state, _ = load_shard(directory, config, layout, torch.float32, torch.device("cpu"), False)
            ranks.append(ShardedLM(config, layout, state, _ThreadComm(layout, hub)).eval())
        stages.append(ranks)
    return stages


@torch.no_grad()
def _forward(stages: list[list[ShardedLM]], ids: list[int]) -> torch.Tensor:
    """Logits (T, vocab) of one sequence through every stage (the TP ranks of a stage as threads)."""
    tokens = torch.tensor([ids])
    positions = torch.arange(len(ids))
    x = None
    n_stages = len(stages)
    for s, ranks in enumerate(stages):
        def rank_fn(m, x=x, first=s == 0, last=s == n_stages - 1):
            def fn():
                h = m.embed_tokens(tokens, positions) if first else x.clone()
                h = m.forward_layers(h, positions, None)
                return m.logits(h[0]) if last else h
            return fn

        outs = _run_threads([rank_fn(m) for m in ranks], ranks[0].comm.hub)
        for o in outs[1:]:
            assert torch.equal(o, outs[0])  # every TP rank ends with the same replicated result
        x = outs[0]
    return x


@pytest.mark.parametrize("name", CASES + MLA_CASES)
def test_tp2_logits_and_greedy_equal_hf(name, root) -> None:
    directory, hf = _checkpoint(name, root)
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0]
        one_rank = load(directory).model(torch.tensor([PROMPT]))[0]
    tp2 = _sharded_models(directory, 2, 1)
    got = _forward(tp2, PROMPT)
    assert (got - want).abs().max().item() < 1e-4
    assert (got - one_rank).abs().max().item() < 1e-4
    # greedy: recompute the whole sequence each step (no cache), against HF generate
    ids = list(PROMPT[:9])
    ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                      max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)[0, len(ids):].tolist()
    for _ in range(6):
        ids.append(int(_forward(tp2, ids)[-1].argmax()))
    assert ids[9:] == ref


@pytest.mark.parametrize("name", ["gemma2", "gpt2", "olmo2", "phi3"])
def test_tp2_pp2_logits_equal_hf(name, root) -> None:
    """Four ranks: stage 0's TP group (embedding) then stage 1's (final norm, head; a tied head is the
    embedding's vocabulary shard there)."""
    directory, hf = _checkpoint(name, root)
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0]
    got = _forward(_sharded_models(directory, 2, 2), PROMPT)
    assert (got - want).abs().max().item() < 1e-4


def test_shards_hold_only_their_slices(root) -> None:
    """Fused qkv (phi3) read through the rule, then sliced: each rank holds its heads only; a full-width q/k-norm
    (olmo2) is split with its heads and normalised over the whole width."""
    directory, _ = _checkpoint("phi3", root)
    config = read_model_config(directory)
    a, b = _sharded_models(directory, 2, 1)[0]
    d = config.head_dim
    assert a.lm.layers[0].attn.q_proj.weight.shape == (2 * d, config.d_model)  # 4 heads / 2 KV heads: 2 per rank
    assert a.lm.layers[0].attn.n_heads == 2 and b.lm.layers[0].attn.n_kv_heads == 1
    assert a.lm.layers[0].ffn.w2.weight.shape == (config.d_model, config.d_ff // 2)
    full = load(directory).model
    assert torch.equal(b.lm.layers[1].attn.k_proj.weight, full.layers[1].attn.k_proj.weight[d:])
    directory, _ = _checkpoint("olmo2", root)
    a, _ = _sharded_models(directory, 2, 1)[0]
    assert type(a.lm.layers[0].attn.q_norm).__name__ == "ShardedRMSNorm"


def test_unplanned_parameter_and_cp_features_fail_at_start_up(root) -> None:
    directory, _ = _checkpoint("gemma2", root)
    config = read_model_config(directory)
    with pytest.raises(ValueError, match="soft-cap.*sliding window.*query scale"):
        check_cp_features(config)
    from scratchlm.inference import EngineConfig

    with pytest.raises(ValueError, match="context parallelism implements plain causal attention only"):
        check_engine_config(EngineConfig(context_parallel_size=2), config, 2)
    check_engine_config(EngineConfig(tensor_parallel_size=2), config, 2)  # TP implements all of them
    check_shardable(read_model_config(_checkpoint("llama3", root)[0]), 2)


class _Unplanned(torch.nn.Module):
    """A module with a parameter its tp_plan does not name."""

    tp_plan = {"w": "replicated"}

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4, 4))
        self.extra = torch.nn.Parameter(torch.zeros(4))


def test_a_parameter_without_a_plan_is_an_error() -> None:
    config = ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, d_ff=32)
    layout = plan_layout(config, 2, 1, 0)
    with pytest.raises(ValueError, match="no valid entry for 'extra'"):
        module_shards("layers.0.x.", _Unplanned(), config, layout)
    with pytest.raises(ValueError, match="declares no tp_plan"):
        module_shards("layers.0.x.", torch.nn.Linear(2, 2), config, layout)


# --- real processes --------------------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["llama3", "qwen2", "qwen3", "gemma2", "phi3", "phi4_mini", "gpt2", "olmo2",
                                  "granite"])
def test_tp2_engine_greedy_and_logprobs_equal_hf(name, root) -> None:
    """A real TP = 2 engine (rank 1 spawned, gloo) on the tiny checkpoint: greedy ids equal HF generate for a batch
    of prompts (one longer than the windows), and each sampled token's logprob within 1e-4 of HF's."""
    from scratchlm.inference import EngineConfig, LLMEngine, SamplingParams

    directory, hf = _checkpoint(name, root)
    prompts = [PROMPT, [11, 4, 120], [90, 91, 92, 93, 94, 95, 96, 97, 98, 1, 2, 3],
               PROMPT + PROMPT[:15]]  # 34 tokens: past LongRoPE's original 32 (phi3), beside shorter sequences
    n_new = 8
    engine = LLMEngine.from_pretrained(directory, EngineConfig(tensor_parallel_size=2, max_model_len=48,
                                                               block_size=4))
    try:
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True,
                                                         logprobs=0))
        done = {}
        while engine.has_unfinished_requests():
            for r in engine.step():
                if r.finished:
                    done[r.request_id] = r.outputs[0]
    finally:
        engine.shutdown()
    for i, p in enumerate(prompts):
        out = done[str(i)]
        full = torch.tensor([p + out.token_ids])
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=n_new, do_sample=False, pad_token_id=0, eos_token_id=None)
            logp = hf(full).logits[0].log_softmax(-1)
        assert out.token_ids == ref[0, len(p):].tolist(), (name, i)
        for j, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
            assert abs(lp[tok] - logp[len(p) - 1 + j, tok].item()) < 1e-4, (name, i, j)


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["gpt2", "olmo2", "qwen2"])
def test_cp2_engine_runs_the_features_it_implements(name, root) -> None:
    """Context parallelism (CP = 2, ring-prefilled chunks of >= 16 tokens) with learned positions, LayerNorm and
    biases (gpt2), full-width q/k-norm (olmo2), q/k/v biases (qwen2): greedy ids equal HF generate."""
    from scratchlm.inference import EngineConfig, LLMEngine, SamplingParams

    directory, hf = _checkpoint(name, root)
    prompts = [PROMPT + PROMPT[:14], [11, 4, 120]]
    engine = LLMEngine.from_pretrained(directory, EngineConfig(context_parallel_size=2, context_parallel_threshold=16,
                                                               max_model_len=48, block_size=4))
    try:
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        done = {}
        while engine.has_unfinished_requests():
            for r in engine.step():
                if r.finished:
                    done[r.request_id] = r.outputs[0].token_ids
    finally:
        engine.shutdown()
    for i, p in enumerate(prompts):
        ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                          max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)[0, len(p):].tolist()
        assert done[str(i)] == ref, (name, i)
