"""Grammar-constrained decoding in the engine (structured outputs, llguidance).

Oracles: `jsonschema` validates every JSON reply against its schema, `re.fullmatch` every regex reply, the choice list
every choice reply; the tokenizer bridge is compared with llguidance's own conversion of the HF tokenizer
(transformers reads the same GGUF); unconstrained rows, preemption and speculation are compared with engine runs
without the thing under test. The default model (SmolLM2-135M-Instruct) answers the JSON/regex/choice prompts; the
tiny random models of helpers.py (token i = chr(65 + i)) cover batching, preemption and speculation.
"""

from __future__ import annotations

import itertools
import json
import re

import jsonschema
import pytest

from scratchlm.inference import EngineConfig, LLMEngine, SamplingParams
from scratchlm.inference.params import StructuredOutputs
from scratchlm.inference.structured import GrammarCompiler, check_structured, token_table
from tests.inference.helpers import CharTokenizer, block_bytes, make_engine, tiny_model

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0,
                                                                           "maximum": 150}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "item": {"enum": ["pizza", "salad", "soup"]},
        "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
        "extras": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "urgent": {"type": "boolean"},
    },
    "required": ["item", "quantity", "extras", "urgent"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def smol(default_model_path) -> LLMEngine:
    return LLMEngine.from_pretrained(default_model_path, EngineConfig(max_num_seqs=32))


def _chat(engine: LLMEngine, text: str) -> str:
    return engine.apply_chat_template([{"role": "user", "content": text}])


def _generate(engine: LLMEngine, requests: list[tuple[str | list[int], SamplingParams]]) -> list:
    """All requests added before the first step (so they share steps); outputs in order."""
    ids = [f"r{i}" for i in range(len(requests))]
    for rid, (prompt, params) in zip(ids, requests):
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[rid] for rid in ids]


def _so(**kwargs) -> StructuredOutputs:
    return StructuredOutputs(**kwargs)


# ---------------------------------------------------------------------------- the default model
def test_json_schema_replies_validate_greedy_and_sampled(smol: LLMEngine) -> None:
    prompts = [_chat(smol, "Describe a person."), _chat(smol, "Who wrote Hamlet? Answer in JSON."),
               _chat(smol, "I want two soups, quickly, with bread.")]
    requests = []
    for schema in (PERSON, ORDER):
        spec = _so(json=schema if schema is PERSON else json.dumps(schema))  # a dict, or its JSON text
        requests += [(p, SamplingParams(temperature=0.0, max_tokens=100, structured_outputs=spec)) for p in prompts]
        requests += [(p, SamplingParams(temperature=1.0, seed=s, max_tokens=100, structured_outputs=spec))
                     for s, p in enumerate(prompts)]
    outs = _generate(smol, requests)
    for (_, params), out in zip(requests, outs):
        c = out.outputs[0]
        spec = params.structured_outputs
        schema = spec.json if isinstance(spec.json, dict) else json.loads(spec.json)
        assert c.finish_reason == "stop", (c.text, c.finish_reason)
        jsonschema.validate(json.loads(c.text), schema)
    assert smol.tokenizer.eos_id not in outs[0].outputs[0].token_ids  # the grammar's end stops it, no EOS needed


def test_json_object_regex_and_choice(smol: LLMEngine) -> None:
    regex = r"[A-Z][a-z]{2,8}, [0-9]{1,3} (km|mi)"
    choices = ["positive", "negative", "neutral"]
    requests = []
    for seed in range(3):
        sampled = {"temperature": 0.9, "seed": seed}
        requests += [
            (_chat(smol, "Give me a JSON object about a city."),
             SamplingParams(max_tokens=60, structured_outputs=_so(json_object=True), **sampled)),
            (_chat(smol, "Name a city and its distance from Paris."),
             SamplingParams(max_tokens=30, structured_outputs=_so(regex=regex), **sampled)),
            (_chat(smol, "Sentiment of: 'I love this phone!'"),
             SamplingParams(max_tokens=10, structured_outputs=_so(choice=choices), **sampled)),
        ]
    outs = _generate(smol, requests)
    for (_, params), out in zip(requests, outs):
        c = out.outputs[0]
        kind = params.structured_outputs.kind
        if kind == "json_object":
            if c.finish_reason == "stop":  # a free-form object may run into max_tokens; it is a prefix then
                assert isinstance(json.loads(c.text), dict), c.text
            else:
                assert c.text.startswith("{")
        elif kind == "regex":
            assert c.finish_reason == "stop" and re.fullmatch(regex, c.text), c.text
        else:
            assert c.finish_reason == "stop" and c.text in choices, c.text


