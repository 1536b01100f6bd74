"""The engine process's outbox (scratchlm/server/engine_process.py) bounds the inspector's events, never outputs:
at most `limit` events unread, the newest kept in a ring, the oldest dropped and counted; and across a real
child process every step is either delivered or counted as dropped."""

from __future__ import annotations

import asyncio
import queue
import threading
import time

import pytest

from scratchlm.server.engine_process import EventOutbox

inference = pytest.importorskip("scratchlm.inference")


def test_a_reader_that_stops_reading_bounds_the_events_not_the_outputs():
    outbox, credits = queue.Queue(), threading.Semaphore(4)
    events = EventOutbox(outbox, credits, limit=4)
    for step in range(1, 101):  # nobody reads: 4 go out, the ring keeps the newest 4, the rest are dropped
        events.offer({"step": step})
        outbox.put(("outputs", step, None))  # request outputs go around the bound, every one
    sent = [outbox.get_nowait() for _ in range(outbox.qsize())]
    got = [m[1]["step"] for m in sent if m[0] == "event"]
    assert got == [1, 2, 3, 4]
    assert [m[1] for m in sent if m[0] == "outputs"] == list(range(1, 101))
    assert [e["step"] for e in events.pending] == [97, 98, 99, 100] and events.dropped == 92
    for _ in range(2):  # the reader takes two: two credits back, the two oldest pending go out, drops counted
        credits.release()
    events.flush()
    later = [outbox.get_nowait()[1] for _ in range(outbox.qsize())]
    assert [(e["step"], e["outbox_dropped"]) for e in later] == [(97, 92), (98, 92)]
    events.clear()  # the inspector stopped watching: nothing left to send
    credits.release()
    events.flush()
    assert outbox.empty() and events.sent == 6


def test_engine_process_delivers_or_counts_every_step(data_dir):
    from scratchlm.server.engine_process import EngineProcessLoop

    model = data_dir / "models" / "stories260K" / "stories260K.bin"
    # the child may JIT-build the C++ extension first (a csrc change): 300 s ran out once at load ~10
    loop = EngineProcessLoop(model, inference.EngineConfig(max_num_seqs=4), threads=1, startup_timeout_s=900,
                             events_in_flight=1)
    got: list[dict] = []
    done = threading.Event()
    loop.on_event = got.append
    try:
        loop.start()
        loop.inspect(True)

        async def run() -> list:
            params = inference.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
            streams = [loop.submit(f"r{i}", f"Once upon a time {i}", params) for i in range(4)]
            outs = []
            for s in streams:
                async for item in s:
                    outs.append(item)
            return outs

        # the inspect message is queued before the requests, so the child watches from their first step on
        outs = asyncio.run(run())
        assert sum(len(o.output.outputs[0].token_ids) for o in outs if o.output.finished) == 4 * 24
        # every step the child took while watching is an event received or counted as dropped: wait on the
        # child's own count (the last step's event carries it) until the two add up to the last step's number
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not done.is_set():
            if got and got[-1]["step"] - got[0]["step"] + 1 == len(got) + got[-1]["outbox_dropped"] - \
                    got[0]["outbox_dropped"] and got[-1]["num_running"] == 0 and got[-1]["num_waiting"] == 0:
                done.set()
            time.sleep(0.02)
        assert done.is_set(), (len(got), got[-1]["step"] if got else None)
        steps = [e["step"] for e in got]
        assert steps == sorted(steps) and len(set(steps)) == len(steps)
        assert loop.events_received == len(got) and loop.events_dropped == got[-1]["outbox_dropped"]
    finally:
        loop.stop()
