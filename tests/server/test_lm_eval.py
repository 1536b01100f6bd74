"""lm-evaluation-harness against a real `scratchlm serve`: its `local-completions` model (token-id prompts, `echo`
+ `logprobs`, max_tokens 1, batches of prompts) runs a small local multiple-choice task (loglikelihood) and a
perplexity task (loglikelihood_rolling, windows of `max_length`), fully offline, and every per-sample score it
logs equals the log-probabilities transformers computes on the same token ids (to 1e-4 in fp32).

The server runs as a subprocess on a loopback port, its engine in its own process (`--engine-process`: the prompt
logprobs cross that boundary too), chunked prefill of 16 tokens over blocks of 4. The model is a tiny random Llama
with GPT-2's tokenizer (tests/server/scoring_model.py): lm-eval tokenizes with HF AutoTokenizer on its folder. The
task configs and their JSONL data are written into tmp_path; lm-eval runs as its own CLI subprocess with
HF_DATASETS_OFFLINE / HF_HUB_OFFLINE set and its caches in tmp_path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.server.scoring_model import hf_logprobs, save_scoring_model
from tests.server.serve_process import serve_process

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
MAX_LENGTH = 24  # lm-eval's max_length; it keeps one token for the generated one: prompts of at most 23 tokens
WINDOW = MAX_LENGTH - 1  # so the rolling task's longer documents take several windows
MC_DOCS = [
    {"question": "What color is the sky on a clear day?", "choices": ["blue", "green", "red", "yellow"], "answer": 0},
    {"question": "How many legs does a spider have?", "choices": ["six", "eight", "ten"], "answer": 1},
    {"question": "Which animal says moo?", "choices": ["a cat", "a dog", "a cow", "a duck"], "answer": 2},
    {"question": "What do bees make?", "choices": ["milk", "silk", "honey"], "answer": 2},
    {"question": "Where does the sun rise?", "choices": ["in the east", "in the west", "in the north", "at noon"],
     "answer": 0},
]
PPL_DOCS = [
    {"text": "Once upon a time there was a little girl who lived in a small house near the woods with her mother, "
             "her father and a grey cat that liked to sleep in the sun all day long."},
    {"text": "The quick brown fox jumps over the lazy dog."},
    {"text": "Rain fell on the old town for three days, and the river rose until the bridge was under water."},
]
MC_YAML = """task: scratch_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""
PPL_YAML = """task: scratch_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, data_dir):
    directory = tmp_path_factory.mktemp("lm_eval_model")
    return directory, save_scoring_model(directory, data_dir / "tokenizers" / "gpt2")


@pytest.fixture(scope="module")
def serve(tiny):
    """`scratchlm serve` on a free loopback port; its URL."""
    with serve_process(str(tiny[0]), "--threads", "1", "--engine-process", "--max-model-len", "64",
                       "--max-num-batched-tokens", "16", "--block-size", "4", "--max-num-seqs", "8",
                       timeout=180) as server:
        yield server.url


def write_tasks(directory: Path) -> None:
    for name, docs, yaml in (("mc", MC_DOCS, MC_YAML), ("ppl", PPL_DOCS, PPL_YAML)):
        data = directory / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
        (directory / f"{name}.yaml").write_text(yaml.format(data=data), encoding="utf-8")


@pytest.fixture(scope="module")
def samples(serve, tiny, tmp_path_factory) -> dict[str, list[dict]]:
    """Run lm-eval's CLI on both tasks; its logged samples per task."""
    work = tmp_path_factory.mktemp("lm_eval_run")
    write_tasks(work)
    out = work / "out"
    args = ",".join([f"model={tiny[0].name}", f"base_url={serve}/v1/completions", "tokenizer_backend=huggingface",
                     f"tokenizer={tiny[0]}", "tokenized_requests=True", f"max_length={MAX_LENGTH}", "num_concurrent=1",
                     "max_retries=1", "timeout=120"])
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": str(work / "hf"), "HF_DATASETS_CACHE": str(work / "datasets"), "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    res = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
                          "--tasks", "scratch_mc,scratch_ppl", "--include_path", str(work), "--batch_size", "8",
                          "--log_samples", "--output_path", str(out)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    found = {}
    for task in ("scratch_mc", "scratch_ppl"):
        (path,) = out.rglob(f"samples_{task}_*.jsonl")
        found[task] = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    return found


@pytest.fixture(scope="module")
def hf_tok(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny[0])


def hf_score(hf, context: list[int], continuation: list[int]) -> float:
    """log P(continuation | context) under the HF model, on those token ids."""
    ids = (context + continuation)[-WINDOW:]
    ctxlen = len(ids) - len(continuation)
    lp = hf_logprobs(hf, ids)
    return sum(float(lp[j - 1, ids[j]]) for j in range(ctxlen, len(ids)))


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's tokenization of a (context, continuation) pair: trailing spaces move to the continuation, the whole
    is encoded and split after the context's tokens (no special tokens)."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    ctx = tok(context, add_special_tokens=False).input_ids
    return ctx, whole[len(ctx):]


def test_multiple_choice_scores_equal_hf(samples, tiny, hf_tok):
    rows = samples["scratch_mc"]
    assert len(rows) == len(MC_DOCS)
    checked = 0
    for row in rows:
        doc = row["doc"]
        assert len(row["resps"]) == len(doc["choices"])
        for args, resp in zip(row["arguments"].values(), row["resps"]):
            context, continuation = args["arg_0"], args["arg_1"]
            got, _is_greedy = resp[0]
            want = hf_score(tiny[1], *encode_pair(hf_tok, context, continuation))
            assert abs(float(got) - want) < 1e-4, (context, continuation, got, want)
            checked += 1
        # the logged accuracy follows from those scores (argmax over the choices)
        scores = [float(r[0][0]) for r in row["resps"]]
        assert row["acc"] == float(max(range(len(scores)), key=scores.__getitem__) == doc["answer"])
    assert checked == sum(len(d["choices"]) for d in MC_DOCS)


def test_rolling_loglikelihood_equals_hf(samples, tiny, hf_tok):
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    rows = samples["scratch_ppl"]
    assert len(rows) == len(PPL_DOCS)
    windows_seen = 0
    for row in rows:
        ids = hf_tok(row["doc"]["text"], add_special_tokens=False).input_ids
        windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
            token_list=ids, prefix_token=hf_tok.bos_token_id, max_seq_len=WINDOW - 1, context_len=1)]
        windows_seen += len(windows)
        want = sum(hf_score(tiny[1], ctx, cont) for ctx, cont in windows)
        got = row["resps"][0][0]
        got = float(got[0] if isinstance(got, list) else got)
        assert abs(got - want) < 1e-4 * len(ids), (got, want)
    assert windows_seen > len(PPL_DOCS)  # the long document took several windows
    assert torch.isfinite(torch.tensor(want))
