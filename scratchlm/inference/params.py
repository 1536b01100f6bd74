"""`SamplingParams`: how one request is sampled and when it stops (vLLM / OpenAI semantics).

Every field is validated at construction (a `ValueError` naming it); nothing is silently dropped.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass, fields

# Bounds shared by the offline API and the HTTP server (docs/server.md, "Limits and guarantees").
GREEDY_BELOW_TEMPERATURE = 1e-5  # a temperature below this is greedy (as vLLM's _SAMPLING_EPS)
MAX_TEMPERATURE = 100.0
MIN_REPETITION_PENALTY = 0.01  # 1/0.01 = 100x on a logit stays finite in float32; smaller ones overflowed
MAX_REPETITION_PENALTY = 10.0
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| (OpenAI's range)
MAX_LOGPROBS = 20
MAX_TOP_K = 2**31 - 1  # the engine also rejects top_k above the vocabulary size
SEED_RANGE = (-(2**63), 2**64)  # any signed or unsigned 64-bit integer
MAX_STOP_STRINGS = 16  # OpenAI allows 4; vLLM has no bound
MAX_STOP_CHARS = 256  # per stop string; also the longest text held back while streaming
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 100.0  # |bias| per token (OpenAI's range): -100 effectively bans a token, +100 forces it


@dataclass(frozen=True, eq=False)
class StructuredOutputs:
    """A grammar the output must follow (vLLM's ``structured_outputs``; OpenAI's ``response_format`` maps onto it).

    Exactly one field is set; anything else raises a `ValueError` naming the fields. The engine compiles it with
    llguidance when the request is added (scratchlm/inference/structured.py), so a schema or grammar the library
    cannot compile is a `ValueError` carrying the library's message, and the sequence stops with finish reason
    "stop" once the grammar is complete.

    json: a JSON schema, as a dict or its JSON text (which must hold an object).
    json_object: True = any JSON object (OpenAI's ``{"type": "json_object"}``).
    regex: the whole output matches this regex (Rust ``regex`` syntax, as llguidance reads it).
    choice: the output is exactly one of these strings (a non-empty list).
    grammar: a Lark grammar in llguidance's dialect (may embed ``%json { schema }``), or a GBNF grammar
        (llama.cpp's), which llguidance converts.
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"StructuredOutputs: exactly one of json, json_object, regex, choice, grammar must be "
                             f"set, got {given or 'none'}")
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json":
            schema = value
            if isinstance(value, str):
                try:
                    schema = _json.loads(value)
                except ValueError as e:
                    raise ValueError(f"StructuredOutputs.json: the text is not JSON ({e})") from None
            if not isinstance(schema, dict):
                raise ValueError(f"StructuredOutputs.json: got {type(schema).__name__}, expected a JSON schema "
                                 "object (a dict or its JSON text)")
            try:
                value = _json.dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
            except (TypeError, ValueError) as e:
                raise ValueError(f"StructuredOutputs.json: the schema is not JSON data ({e})") from None
        elif kind == "json_object":
            if value is not True:
                raise ValueError(f"StructuredOutputs.json_object: got {value!r}, expected true or false")
        elif kind == "choice":
            if not isinstance(value, list | tuple) or not value or not all(isinstance(c, str) for c in value):
                raise ValueError(f"StructuredOutputs.choice: got {value!r}, expected a non-empty list of strings")
            object.__setattr__(self, "choice", list(value))
            value = _json.dumps(self.choice, ensure_ascii=False)
        elif not isinstance(value, str) or not value:
            raise ValueError(f"StructuredOutputs.{kind}: got {value!r}, expected a non-empty string")
        object.__setattr__(self, "_key", (kind, str(value)))

    @property
    def kind(self) -> str:
        """Which field is set: "json", "json_object", "regex", "choice" or "grammar"."""
        return self._key[0]

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): equal for equal specs (a schema, dict or text, by its compact JSON with the key order kept);
        the compile cache's key."""
        return self._key

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StructuredOutputs) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

