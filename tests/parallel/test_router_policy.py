"""The data-parallel router without models: routing policy, retries, health and metrics over mocked replicas.

The replicas are httpx MockTransport handlers, so every failure (refused connection, 503, a hang, a stream
cut after its first chunk) is produced on purpose and the router's answer is checked exactly.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from scratchlm.parallel.router import (
    Replica,
    Router,
    RouterConfig,
    affinity_key,
    choose_replica,
    estimate_cost,
)


def replicas(n: int) -> list[Replica]:
    return [Replica(index=i, url=f"http://r{i}") for i in range(n)]


def test_least_outstanding_tokens_wins():
    rs = replicas(3)
    rs[0].outstanding_tokens, rs[1].outstanding_tokens, rs[2].outstanding_tokens = 50, 10, 30
    assert choose_replica(rs, "any prompt").index == 1
    rs[1].healthy = False
    assert choose_replica(rs, "any prompt").index == 2
    rs[2].dead = True
    assert choose_replica(rs, "any prompt").index == 0
    assert choose_replica(rs, "any prompt", exclude={0}) is None


def test_prefix_affinity_breaks_ties_and_is_stable():
    rs = replicas(4)
    keys = [f"prompt number {i}" for i in range(200)]
    chosen = {k: choose_replica(rs, k).index for k in keys}
    assert all(choose_replica(rs, k).index == chosen[k] for k in keys)  # same prefix -> same replica
    counts = [list(chosen.values()).count(i) for i in range(4)]
    assert min(counts) > 25, counts  # prefixes spread over the replicas
    # a replica leaving moves only its own prefixes (rendezvous hashing)
    rs[2].healthy = False
    for k in keys:
        if chosen[k] != 2:
            assert choose_replica(rs, k).index == chosen[k]
    # load beats affinity unless within the slack
    rs[2].healthy = True
    k = keys[0]
    rs[chosen[k]].outstanding_tokens = 10
    assert choose_replica(rs, k).index != chosen[k]
    assert choose_replica(rs, k, slack=10).index == chosen[k]


def test_cost_and_affinity_key_from_requests():
    assert estimate_cost({"prompt": "x" * 40, "max_tokens": 100}, 256) == 11 + 100
    assert estimate_cost({"prompt": [1, 2, 3], "max_tokens": 5, "n": 2}, 256) == 3 + 10
    assert estimate_cost({"prompt": ["abcd", "abcd"], "max_tokens": 5}, 256) == 4 + 10
    assert estimate_cost({"messages": [{"role": "user", "content": "hi"}]}, 256) == 2 + 256
    assert estimate_cost({"prompt": "x", "max_tokens": "lots"}, 7) == 1 + 7
    long = "Once upon a time " * 20
    assert affinity_key({"prompt": long + "A"}, 64) == affinity_key({"prompt": long + "B"}, 64)
    assert affinity_key({"prompt": [long, "x"]}, 64) == long[:64]
    chat = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]}
    assert affinity_key(chat, 64).startswith("system:")


def test_bad_router_options_are_named():
    with pytest.raises(ValueError, match=r"router_health_interval_s=0.*router_unhealthy_after=0"):
        RouterConfig(health_interval_s=0, unhealthy_after=0)
    with pytest.raises(ValueError, match="at least one replica"):
        Router([])


class Fakes:
    """Scripted replicas: `behaviour[index]` is 'ok', 'refuse', '503', '429', 'hang', 'cut' (stream cut after
    the first chunk) or 'sick' (/health 503, requests fine)."""

    def __init__(self, behaviour: list[str]):
        self.behaviour = behaviour
        self.seen: list[tuple[int, str]] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        index = int(request.url.host[1:])
        what = self.behaviour[index]
        self.seen.append((index, request.url.path))
        if request.url.path == "/health":
            return httpx.Response(503 if what in ("sick", "503") else 200, json={"status": what})
        if request.url.path == "/metrics":
            return httpx.Response(200, text=(
                '# HELP scratchlm:generation_tokens_total Gen.\n# TYPE scratchlm:generation_tokens_total counter\n'
                f'scratchlm:generation_tokens_total{{model_name="m"}} {10 * (index + 1)}\n'
                f'scratchlm:kv_cache_usage_perc{{model_name="m"}} {0.2 * (index + 1)}\n'))
        if what == "refuse":
            raise httpx.ConnectError("connection refused", request=request)
        if what in ("503", "429"):
            return httpx.Response(int(what), json={"error": {"message": what}})
        if what == "hang":
            await asyncio.sleep(3600)
        body = json.loads(request.content)
        if body.get("stream"):
            async def events():
                yield b'data: {"text": "a"}\n\n'
                if what == "cut":
                    raise httpx.ReadError("peer closed")
                yield b'data: {"text": "b"}\n\ndata: [DONE]\n\n'

            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events())
        return httpx.Response(200, json={"replica": index, "prompt": body["prompt"]})


def make_router(behaviour: list[str], **config) -> tuple[Router, Fakes]:
    fakes = Fakes(behaviour)
    router = Router(replicas(len(behaviour)), RouterConfig(**config))
    router.client = httpx.AsyncClient(transport=httpx.MockTransport(fakes))
    for r in router.replicas:
        r.down = asyncio.Event()
    return router, fakes


async def post(router: Router, body: dict) -> tuple[int, bytes]:
    resp = await router.handle("POST", "/v1/completions", {"content-type": "application/json"},
                               json.dumps(body).encode())
    if hasattr(resp, "body_iterator"):
        data = b"".join([c async for c in resp.body_iterator])
    else:
        data = resp.body
    return resp.status_code, data


def first_choice(prompt: str, n: int) -> int:
    return choose_replica(replicas(n), affinity_key({"prompt": prompt}, 64)).index


def prompt_for(index: int, n: int = 2) -> str:
    """A prompt whose affinity replica (all loads equal) is `index`, so a test knows where it goes first."""
    return next(p for p in (f"story {i}" for i in range(1000)) if first_choice(p, n) == index)


@pytest.mark.parametrize("failure", ["refuse", "503", "hang"])
def test_failed_replica_is_retried_elsewhere_and_leaves_rotation(failure):
    async def go():
        router, fakes = make_router([failure, "ok"])
        p = prompt_for(0)
        task = asyncio.create_task(post(router, {"prompt": p, "max_tokens": 4}))
        if failure == "hang":  # the request waits on a replica that the health checks then take out
            await asyncio.sleep(0.05)
            assert router.replicas[0].outstanding_requests == 1
            router.mark_down(router.replicas[0], "test")
        status, data = await task
        assert status == 200 and json.loads(data) == {"replica": 1, "prompt": p}
        assert [i for i, _ in fakes.seen] == [0, 1]
        assert not router.replicas[0].in_rotation and router.retries_total == 1
        assert all(r.outstanding_tokens == 0 and r.outstanding_requests == 0 for r in router.replicas)
        # while out of rotation it gets nothing
        status, data = await post(router, {"prompt": p, "max_tokens": 4})
        assert status == 200 and json.loads(data)["replica"] == 1 and len(fakes.seen) == 3
        await router.close()

    asyncio.run(go())


def test_no_replica_left_is_a_clear_503_and_429_tries_the_others():
    async def go():
        router, _ = make_router(["refuse", "503"])
        status, data = await post(router, {"prompt": "x", "max_tokens": 4})
        msg = json.loads(data)["error"]["message"]
        assert status == 503 and "replica 0" in msg and "replica 1" in msg and "answered 503" in msg
        assert router.rejected_total == 1
        await router.close()
        router, fakes = make_router(["429", "ok"])
        status, data = await post(router, {"prompt": prompt_for(0), "max_tokens": 4})
        assert status == 200 and json.loads(data)["replica"] == 1
        assert router.replicas[0].in_rotation  # a full queue is not a failure
        fakes.behaviour = ["429", "429"]
        status, _ = await post(router, {"prompt": "y", "max_tokens": 4})
        assert status == 429
        await router.close()

    asyncio.run(go())


def test_streams_retry_before_the_first_chunk_and_report_a_cut_after_it():
    async def go():
        router, fakes = make_router(["refuse", "ok"])
        status, data = await post(router, {"prompt": prompt_for(0), "max_tokens": 4, "stream": True})
        assert status == 200 and data == b'data: {"text": "a"}\n\ndata: {"text": "b"}\n\ndata: [DONE]\n\n'
        await router.close()
        router, fakes = make_router(["cut", "ok"])
        status, data = await post(router, {"prompt": prompt_for(0), "max_tokens": 4, "stream": True})
        events = [e for e in data.decode().split("\n\n") if e]
        assert events[0] == 'data: {"text": "a"}' and "failed mid-stream" in events[1] and len(events) == 2
        assert router.streams_broken_total == 1 and not router.replicas[0].in_rotation
        assert router.replicas[0].outstanding_requests == 0
        await router.close()

    asyncio.run(go())


def test_health_checks_take_a_replica_out_and_back():
    async def go():
        router, fakes = make_router(["sick", "ok"], unhealthy_after=2)
        await router.check_once()
        assert router.replicas[0].in_rotation  # one failed check is not enough
        await router.check_once()
        assert not router.replicas[0].in_rotation and router.replicas[1].in_rotation
        status, body = router.health()
        assert status == 200 and body["replicas_in_rotation"] == 1
        fakes.behaviour[0] = "ok"
        await router.check_once()
        assert router.replicas[0].in_rotation
        fakes.behaviour[:] = ["sick", "sick"]
        await router.check_once()
        await router.check_once()
        assert router.health()[0] == 503
        await router.close()

    asyncio.run(go())


def test_metrics_sum_the_replicas_and_add_the_routers():
    from scratchlm.server.metrics import parse_prometheus

    async def go():
        router, _ = make_router(["ok", "ok"])
        await post(router, {"prompt": prompt_for(1), "max_tokens": 4})
        samples = parse_prometheus(await router.metrics())
        assert samples['scratchlm:generation_tokens_total{model_name="m"}'] == 30
        assert samples['scratchlm:kv_cache_usage_perc{model_name="m"}'] == pytest.approx(0.3)
        assert samples['scratchlm:router_replica_requests_total{replica="1"}'] == 1
        assert samples['scratchlm:router_replica_requests_total{replica="0"}'] == 0
        assert samples["scratchlm:router_replicas_in_rotation"] == 2
        await router.close()

    asyncio.run(go())


def test_serve_flags_reach_the_replicas_and_bad_ones_are_named(capsys):
    import argparse

    from scratchlm.cli import main
    from scratchlm.parallel.router import replica_argv
    from scratchlm.serve import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["m.gguf", "--data-parallel-size", "2", "--port", "9000", "--host", "0.0.0.0",
                              "--max-num-seqs", "8", "--api-key", "k", "--no-enable-prefix-caching", "--threads", "1",
                              "--router-health-interval-s", "0.5"])
    argv = replica_argv(args)
    assert argv[0] == "m.gguf" and "--port" not in argv and "--host" not in argv
    assert "--data-parallel-size" not in argv and not any(a.startswith("--router") for a in argv)
    joined = " ".join(argv)
    assert "--max-num-seqs 8" in joined and "--api-key k" in joined and "--threads 1" in joined
    assert "--no-enable-prefix-caching" in argv
    assert main(["serve", "--data-parallel-size", "0"]) == 2
    assert "--data-parallel-size 0 (expected a positive integer)" in capsys.readouterr().err
    assert main(["serve", "--router-unhealthy-after", "0", "--router-replica-urls", "host:1"]) == 2
    err = capsys.readouterr().err
    assert "router_unhealthy_after=0" in err and "'host:1' (expected http://HOST:PORT)" in err
