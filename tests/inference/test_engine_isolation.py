"""One request cannot fail another inside the engine (issue 16): fault injection in sampling, detokenizing and
stop checking fails that request alone (finish reason "error", `RequestOutput.error` set, its blocks freed) while
the others finish with exactly their undisturbed greedy tokens; `n` samples count against `max_num_seqs`."""

from __future__ import annotations

import pytest

from scratchlm.inference import SamplingParams
from scratchlm.inference.sampler import Sampler
from tests.inference.helpers import greedy, make_engine, naive_greedy, tiny_model

MODEL, CFG = tiny_model(seed=3)  # the engines' model (their ModelRunner swaps its layers for the engine's kernels)
PROMPTS = {f"r{i}": [(7 * i + j) % CFG.vocab_size for j in range(3 + i)] for i in range(6)}


class FaultySampler(Sampler):
    """Raises whenever a batch holds a row of `bad` (so the batched call fails, as an overflowing param did)."""

    def __init__(self, bad: str, after: int = 0):
        self.bad, self.after, self.calls = bad, after, 0

    def __call__(self, logits, rows):
        if any(r.request_id == self.bad for r in rows):
            self.calls += 1
            if self.calls > self.after:
                raise OverflowError(f"injected fault for {self.bad}")
        return super().__call__(logits, rows)


def run(engine, max_steps: int = 500) -> dict[str, object]:
    final = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert not engine.has_unfinished_requests()
    return final


def reference() -> dict[str, list[int]]:
    """The undisturbed greedy ids, by plain torch on a model of the same weights that no engine has run."""
    oracle, _ = tiny_model(seed=3)
    return {rid: naive_greedy(oracle, p, 12) for rid, p in PROMPTS.items()}


REF = reference()


def check_freed(engine) -> None:
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting


@pytest.mark.parametrize("after", [0, 3])  # failing in the prefill step, and mid-decode
def test_sampler_fault_fails_one_request_only(after: int) -> None:
    engine = make_engine(MODEL, CFG, block_size=4)
    engine.sampler = FaultySampler("r2", after=after)
    for rid, p in PROMPTS.items():
        engine.add_request(rid, p, greedy(12))
    final = run(engine)
    bad = final.pop("r2")
    assert bad.finished and bad.error and "injected fault for r2" in bad.error
    assert bad.outputs[0].finish_reason == "error" and len(bad.outputs[0].token_ids) == after
    assert {rid: out.outputs[0].token_ids for rid, out in final.items()} == {k: v for k, v in REF.items() if k != "r2"}
    assert all(out.error is None and out.outputs[0].finish_reason == "length" for out in final.values())
    check_freed(engine)


def test_detokenize_and_stop_check_faults_are_isolated() -> None:
    engine = make_engine(MODEL, CFG, block_size=4)
    detokenize, check_stop = engine._detokenize, engine._check_stop

    def bad_detokenize(seq, ids, final):
        if seq.request_id == "r1" and len(ids) == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        detokenize(seq, ids, final)

    def bad_check_stop(seq):
        if seq.request_id == "r4" and len(seq.output_ids) == 2:
            raise RuntimeError("injected stop-check fault")
        check_stop(seq)

    engine._detokenize, engine._check_stop = bad_detokenize, bad_check_stop
    for rid, p in PROMPTS.items():
        engine.add_request(rid, p, greedy(12))
    final = run(engine)
    assert "injected stop-check fault" in final["r4"].error and len(final["r4"].outputs[0].token_ids) == 2
    assert "UnicodeDecodeError" in final["r1"].error and len(final["r1"].outputs[0].token_ids) == 3
    rest = {rid: out.outputs[0].token_ids for rid, out in final.items() if rid not in ("r1", "r4")}
    assert rest == {k: v for k, v in REF.items() if k not in ("r1", "r4")}
    check_freed(engine)


def test_n_sample_fault_fails_all_its_samples_and_frees_the_forks() -> None:
    engine = make_engine(MODEL, CFG, block_size=4)
    engine.sampler = FaultySampler("g", after=2)
    engine.add_request("g", PROMPTS["r5"], SamplingParams(n=3, temperature=0, max_tokens=12, ignore_eos=True))
    engine.add_request("r0", PROMPTS["r0"], greedy(12))
    final = run(engine)
    assert [c.finish_reason for c in final["g"].outputs] == ["error"] * 3
    assert final["r0"].outputs[0].token_ids == REF["r0"]
    check_freed(engine)


def test_n_samples_count_against_max_num_seqs() -> None:
    """Before: sample 0 was admitted as one sequence and its n - 1 forks joined the batch unchecked."""
    engine = make_engine(MODEL, CFG, block_size=4, max_num_seqs=4)
    for i in range(3):
        engine.add_request(f"g{i}", PROMPTS[f"r{i}"], SamplingParams(n=3, temperature=0.8, seed=i, max_tokens=6))
    peak = 0
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    assert not engine.has_unfinished_requests()
    assert peak == 3  # one request of 3 samples at a time: 3 + 3 > 4
    with pytest.raises(ValueError, match=r"SamplingParams.n: got 5, expected at most max_num_seqs=4"):
        engine.add_request("big", [1, 2], SamplingParams(n=5))


def test_top_k_above_the_vocabulary_is_rejected() -> None:
    engine = make_engine(MODEL, CFG)
    with pytest.raises(ValueError, match=rf"top_k: got 49, .*\[1, {CFG.vocab_size}\]"):
        engine.add_request("k", [1, 2], SamplingParams(top_k=CFG.vocab_size + 1))
    engine.add_request("k", [1, 2], SamplingParams(top_k=CFG.vocab_size, max_tokens=3))
    assert len(run(engine)["k"].outputs[0].token_ids) == 3


def test_stop_prefix_hold_equals_the_brute_force() -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from scratchlm.inference.engine import stop_prefix_hold

    def brute(text: str, stops: list[str]) -> int:
        return max([k for s in stops for k in range(min(len(s) - 1, len(text)) + 1) if text.endswith(s[:k])],
                   default=0)

    @settings(max_examples=300, deadline=None, database=None)
    @given(st.text("ab\u00e9", max_size=12), st.lists(st.text("ab\u00e9", min_size=1, max_size=6), min_size=1,
                                                         max_size=4))
    def check(text, stops):
        assert stop_prefix_hold(text, stops) == brute(text, stops)

    check()
    many = ["a" * 255 + "b"] * 16  # the worst case the bounds allow stays cheap
    assert stop_prefix_hold("a" * 10_000, many) == 255


def test_speculative_step_isolates_a_stop_check_fault() -> None:
    engine = make_engine(MODEL, CFG, block_size=4, speculative="layers:1", num_speculative_tokens=2)
    check_stop = engine._check_stop

    def bad_check_stop(seq):
        if seq.request_id == "r3" and len(seq.output_ids) >= 4:
            raise RuntimeError("injected stop-check fault")
        check_stop(seq)

    engine._check_stop = bad_check_stop
    for rid, p in PROMPTS.items():
        engine.add_request(rid, p, greedy(12))
    final = run(engine)
    assert "injected" in final.pop("r3").error
    assert {rid: out.outputs[0].token_ids for rid, out in final.items()} == {k: v for k, v in REF.items() if k != "r3"}
    check_freed(engine)
