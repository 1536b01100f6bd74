"""Expert parallelism (scratchlm/parallel/expert.py) against one process, on tiny random MoE models.

The models are built from `ModelConfig(moe=MoEFeatures(...))` directly (a Qwen-MoE-like softmax router with a gated
shared expert, and a DeepSeek-V3-like sigmoid router with groups, a correction bias, a routed scale and a dense
first layer) and saved as scratchlm checkpoints, so spawned ranks load them like any model. The oracle is the
single-process engine, whose MoE layers are the model's own `MoE` (not the EP code).

Default suite (no processes): the layout, the shard plan and the start-up errors. `distributed` (real ranks,
gloo): EP = 2 and EP = 2 x TP = 2 logits within 1e-5 of one rank on hand-made steps (prefills, decodes, a
replica with no sequence); the per-expert load of those steps equal to the routing of the same tokens counted by
hooks on plain forwards of the model; engine runs with greedy and seeded sampling, preemption and prefix caching
equal to one rank token for token; a SIGKILLed rank
fails the engine within the timeout (as under TP); `scratchlm serve --expert-parallel-size 2` shows the load on
/metrics and exits 3 when a rank dies.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import torch

from scratchlm.inference import EngineConfig, LLMEngine, SamplingParams
from scratchlm.inference.runner import ModelInput
from scratchlm.model import load
from scratchlm.model.config import ModelConfig, MoEFeatures
from scratchlm.model.loading.checkpoint import save_model
from scratchlm.model.moe import MoE, route
from scratchlm.model.transformer import TransformerLM
from scratchlm.parallel.launch import check_engine_config
from scratchlm.parallel.layout import plan_layout
from scratchlm.parallel.runner import ParallelWorkerError
from scratchlm.parallel.tensor import shard_plan
from scratchlm.server.metrics import expert_imbalance, parse_prometheus

BASE = dict(vocab_size=512, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=96, max_seq_len=128)
CONFIGS = {
    "qwen_moe": ModelConfig(**BASE, moe=MoEFeatures(n_experts=8, top_k=2, d_expert=32, d_shared=48,
                                                    shared_gate=True)),
    "deepseek_v3": ModelConfig(**BASE, moe=MoEFeatures(n_experts=8, top_k=3, d_expert=32, scoring="sigmoid",
                                                       n_groups=4, topk_groups=2, group_score="top2",
                                                       score_bias=True, routed_scale=2.5, d_shared=64,
                                                       dense_layers=[0])),
}
BLOCK = 4


def make_checkpoint(name: str, path: Path) -> Path:
    torch.manual_seed(31)
    model = TransformerLM(CONFIGS[name])
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("score_bias"):
                p.copy_(torch.randn_like(p) * 0.05)  # a correction bias that changes some choices
            elif p.dim() > 1:
                p.normal_(0.0, 0.1)
    return save_model(path / f"{name}.pt", model)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --- default suite: layout, plan, errors ------------------------------------------------------------------

def test_layout_gives_contiguous_expert_ranges_and_ep_groups() -> None:
    cfg = CONFIGS["qwen_moe"]
    lays = [plan_layout(cfg, 2, 1, r, ep=2) for r in range(4)]
    assert [lay.experts for lay in lays] == [(0, 4), (0, 4), (4, 8), (4, 8)]
    assert [lay.ep_rank for lay in lays] == [0, 0, 1, 1] and [lay.tp_rank for lay in lays] == [0, 1, 0, 1]
    assert [lay.expert_ff for lay in lays] == [(0, 16), (16, 32)] * 2
    assert [lay.shared_ff for lay in lays] == [(0, 24), (24, 48)] * 2
    assert lays[1].ep_ranks() == [1, 3] and lays[2].stage_ranks(0) == [2, 3] and lays[3].world_size == 4


def test_shard_plan_holds_only_the_ranks_experts() -> None:
    cfg = CONFIGS["deepseek_v3"]
    plan = shard_plan(cfg, plan_layout(cfg, 2, 1, 3, ep=2))  # ep rank 1, tp rank 1
    held = sorted({int(n.split(".")[4]) for n in plan if ".ffn.experts." in n})
    assert held == [4, 5, 6, 7]
    assert plan["layers.1.ffn.gate.weight"] == (None, 0, 0) and plan["layers.1.ffn.score_bias"] == (None, 0, 0)
    assert plan["layers.1.ffn.experts.5.w1.weight"] == (0, 16, 32)
    assert plan["layers.1.ffn.experts.5.w2.weight"] == (1, 16, 32)
    assert plan["layers.1.ffn.shared.w3.weight"] == (0, 32, 64)
    assert plan["layers.0.ffn.w1.weight"] == (0, 48, 96)  # the dense first layer: TP as usual


@pytest.mark.parametrize("sizes, message", [
    (dict(expert_parallel_size=3), "does not divide the model's moe.n_experts=8"),
    (dict(expert_parallel_size=2, pipeline_parallel_size=2), "pipeline_parallel_size=2 is not supported"),
    (dict(expert_parallel_size=2, context_parallel_size=2), "context_parallel_size=2 is not supported"),
    (dict(expert_parallel_size=2, quantization="int8"), "quantization='int8' is not supported"),
])
def test_unsupported_combinations_are_clear_errors(sizes, message) -> None:
    config = EngineConfig(**sizes)
    with pytest.raises(ValueError, match=message):
        check_engine_config(config, CONFIGS["qwen_moe"], config.world_size)


def test_expert_parallel_needs_a_moe_model() -> None:
    dense = ModelConfig(**BASE)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        check_engine_config(EngineConfig(expert_parallel_size=2), dense, 2)
    with pytest.raises(ValueError, match="expert_parallel_size=0 must be a positive integer"):
        EngineConfig(expert_parallel_size=0)


def test_imbalance_is_max_over_mean() -> None:
    assert expert_imbalance([2, 2, 2, 2]) == 1.0
    assert expert_imbalance([6, 2, 0, 0]) == 3.0
    assert expert_imbalance([0, 0]) == 0.0


# --- distributed: real ranks against one process ----------------------------------------------------------

def engine_config(**sizes) -> EngineConfig:
    """A small pool (24 blocks of 4 tokens) so that 5 requests of ~40 tokens preempt."""
    return EngineConfig(block_size=BLOCK, max_num_batched_tokens=20, max_num_seqs=5, max_model_len=64,
                        enable_prefix_caching=True, kv_cache_memory=_pool_bytes(), **sizes)


def _pool_bytes() -> int:
    from scratchlm.inference.kv_cache import bytes_per_block

    c = CONFIGS["qwen_moe"]
    return 24 * bytes_per_block(c.n_layers, c.n_kv_heads, c.head_dim, BLOCK, torch.float32)


PREFIX = [1, 40, 261, 378, 43, 383, 286, 261, 37, 298]


def workload() -> list[tuple[str, list[int], SamplingParams]]:
    reqs = []
    for i in range(5):
        prompt = PREFIX + [300 + 7 * i, 20 + i]
        if i % 2 == 0:
            params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
        else:
            params = SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=30, ignore_eos=True,
                                    n=2 if i == 3 else 1)
        reqs.append((f"r{i}", prompt, params))
    return reqs


def run(engine: LLMEngine) -> dict[str, list[list[int]]]:
    for rid, prompt, params in workload():
        engine.add_request(rid, prompt, params)
    out = {}
    while engine.has_unfinished_requests():
        for r in engine.step():
            if r.finished:
                out[r.request_id] = [o.token_ids for o in r.outputs]
    return out


def steps() -> tuple[list[ModelInput], list[list[int]]]:
    """Hand-made steps on disjoint blocks: three prefills (all rows' logits), then three decodes and a new prefill,
    then one decode alone (the other replica has no sequence); and each sequence's tokens they run."""
    def slots(table, start, n):
        return [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + n)]

    tables = [[0, 1], [2, 3, 4], [5], [6, 7]]
    lens = [5, 9, 3, 6]
    g = torch.Generator().manual_seed(5)
    toks = [torch.randint(1, 512, (n + 2,), generator=g).tolist() for n in lens]
    ids, pos, sl, prefills = [], [], [], []
    for s in range(3):
        prefills.append((len(ids), lens[s], lens[s], tables[s]))
        ids += toks[s][:lens[s]]
        pos += list(range(lens[s]))
        sl += slots(tables[s], 0, lens[s])
    first = ModelInput(ids, pos, sl, 0, [], [], prefills, list(range(len(ids))))
    dec_ids = [toks[s][lens[s]] for s in range(3)]
    second = ModelInput(dec_ids + toks[3][:lens[3]], [lens[s] for s in range(3)] + list(range(lens[3])),
                        [slots(tables[s], lens[s], 1)[0] for s in range(3)] + slots(tables[3], 0, lens[3]), 3,
                        [t + [0] * (3 - len(t)) for t in tables[:3]],  # padded as build_model_input does
                        [lens[s] + 1 for s in range(3)], [(3, lens[3], lens[3], tables[3])],
                        list(range(3 + lens[3])))
    third = ModelInput([toks[1][lens[1] + 1]], [lens[1] + 1], slots(tables[1], lens[1] + 1, 1), 1, [tables[1]],
                       [lens[1] + 2], [], [0])
    done = [toks[0][:lens[0] + 1], toks[1][:lens[1] + 2], toks[2][:lens[2] + 1], toks[3][:lens[3]]]
    return [first, second, third], done