def test_lark_grammar_with_embedded_json_and_n_samples(smol: LLMEngine) -> None:
    grammar = 'start: "ANSWER: " answer\nanswer: %json ' + json.dumps(PERSON)
    params = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=60, structured_outputs=_so(grammar=grammar))
    (out,) = _generate(smol, [(_chat(smol, "Describe a person."), params)])
    assert len(out.outputs) == 3
    for c in out.outputs:  # each sample has its own matcher
        assert c.finish_reason == "stop" and c.text.startswith("ANSWER: "), c.text
        jsonschema.validate(json.loads(c.text[len("ANSWER: "):]), PERSON)


def test_bad_specs_are_value_errors_with_the_library_message(smol: LLMEngine) -> None:
    cases = [
        (_so(json={"type": "object", "properties": {"a": {"type": "strin"}}}), "Invalid type: strin"),
        (_so(json={"$ref": "#/definitions/missing"}), "does not exist"),
        (_so(regex="a(b"), "unclosed group"),
        (_so(grammar="start: missing_rule"), "unknown name"),
    ]
    for spec, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)) as info:
            smol.add_request("bad", "hi", SamplingParams(structured_outputs=spec))
        assert f"structured_outputs.{spec.kind}" in str(info.value)
        with pytest.raises(ValueError, match=re.escape(message)):
            check_structured(spec, smol.grammars)
    assert not smol.has_unfinished_requests()


def test_compiled_grammars_are_cached(smol: LLMEngine) -> None:
    grammars = smol.grammars
    spec = _so(json={"type": "object", "properties": {"cached": {"type": "integer"}}, "required": ["cached"]})
    misses = grammars.misses
    smol.add_request("c1", "hi", SamplingParams(max_tokens=1, n=2, structured_outputs=spec))
    assert grammars.misses == misses + 1
    hits = grammars.hits
    same = _so(json=json.dumps(spec.json))  # the same schema as JSON text: the same cache entry
    smol.add_request("c2", "hi", SamplingParams(max_tokens=1, structured_outputs=same))
    assert grammars.misses == misses + 1 and grammars.hits > hits
    smol.abort_request("c1")
    smol.abort_request("c2")
    smol.step()


@pytest.mark.slow  # transformers reads the GGUF's tokenizer in ~12 s
def test_token_table_matches_llguidance_reading_the_hf_tokenizer(smol: LLMEngine, default_model_path) -> None:
    """The bridge's LLTokenizer and llguidance's own conversion of transformers' tokenizer (from the same GGUF)
    allow the same tokens along a JSON reply."""
    transformers = pytest.importorskip("transformers")
    import llguidance
    import llguidance.hf
    import numpy as np

    hf = transformers.AutoTokenizer.from_pretrained(default_model_path.parent, gguf_file=default_model_path.name)
    theirs = llguidance.hf.from_tokenizer(hf)
    ours = smol.grammars.lltokenizer
    assert ours.vocab_size == theirs.vocab_size and ours.eos_token == theirs.eos_token == smol.tokenizer.eos_id
    grammar = llguidance.LLMatcher.grammar_from_json_schema(ORDER, defaults={"whitespace_flexible": False})
    text = '{"item":"soup","quantity":2,"extras":["bread","été ☀"],"urgent":true}'
    ids = smol.tokenizer.encode(text)
    matchers = [llguidance.LLMatcher(tok, grammar) for tok in (ours, theirs)]
    for token in [*ids, smol.tokenizer.eos_id]:
        masks = [np.frombuffer(m.compute_bitmask(), dtype=np.uint8) for m in matchers]
        assert np.array_equal(masks[0], masks[1])
        assert [m.consume_token(token) for m in matchers] == [True, True], [m.get_error() for m in matchers]
    assert all(m.is_stopped() for m in matchers)


# ---------------------------------------------------------------------------- tiny models (token i = chr(65 + i))
def _tiny(num_blocks: int = 64, vocab: int = 48, eos_id: int | None = None, **options) -> LLMEngine:
    model, cfg = tiny_model(seed=3, vocab=vocab)
    return make_engine(model, cfg, num_blocks=num_blocks, eos_id=eos_id, **options)


def test_unconstrained_rows_are_unchanged_by_constrained_neighbours() -> None:
    prompts = [[1, 5, 9, 2], [7, 7, 3], [4, 40, 41, 12, 8]]
    free = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=0.7, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True, logprobs=2)]
    constrained = [SamplingParams(temperature=t, seed=1, max_tokens=12, structured_outputs=_so(regex="[a-d]{4,10}"))
                   for t in (0.0, 1.0)]
    alone = _generate(_tiny(), [(p, s) for p, s in zip(prompts, free)])
    mixed = _generate(_tiny(), [(p, s) for p, s in zip(prompts, free)] + [(prompts[0], c) for c in constrained])
    for a, m in zip(alone, mixed):
        assert a.outputs[0].token_ids == m.outputs[0].token_ids
        assert a.outputs[0].logprobs == m.outputs[0].logprobs
    for out in mixed[3:]:
        assert re.fullmatch("[a-d]{4,10}", out.outputs[0].text), out.outputs[0].text