@dataclass
class SamplingParams:
    """Per-request sampling and stopping options. Invalid values raise a `ValueError` at construction.

    temperature: in [0, 100]; below 1e-5 means greedy (argmax, as vLLM); otherwise logits are divided by it.
    top_k: keep the k most likely tokens (None or 0 or -1 = all; the engine rejects k above its vocabulary).
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p; the boundary token is kept.
    min_p: drop tokens whose probability is below min_p * (probability of the most likely token).
    seed: seeds this request's own generator, so its samples do not depend on the rest of the batch
        (any 64-bit integer, signed or unsigned).
    max_tokens: the most tokens to generate (None = up to the engine's max_model_len); 0 only with prompt_logprobs
        (score the prompt, generate nothing: finish reason "length").
    min_tokens: EOS, stop_token_ids and stop strings are ignored before this many tokens.
    stop: strings that end the generation; removed from the text unless include_stop_str_in_output
        (at most 16 strings of at most 256 characters).
    stop_token_ids: token ids that end the generation (kept in token_ids, like EOS; at most 256).
    ignore_eos: keep generating past the tokenizer's EOS.
    n: number of samples for the prompt; they share the prompt's KV blocks.
    logprobs: None, or the number of top alternatives to return next to each sampled token's logprob.
    prompt_logprobs: None (off), or k in [0, 20]: each prompt token's logprob (the raw model's log-softmax at the
        position before it) and the k most likely alternatives there, computed in the prefill (vLLM semantics; the
        first prompt token has none). Sample 0 computes them once per request.
    presence_penalty / frequency_penalty: OpenAI semantics, in [-2, 2], over generated tokens.
    repetition_penalty: HF semantics, in [0.01, 10] (1 = off), over prompt and generated tokens.
    logit_bias: OpenAI semantics: {token id: bias in [-100, 100]} added to those logits (after the penalties,
        before temperature / top-k / top-p / greedy); keys may be ints or decimal strings (JSON's keys) and are
        normalized to ints. None or {} = off. The engine's sampler rejects ids outside its vocabulary.
    structured_outputs: None, or a `StructuredOutputs` grammar the output follows (token masks from llguidance, applied
        after logit_bias and the min_tokens mask); the engine refuses a spec it cannot compile when the request is
        added, and stops the sequence (finish reason "stop") once the grammar is complete.
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        def bad(name: str, expected: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}: got {getattr(self, name)!r}, expected {expected}")

        def number(name: str) -> float:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or v != v:
                raise bad(name, "a number")
            return float(v)

        def integer(name: str, allow_none: bool) -> int | None:
            v = getattr(self, name)
            if v is None and allow_none:
                return None
            if isinstance(v, bool) or not isinstance(v, int):
                raise bad(name, "an integer" + (" or None" if allow_none else ""))
            return v

        if not 0.0 <= number("temperature") <= MAX_TEMPERATURE:
            raise bad("temperature",
                      f"a number in [0, {MAX_TEMPERATURE:g}] (below {GREEDY_BELOW_TEMPERATURE:g} = greedy)")
        top_k = integer("top_k", True)
        if top_k is not None and not -1 <= top_k <= MAX_TOP_K:
            raise bad("top_k", f"None, -1 or 0 (all tokens), or an integer in [1, {MAX_TOP_K}]")
        if top_k is not None and top_k <= 0:
            self.top_k = None
        if not 0.0 < number("top_p") <= 1.0:
            raise bad("top_p", "a number in (0, 1]")
        if not 0.0 <= number("min_p") <= 1.0:
            raise bad("min_p", "a number in [0, 1]")
        seed = integer("seed", True)
        if seed is not None and not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
            raise bad("seed", "None or a 64-bit integer in [-2**63, 2**64)")
        max_tokens = integer("max_tokens", True)
        prompt_logprobs = integer("prompt_logprobs", True)
        if prompt_logprobs is not None and not 0 <= prompt_logprobs <= MAX_LOGPROBS:
            raise bad("prompt_logprobs", f"None or an integer in [0, {MAX_LOGPROBS}]")
        if max_tokens is not None and max_tokens < (0 if prompt_logprobs is not None else 1):
            raise bad("max_tokens", "an integer >= 1 or None (0 only with prompt_logprobs: score the prompt alone)")
        min_tokens = integer("min_tokens", False)
        if min_tokens < 0 or (max_tokens is not None and min_tokens > max_tokens):
            raise bad("min_tokens", f"an integer in [0, max_tokens={max_tokens}]")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if not isinstance(self.stop, list | tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "None, a non-empty string or a list of non-empty strings")
        self.stop = list(self.stop)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"SamplingParams.stop: got {len(self.stop)} strings, expected at most {MAX_STOP_STRINGS}")
        longest = max(map(len, self.stop), default=0)
        if longest > MAX_STOP_CHARS:
            raise ValueError(f"SamplingParams.stop: got a string of {longest} characters, expected at most "
                             f"{MAX_STOP_CHARS}")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.stop_token_ids, list | tuple) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids", "a list of non-negative token ids")
        self.stop_token_ids = list(self.stop_token_ids)
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"SamplingParams.stop_token_ids: got {len(self.stop_token_ids)} ids, expected at most "
                             f"{MAX_STOP_TOKEN_IDS}")
        n = integer("n", False)
        if n < 1:
            raise bad("n", "an integer >= 1")
        logprobs = integer("logprobs", True)
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise bad("logprobs", f"None or an integer in [0, {MAX_LOGPROBS}]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= number(name) <= MAX_PENALTY:
                raise bad(name, f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]")
        if not MIN_REPETITION_PENALTY <= number("repetition_penalty") <= MAX_REPETITION_PENALTY:
            raise bad("repetition_penalty",
                      f"a number in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] (1 = off)")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "true or false")
        self.logit_bias = _normalize_logit_bias(self.logit_bias)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise bad("structured_outputs", "None or a StructuredOutputs")

    @property
    def greedy(self) -> bool:
        """Whether this request takes the argmax (temperature below 1e-5, as vLLM)."""
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def has_repetition_penalties(self) -> bool:
        """Whether a repetition, presence or frequency penalty is on."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def has_penalties(self) -> bool:
        """Whether anything changes the raw logits before the min_tokens mask: a penalty or a logit_bias
        (the sampler's first stage, shared with speculative decoding's target distribution)."""
        return self.has_repetition_penalties or bool(self.logit_bias)


def _normalize_logit_bias(bias: object) -> dict[int, float] | None:
    """`bias` as {int token id: float}, or None when empty; a ValueError naming the bad entry otherwise."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"SamplingParams.logit_bias: got {type(bias).__name__}, expected a dict of token id -> "
                         f"bias in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
    out: dict[int, float] = {}
    for key, value in bias.items():
        if isinstance(key, str) and key.isascii() and key.isdigit():
            token = int(key)
        elif isinstance(key, int) and not isinstance(key, bool) and key >= 0:
            token = key
        else:
            raise ValueError(f"SamplingParams.logit_bias: got the key {key!r}, expected a non-negative token id "
                             "(an int or a decimal string)")
        if token in out:
            raise ValueError(f"SamplingParams.logit_bias: token id {token} is given twice")
        if (isinstance(value, bool) or not isinstance(value, int | float) or value != value
                or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
            raise ValueError(f"SamplingParams.logit_bias: got {value!r} for token id {token}, expected a number in "
                             f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        out[token] = float(value)
    return out or None