class RoutingCounter:
    """Forward hooks on a plain model's `MoE` layers: rows routed to each expert (the oracle of the load)."""

    def __init__(self, model: TransformerLM):
        self.load: dict[int, torch.Tensor] = {}
        for i, block in enumerate(model.layers):
            if isinstance(block.ffn, MoE):
                self.load[i] = torch.zeros(block.ffn.features.n_experts, dtype=torch.long)
                block.ffn.register_forward_hook(self._hook(i))

    def _hook(self, layer: int):
        def count(module: MoE, args, _output) -> None:
            x = args[0].reshape(-1, args[0].shape[-1])
            _, ids = route(module.gate(x), module.features, module.score_bias)
            self.load[layer] += torch.bincount(ids.flatten(), minlength=len(self.load[layer]))
        return count


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ep")
    return {name: make_checkpoint(name, root) for name in CONFIGS}


@pytest.fixture(scope="module")
def single(checkpoints):
    """Per model: the one-process engine's logits of `steps()` (the fused C++ step or the Python step, whichever
    the engine picks: not the EP code), the routing of the same tokens by plain forwards of the model (hooks on its
    `MoE` layers), and an engine run's ids and stats."""
    out = {}
    for name, path in checkpoints.items():
        engine = LLMEngine.from_pretrained(path, engine_config())
        inputs, done = steps()
        logits = [engine.runner.execute(inp).clone() for inp in inputs]
        model = load(path).model.eval()
        counter = RoutingCounter(model)
        with torch.no_grad():
            for tokens in done:
                model(torch.tensor([tokens]))
        engine = LLMEngine.from_pretrained(path, engine_config())  # a fresh cache and counters for the run
        ids = run(engine)
        out[name] = (logits, {i: t.tolist() for i, t in counter.load.items()}, ids, engine.stats())
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("ep, tp", [(2, 1), (2, 2)], ids=["ep2", "ep2xtp2"])
def test_equal_to_one_rank(checkpoints, single, name, ep, tp) -> None:
    ref_logits, ref_load, ref_ids, ref_stats = single[name]
    engine = LLMEngine.from_pretrained(checkpoints[name], engine_config(expert_parallel_size=ep,
                                                                        tensor_parallel_size=tp))
    try:
        inputs, _ = steps()
        for inp, ref in zip(inputs, ref_logits):
            got = engine.runner.execute(inp)
            assert got.shape == ref.shape
            err = (got - ref).abs().max().item()
            print(f"{name} ep={ep} tp={tp}: {got.shape[0]} rows, max |logit diff| {err:.2e}")
            assert err < 1e-5
        assert engine.stats().expert_load == ref_load  # every replica's rows, counted once
        ids = run(engine)
        stats = engine.stats()
        assert ids == ref_ids
        assert ref_stats.num_preemptions > 0 and ref_stats.prefix_cache_hits > 0  # the workload exercises both
        assert (stats.num_preemptions, stats.prefix_cache_hits) == (ref_stats.num_preemptions,
                                                                   ref_stats.prefix_cache_hits)
    finally:
        engine.runner.shutdown()