def test_preemption_keeps_the_grammar_state() -> None:
    """A pool too small for the batch preempts (recompute): the matcher follows the output tokens, so the replies
    still match and equal those of a pool that never preempts."""
    regex = "(ab|cd)[a-h]{6,12}(X|Y)"
    requests = [([i + 1, 9, 3, 2 * i], SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=40,
                                                       structured_outputs=_so(regex=regex))) for i in range(6)]
    big = _generate(_tiny(num_blocks=64, block_size=4), requests)
    small_engine = _tiny(num_blocks=14, block_size=4)
    small = _generate(small_engine, requests)
    assert small_engine.scheduler.num_preemptions > 0
    for b, s in zip(big, small):
        assert b.outputs[0].token_ids == s.outputs[0].token_ids
        assert re.fullmatch(regex, s.outputs[0].text), s.outputs[0].text


@pytest.mark.parametrize("spec", ["ngram", "layers:1"])
def test_speculative_decoding_verifies_drafts_under_the_mask(spec: str) -> None:
    """The prompt holds every pair of allowed letters followed by a forbidden one, so n-gram drafts propose it: the
    constrained rows verify drafts and reject some, greedy replies equal the engine without speculation, and every
    reply matches the grammar (also with an unconstrained row in the batch)."""
    regex = "[a-d]{2,4}X[a-d]{2,4}Z"
    prompt = [ord(c) - 65 for c in "".join(a + b + "Q" for a, b in itertools.product("abcd", repeat=2))]
    requests = [(prompt, SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=_so(regex=regex))),
                (prompt[5:], SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=_so(regex=regex))),
                (prompt, SamplingParams(temperature=1.0, seed=3, max_tokens=30, structured_outputs=_so(regex=regex))),
                (prompt[:20], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))]
    plain = _generate(_tiny(), requests)
    mixed, alone = (_tiny(speculative=spec, num_speculative_tokens=4) for _ in range(2))
    mixed.speculator.adaptive = alone.speculator.adaptive = False
    fast = _generate(mixed, requests)
    _generate(alone, requests[:3])
    stats = alone.speculator.stats
    assert stats.verifies > 0 and stats.rejected > 0 and stats.accepted > 0
    for (_, params), p, f in zip(requests, plain, fast):
        if params.greedy:
            assert p.outputs[0].token_ids == f.outputs[0].token_ids
        if params.structured_outputs is not None:
            assert f.outputs[0].finish_reason == "stop" and re.fullmatch(regex, f.outputs[0].text), f.outputs[0].text


def test_min_tokens_and_logit_bias_work_with_the_mask() -> None:
    engine = _tiny(eos_id=47)  # 'p' is EOS: special, so no grammar text can produce it
    a, b, z = (ord(c) - 65 for c in "abZ")
    outs = _generate(engine, [
        ([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=12, min_tokens=6,
                                   structured_outputs=_so(regex="[ab]+"))),
        ([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=5, logit_bias={b: 100.0},
                                   structured_outputs=_so(choice=["aab", "bba"]))),
        ([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=5, logit_bias={z: 100.0},
                                   structured_outputs=_so(choice=["aab", "bba"]))),
    ])
    first = outs[0].outputs[0]
    assert len(first.token_ids) >= 6 and re.fullmatch("[ab]+", first.text), first.text  # EOS banned below 6
    assert outs[1].outputs[0].text == "bba"  # the bias picks among the allowed tokens
    assert outs[2].outputs[0].text in ("aab", "bba")  # a bias on a disallowed token cannot force it
    assert {t for o in outs for t in o.outputs[0].token_ids} <= {a, b, 47}


def test_ids_past_the_tokenizer_are_masked() -> None:
    """A model vocabulary (48) padded beyond its tokenizer (40 ids): a grammar allowing every tokenizer token still
    never samples the 8 padding ids, which the unconstrained model does sample."""
    model, cfg = tiny_model(seed=4, vocab=48)
    config = EngineConfig(kv_cache_memory=64 * block_bytes(cfg, 16))
    requests = [([i, 3, 5], SamplingParams(temperature=2.0, seed=i, max_tokens=30, ignore_eos=True)) for i in range(4)]
    free = _generate(LLMEngine(model, CharTokenizer(40), cfg, config), requests)
    assert any(t >= 40 for o in free for t in o.outputs[0].token_ids)
    spec = _so(regex="[A-h]+")  # chr(65) .. chr(104): all 40 tokenizer ids
    constrained = [(p, SamplingParams(temperature=2.0, seed=s.seed, max_tokens=30, structured_outputs=spec))
                   for p, s in requests]
    outs = _generate(LLMEngine(model, CharTokenizer(40), cfg, config), constrained)
    assert all(t < 40 for o in outs for t in o.outputs[0].token_ids)


