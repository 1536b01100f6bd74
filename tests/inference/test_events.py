"""The engine's step-event stream (scratchlm/inference/events.py): free when nobody listens, exact when someone does."""

from __future__ import annotations

import pickle

from scratchlm.inference import SamplingParams
from scratchlm.inference.events import CACHED, FREE, SHARED_FORK, SHARED_PREFIX, USED, StepEvent
from tests.inference.helpers import greedy, make_engine, run_all, tiny_model


def _collect(engine) -> list[StepEvent]:
    events: list[StepEvent] = []
    engine.events.detail_interval_s = 0.0  # every step carries the pool map
    engine.events.subscribe(events.append)
    return events


def _check_event(engine, ev: StepEvent) -> None:
    pool = ev.pool
    assert pool.free + pool.used == pool.num_blocks
    assert pool.map is not None and len(pool.map) == pool.num_blocks
    assert pool.map.count(FREE) + pool.map.count(CACHED) == pool.free
    assert pool.map.count(CACHED) == pool.cached_free
    assert pool.map.count(SHARED_PREFIX) == pool.shared_prefix
    assert pool.map.count(SHARED_FORK) == pool.shared_fork
    assert pool.map.count(USED) + pool.shared_prefix + pool.shared_fork == pool.used
    held = {b for table in pool.tables.values() for b in table}
    assert all(pool.map[b] not in (FREE, CACHED) for b in held)
    assert ev.num_batched_tokens == sum(w.num_tokens for w in ev.decodes + ev.prefills)
    assert ev.num_batched_tokens <= ev.token_budget
    assert all(w.num_tokens == 1 for w in ev.decodes if w.kind == "decode")
    assert all(w.kind in ("decode", "verify") for w in ev.decodes)
    assert len(ev.decodes) + len(ev.prefills) <= ev.max_num_seqs
    staged = ev.schedule_s + ev.forward_s + ev.sample_s + ev.detokenize_s
    assert 0 < staged <= ev.step_s + 1e-6 and ev.forward_s > 0
    assert abs(staged + ev.other_s - ev.step_s) < 1e-6
    stats = engine.stats()
    assert (ev.totals.prompt_tokens, ev.totals.generation_tokens, ev.totals.preemptions) == (
        stats.prompt_tokens_total, stats.generation_tokens_total, stats.num_preemptions)
    assert (ev.totals.prefix_cache_hits, ev.totals.prefix_cache_queries) == (
        stats.prefix_cache_hits, stats.prefix_cache_queries)


def test_no_listener_costs_nothing():
    model, cfg = tiny_model()
    engine = make_engine(model, cfg)
    engine.add_request("a", [1, 2, 3, 4, 5], greedy(4))
    run_all(engine)
    assert engine.events.steps == 0 and not engine.events.active
    assert "schedule" not in vars(engine.scheduler) and "execute" not in vars(engine.runner)


def test_events_describe_each_step_and_leave_outputs_unchanged():
    model, cfg = tiny_model()
    prompts = {f"r{i}": [(7 * i + j) % 40 + 1 for j in range(5 + 9 * i)] for i in range(5)}
    plain = make_engine(model, cfg, max_num_batched_tokens=24)
    observed = make_engine(model, cfg, max_num_batched_tokens=24)
    events = _collect(observed)
    for eng in (plain, observed):
        for rid, p in prompts.items():
            eng.add_request(rid, p, greedy(6))
    expected = run_all(plain)
    seen: list[StepEvent] = []

    def check(engine):
        _check_event(engine, events[-1])
        seen.append(events[-1])

    assert run_all(observed, check) == expected
    assert len(events) == observed.events.steps == len(seen)
    # chunked prefill: the longest prompt (41 tokens) needs two chunks under a 24-token budget
    chunks = [w for ev in events for w in ev.prefills if w.request_id == "r4"]
    assert len(chunks) >= 2 and sum(c.num_tokens for c in chunks) == len(prompts["r4"])
    assert sum(ev.prompt_tokens for ev in events) == sum(len(p) for p in prompts.values())
    assert sum(ev.generated_tokens for ev in events) == 5 * 6
    assert sorted(r for ev in events for r in ev.finished) == sorted(prompts)
    assert events[-1].pool.used == 0
    assert StepEvent(**{**pickle.loads(pickle.dumps(events[0])).__dict__}) == events[0]
    assert "spans" not in events[0].to_dict() and events[0].to_dict(spans=True)["spans"]
    observed.events.unsubscribe(events.append)
    observed.add_request("x", [1, 2, 3], greedy(2))
    run_all(observed)
    assert "schedule" not in vars(observed.scheduler) and "execute" not in vars(observed.runner)
    assert not observed.events.active


def test_prefix_hits_forks_preemption_and_aborts_are_reported():
    model, cfg = tiny_model()
    engine = make_engine(model, cfg, num_blocks=64, block_size=4)
    events = _collect(engine)
    shared = list(range(1, 17))
    engine.add_request("first", shared + [20], greedy(3))
    run_all(engine)
    engine.add_request("second", shared + [21], greedy(3))
    engine.step()
    assert events[-1].prefix_cache_hits == 4 and events[-1].prefix_cache_queries == 4
    engine.add_request("third", shared + [22], greedy(8))
    engine.step()
    assert events[-1].pool.shared_prefix >= 4  # second and third hold the same cached prefix blocks
    run_all(engine)
    engine.add_request("forked", [3, 4, 5, 6, 7, 8, 9, 10, 11], SamplingParams(n=3, max_tokens=4, seed=1,
                                                                                ignore_eos=True))
    engine.step()
    engine.step()
    assert events[-1].pool.shared_fork >= 2 * 1 and len(events[-1].pool.tables) == 3
    engine.abort_request("forked")
    engine.add_request("after", [1, 2], greedy(1))
    engine.step()
    assert events[-1].aborted == ["forked"]
    run_all(engine)
    # a pool too small for everyone preempts, and the events name who
    small = make_engine(model, cfg, num_blocks=6, block_size=4)
    ev_small = _collect(small)
    for i in range(3):
        small.add_request(f"p{i}", [i + 1] * 6, greedy(10))
    run_all(small, lambda e: _check_event(e, ev_small[-1]))
    preempted = [p for ev in ev_small for p in ev.preempted]
    assert preempted and len(preempted) == small.stats().num_preemptions == ev_small[-1].totals.preemptions


def test_speculative_steps_report_proposed_and_accepted():
    model, cfg = tiny_model()
    engine = make_engine(model, cfg, speculative="ngram", num_speculative_tokens=3)
    events = _collect(engine)
    engine.add_request("s", [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], greedy(12))
    run_all(engine, lambda e: _check_event(e, events[-1]))
    proposed = sum(ev.spec_proposed for ev in events)
    accepted = sum(ev.spec_accepted for ev in events)
    stats = engine.speculator.stats
    assert (proposed, accepted) == (stats.drafted, stats.accepted) and 0 <= accepted <= proposed
    assert events[-1].totals.spec_drafted == stats.drafted


def test_a_failing_listener_is_dropped_not_fatal():
    model, cfg = tiny_model()
    engine = make_engine(model, cfg)

    def bad(ev):
        raise RuntimeError("boom")

    engine.events.subscribe(bad)
    engine.add_request("a", [1, 2, 3], greedy(3))
    assert len(run_all(engine)["a"]) == 3
    assert engine.events.dropped_listeners == 1 and engine.events.num_listeners == 0