@pytest.mark.distributed
def test_killed_rank_fails_the_engine_fast(checkpoints) -> None:
    engine = LLMEngine.from_pretrained(checkpoints["qwen_moe"], engine_config(expert_parallel_size=2,
                                                                              parallel_timeout_s=60))
    try:
        for i in range(3):
            engine.add_request(str(i), [1, 300 + i, 400], SamplingParams(max_tokens=60, ignore_eos=True))
        for _ in range(3):
            engine.step()
        os.kill(engine.runner.procs[0].pid, signal.SIGKILL)  # mid-generation
        t0 = time.monotonic()
        with pytest.raises(ParallelWorkerError) as info:
            while time.monotonic() - t0 < 60:
                engine.step()
        elapsed = time.monotonic() - t0
        print(f"killed EP rank 1: ParallelWorkerError after {elapsed:.2f} s")
        assert elapsed < 60
        assert "rank 1" in str(info.value) and "exited with code -9" in str(info.value) and "ep=2" in str(info.value)
        with pytest.raises(ParallelWorkerError, match="rank 1"):  # stays failed
            engine.step()
    finally:
        engine.runner.shutdown()
    assert not any(p.is_alive() for p in engine.runner.procs)


@pytest.mark.distributed
def test_serve_expert_parallel_metrics_and_dead_rank(checkpoints, tmp_path) -> None:
    """`scratchlm serve MOE --expert-parallel-size 2`: a completion (token ids: the model has no tokenizer), the
    per-expert load and imbalance on /metrics, then SIGKILL of rank 1 -> exit status 3."""
    from scratchlm.server.health import EXIT_ENGINE_FAILED
    from tests.server.supervised import served

    with served(tmp_path, "--expert-parallel-size", "2", model=checkpoints["qwen_moe"]) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": [1, 40, 261, 378], "max_tokens": 6,
                                                          "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        samples = parse_prometheus(httpx.get(srv.url + "/metrics", timeout=10).text)
        rows = {k: v for k, v in samples.items() if k.startswith("scratchlm:moe_expert_tokens_total")}
        layer0 = [v for k, v in rows.items() if 'layer="0"' in k]
        assert len(layer0) == 8 and sum(layer0) == 2 * (4 + 5)  # top-2 of 4 prompt + 5 decode tokens
        imb = [v for k, v in samples.items() if k.startswith("scratchlm:moe_expert_imbalance") and 'layer="0"' in k]
        assert imb == [max(layer0) / (sum(layer0) / 8)]
        snap = httpx.get(srv.url + "/inspector/snapshot", timeout=10).json()  # the inspector's stats: the same load
        assert snap["stats"]["expert_load"]["0"] == layer0
        (rank,) = srv.ranks()
        os.kill(rank, signal.SIGKILL)
        t0 = time.monotonic()
        code = srv.wait_exit(60)
        print(f"EP rank 1 killed while idle -> exit {code} after {time.monotonic() - t0:.2f} s")
        assert code == EXIT_ENGINE_FAILED, srv.output()[-3000:]
        assert "rank 1" in srv.output()