def test_llama2c_model_replies_follow_the_grammar(data_dir) -> None:
    """stories260K (llama2.c's SentencePiece-style tokenizer, whose encoder prepends a space): a forced '{' is the
    '{' token, not the space, and the replies match."""
    engine = LLMEngine.from_pretrained(data_dir / "models" / "stories260K" / "stories260K.bin")
    regex = "[A-Z][a-z]+ (ran|saw) [0-9]{2}[.]"
    outs = _generate(engine, [("Lily", SamplingParams(temperature=0.8, seed=s, max_tokens=40, structured_outputs=spec))
                              for s in range(3) for spec in (_so(regex=regex), _so(json_object=True))])
    for out in outs:
        c = out.outputs[0]
        assert out.error is None, out.error
        if out.outputs[0].token_ids and c.finish_reason == "stop" and c.text.startswith("{"):
            assert isinstance(json.loads(c.text), dict)
        elif c.text.startswith("{"):
            assert c.finish_reason == "length"
        else:
            assert c.finish_reason == "stop" and re.fullmatch(regex, c.text), c.text


def test_a_grammar_dead_end_fails_that_request_alone() -> None:
    """A grammar needing a character the vocabulary lacks ('x' is past chr(65 + 47)) allows no token there: that
    request fails with the reason, its neighbour finishes."""
    outs = _generate(_tiny(), [([1, 2], SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=_so(
        regex="ab[x-z]"))), ([1, 2], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))])
    assert outs[0].outputs[0].finish_reason == "error" and "allows no token" in outs[0].error
    assert outs[0].outputs[0].text == "ab"
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 8


def test_structured_outputs_need_a_tokenizer() -> None:
    model, cfg = tiny_model(vocab=48)
    engine = LLMEngine(model, None, cfg, EngineConfig(kv_cache_memory=16 * block_bytes(cfg, 16)))
    with pytest.raises(ValueError, match="structured_outputs needs the model's tokenizer"):
        engine.add_request("x", [1, 2], SamplingParams(structured_outputs=_so(regex="a")))


def test_token_table_of_each_tokenizer_kind(data_dir) -> None:
    from scratchlm.tokenizer import SentencePieceBPE
    from scratchlm.tokenizer.llama2c import Llama2cTokenizer
    from scratchlm.tokenizer.pipeline import AddedToken

    spm = SentencePieceBPE(["<unk>", "<s>", "</s>", "<0x0A>", "▁", "a", "b", "▁a", "ab", "<|end|>"],
                           [("▁", "a"), ("a", "b")],
                           added_tokens=[AddedToken("<unk>", 0), AddedToken("<s>", 1), AddedToken("</s>", 2),
                                         AddedToken("<|end|>", 9)], bos_id=1, eos_id=2,
                           decoder={"type": "Sequence", "decoders": [  # Llama 2's tokenizer.json decoder
                               {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                               {"type": "ByteFallback"}, {"type": "Fuse"},
                               {"type": "Strip", "content": " ", "start": 1, "stop": 0}]})
    tokens, special, eos = token_table(spm)
    assert tokens[3:9] == [b"\n", b" ", b"a", b"b", b" a", b"ab"]
    assert special == [0, 1, 2, 9] and eos == 2
    l2c = Llama2cTokenizer.from_file(data_dir / "models" / "stories260K" / "tok512.bin")
    tokens, special, eos = token_table(l2c)
    assert special == [0, 1, 2] and eos == 2 and len(tokens) == 512
    assert tokens[3 + 0x41] == b"A" and all(tokens[i] for i in range(3, 512))
    cases = [(spm, [b"a", b"ab a", b"b\na"]), (l2c, [b"a", b"{", b"Lily ran", "été".encode(), "é".encode()[:1]])]
    for tokenizer, texts in cases:  # the encoder llguidance calls spells exactly the bytes (no dummy-prefix space)
        lltok = GrammarCompiler(tokenizer).lltokenizer
        for raw in texts:
            assert lltok.decode_bytes(lltok.tokenize_bytes(raw)) == raw, (tokenizer, raw)
    tokens, special, eos = token_table(CharTokenizer(48, eos_id=47))
    assert tokens[:3] == [b"A", b"B", b"C"] and special == [47] and eos == 47
    compiler = GrammarCompiler(CharTokenizer(48))  # no EOS: a phantom one past the vocabulary
    assert compiler.lltokenizer.vocab_size == 49 and compiler.lltokenizer.eos_token == 48
