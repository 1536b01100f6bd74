"""render_chat against HF transformers' apply_chat_template, on the chat templates the model families ship.

The templates are fixtures (tests/inference/data/chat_templates/, sources in its README); each test renders the
same conversation with ours (a tokenizer carrying only bos_id/eos_id/decode, as scratchlm's do) and with a
`PreTrainedTokenizerFast` holding the same special tokens, and compares the strings exactly.
"""

from __future__ import annotations

import copy
import dataclasses
from datetime import datetime
from functools import cache
from pathlib import Path

import pytest

from scratchlm.inference.chat_template import render_chat

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

DATA = Path(__file__).parent / "data" / "chat_templates"

# fixture file -> (bos_token, eos_token) as the model's tokenizer_config has them (None: the model has none)
FAMILIES = {
    "HuggingFaceTB-SmolLM2-135M-Instruct": ("<|im_start|>", "<|im_end|>"),
    "meta-llama-Llama-3.2-3B-Instruct": ("<|begin_of_text|>", "<|eot_id|>"),
    "meta-llama-Llama-3.3-70B-Instruct": ("<|begin_of_text|>", "<|eot_id|>"),
    "google-gemma-2-2b-it": ("<bos>", "<eos>"),
    "google-gemma-3-it": ("<bos>", "<eos>"),
    "microsoft-Phi-3.5-mini-instruct": ("<s>", "<|endoftext|>"),
    "microsoft-Phi-4-mini-instruct": ("<|endoftext|>", "<|endoftext|>"),
    "llama-cpp-microsoft-Phi-4-mini-instruct": ("<|endoftext|>", "<|endoftext|>"),
    "Qwen-Qwen2.5-7B-Instruct": (None, "<|im_end|>"),
    "Qwen-Qwen3-0.6B": (None, "<|im_end|>"),
    "mistralai-Mistral-Nemo-Instruct-2407": ("<s>", "</s>"),
}
NO_SYSTEM_ROLE = {"google-gemma-2-2b-it"}

SYSTEM = {"role": "system", "content": "You are terse. Réponds en français si on te le demande."}
CHAT = [
    {"role": "user", "content": "Hello! What's 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "  And times three? ünïcødé ✓  "},
]
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather",
        "description": "Météo actuelle d'une ville (température in °C) <b>no escaping</b>",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name, e.g. Zürich"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"]},
    }},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]},
    }},
]
TOOL_TURNS = [
    {"role": "user", "content": "What's the weather in Zürich?"},
    {"role": "assistant", "content": "", "tool_calls": [{
        "id": "call0abcd", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}}}]},
    {"role": "tool", "tool_call_id": "call0abcd", "name": "get_weather", "content": '{"temperature": 21.5}'},
    {"role": "assistant", "content": "It is 21.5 °C in Zürich."},
    {"role": "user", "content": "Thanks!"},
]
TOOL_FAMILIES = ["meta-llama-Llama-3.2-3B-Instruct", "meta-llama-Llama-3.3-70B-Instruct", "Qwen-Qwen2.5-7B-Instruct",
                 "Qwen-Qwen3-0.6B", "mistralai-Mistral-Nemo-Instruct-2407", "llama-cpp-microsoft-Phi-4-mini-instruct"]
FIXED_DATE = {"date_string": "05 Mar 2025"}


class IdTokenizer:
    """What scratchlm's tokenizers give the template code: special-token ids, decode, chat_template."""

    def __init__(self, template: str | dict | None, bos: str | None, eos: str | None):
        self.pieces = ["<unk>", *(t for t in (bos, eos) if t is not None)]
        self.bos_id = self.pieces.index(bos) if bos is not None else None
        self.eos_id = self.pieces.index(eos) if eos is not None else None
        self.chat_template = template

    def decode(self, ids: list[int]) -> str:
        return "".join(self.pieces[i] for i in ids)


@cache
def template_text(name: str) -> str:
    return (DATA / f"{name}.jinja").read_text(encoding="utf-8")


def hf_tokenizer(template: str | dict | None, bos: str | None, eos: str | None):
    specials = [t for t in dict.fromkeys((bos, eos)) if t is not None]
    vocab = {"<unk>": 0, **{t: i + 1 for i, t in enumerate(specials)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos)
    hf.chat_template = template
    return hf


def render_both(name: str, messages: list[dict], *, add_generation_prompt: bool, **kwargs) -> tuple[str, str]:
    bos, eos = FAMILIES[name]
    template = template_text(name)
    ours = render_chat(IdTokenizer(template, bos, eos), copy.deepcopy(messages),
                       add_generation_prompt=add_generation_prompt, **copy.deepcopy(kwargs))
    theirs = hf_tokenizer(template, bos, eos).apply_chat_template(
        copy.deepcopy(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **copy.deepcopy(kwargs))
    return ours, theirs


def assert_same(name: str, messages: list[dict], *, add_generation_prompt: bool, **kwargs) -> str:
    ours, theirs = render_both(name, messages, add_generation_prompt=add_generation_prompt, **kwargs)
    assert ours == theirs
    return ours


def assert_both_reject(name: str, messages: list[dict], *, add_generation_prompt: bool = True, **kwargs) -> str:
    bos, eos = FAMILIES[name]
    template = template_text(name)
    with pytest.raises(Exception):  # noqa: B017 - HF raises jinja's TemplateError / TypeError, whichever the template hits
        hf_tokenizer(template, bos, eos).apply_chat_template(
            copy.deepcopy(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)
    with pytest.raises(ValueError) as info:
        render_chat(IdTokenizer(template, bos, eos), copy.deepcopy(messages),
                    add_generation_prompt=add_generation_prompt, **kwargs)
    return str(info.value)


# ------------------------------------------------------------------------------------------ plain conversations
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_multi_turn_matches_hf(name, add_generation_prompt):
    kwargs = FIXED_DATE if name.startswith("meta-llama") else {}
    if name == "llama-cpp-microsoft-Phi-4-mini-instruct":
        # llama.cpp's rewrite iterates `tools` whenever it is defined, and HF always defines it (None): it only
        # renders with a tools list, under HF as under us.
        assert_both_reject(name, [SYSTEM, *CHAT], add_generation_prompt=add_generation_prompt)
        kwargs = {"tools": TOOLS}
    with_system = [SYSTEM, *CHAT] if name not in NO_SYSTEM_ROLE else CHAT
    text = assert_same(name, with_system, add_generation_prompt=add_generation_prompt, **kwargs)
    assert "And times three?" in text and "4." in text
    assert_same(name, CHAT, add_generation_prompt=add_generation_prompt, **kwargs)
    assert_same(name, CHAT[:1], add_generation_prompt=add_generation_prompt, **kwargs)


def test_known_renderings():
    """A few outputs spelled out, so a shared mistake (ours and HF's) would still show."""
    smol = assert_same("HuggingFaceTB-SmolLM2-135M-Instruct", CHAT[:1], add_generation_prompt=True)
    assert smol == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nHello! What's 2+2?<|im_end|>\n<|im_start|>assistant\n")
    gemma = assert_same("google-gemma-2-2b-it", CHAT, add_generation_prompt=True)
    assert gemma == ("<bos><start_of_turn>user\nHello! What's 2+2?<end_of_turn>\n"
                     "<start_of_turn>model\n4.<end_of_turn>\n"
                     "<start_of_turn>user\nAnd times three? ünïcødé ✓<end_of_turn>\n<start_of_turn>model\n")
    llama = assert_same("meta-llama-Llama-3.3-70B-Instruct", [SYSTEM, CHAT[0]], add_generation_prompt=True,
                        **FIXED_DATE)
    assert llama.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: "
                            "December 2023\nToday Date: 05 Mar 2025\n\nYou are terse.")
    assert llama.endswith("<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    phi = assert_same("microsoft-Phi-3.5-mini-instruct", CHAT[:2], add_generation_prompt=False)
    assert phi == "<|user|>\nHello! What's 2+2?<|end|>\n<|assistant|>\n4.<|end|>\n<|endoftext|>"


def test_gemma_system_role_is_a_value_error():
    message = assert_both_reject("google-gemma-2-2b-it", [SYSTEM, *CHAT])
    assert "System role not supported" in message
    message = assert_both_reject("google-gemma-2-2b-it", [CHAT[0], CHAT[0]])
    assert "roles must alternate" in message
    # Gemma 3 folds the system message into the first user turn instead
    text = assert_same("google-gemma-3-it", [SYSTEM, *CHAT], add_generation_prompt=True)
    assert text.startswith("<bos><start_of_turn>user\nYou are terse.") and "<start_of_turn>system" not in text


def test_content_parts_and_images():
    """OpenAI-style content lists: Gemma 3 renders text parts and image placeholders; SmolLM2's template
    concatenates strings, so parts are a template error (a ValueError here, as HF fails too)."""
    parts = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " What is shown? "}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
        {"role": "user", "content": "plain string again"},
    ]
    text = assert_same("google-gemma-3-it", parts, add_generation_prompt=True)
    assert "<start_of_turn>user\nBe brief.\n\n<start_of_image>What is shown?<end_of_turn>" in text
    assert_both_reject("HuggingFaceTB-SmolLM2-135M-Instruct", parts)


def test_none_content_is_dropped_like_hf():
    """OpenAI clients send content=None with tool_calls; HF drops None-valued keys before rendering."""
    turns = copy.deepcopy(TOOL_TURNS)
    turns[1]["content"] = None
    text = assert_same("Qwen-Qwen2.5-7B-Instruct", turns, add_generation_prompt=True, tools=TOOLS)
    assert "<|im_start|>assistant\n<tool_call>\n" in text and "None" not in text
    # Qwen3's template reads the content of every assistant turn: without one, both refuse
    assert_both_reject("Qwen-Qwen3-0.6B", turns, tools=TOOLS)
    # tool_calls=None is no tool call: Llama's `'tool_calls' in message` must not see the key
    plain = [CHAT[0], {"role": "assistant", "content": "4.", "tool_calls": None}]
    text = assert_same("meta-llama-Llama-3.3-70B-Instruct", plain, add_generation_prompt=False, **FIXED_DATE)
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n4.<|eot_id|>")


# ------------------------------------------------------------------------------------------ tools
@pytest.mark.parametrize("name", TOOL_FAMILIES)
def test_tools_list_matches_hf(name):
    kwargs = FIXED_DATE if name.startswith("meta-llama") else {}
    text = assert_same(name, [SYSTEM, CHAT[0]], add_generation_prompt=True, tools=TOOLS, **kwargs)
    assert "get_weather" in text and "Météo" in text and "<b>no escaping</b>" in text  # HF's tojson: no \u, no &lt;
    assert_same(name, [CHAT[0]], add_generation_prompt=True, tools=TOOLS, **kwargs)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", TOOL_FAMILIES)
def test_tool_call_and_result_turns_match_hf(name, add_generation_prompt):
    kwargs = FIXED_DATE if name.startswith("meta-llama") else {}
    turns = TOOL_TURNS
    if name.startswith("meta-llama"):  # tools go into the first user message, which must come first
        turns = [SYSTEM, *TOOL_TURNS]
    text = assert_same(name, turns, add_generation_prompt=add_generation_prompt, tools=TOOLS, **kwargs)
    assert "21.5" in text and "Zürich" in text and "Thanks!" in text


def test_qwen_tool_call_layout():
    text = assert_same("Qwen-Qwen2.5-7B-Instruct", TOOL_TURNS, add_generation_prompt=True, tools=TOOLS)
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}}\n</tool_call>'
            in text)
    assert "<|im_start|>user\n<tool_response>\n{\"temperature\": 21.5}\n</tool_response><|im_end|>" in text


def test_mistral_tool_call_id_rule():
    turns = copy.deepcopy(TOOL_TURNS)
    turns[1]["tool_calls"][0]["id"] = "short"
    assert "length 9" in assert_both_reject("mistralai-Mistral-Nemo-Instruct-2407", turns, tools=TOOLS)


def test_llama33_builtin_tools():
    turns = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "Search the news"},
        {"role": "assistant", "tool_calls": [{"type": "function", "function": {
            "name": "brave_search", "arguments": {"query": "news"}}}]},
        {"role": "ipython", "content": {"results": ["a", "b"]}},
    ]
    text = assert_same("meta-llama-Llama-3.3-70B-Instruct", turns, add_generation_prompt=True,
                       builtin_tools=["brave_search", "wolfram_alpha"], **FIXED_DATE)
    assert '<|python_tag|>brave_search.call(query="news")<|eom_id|>' in text
    assert "Tools: brave_search, wolfram_alpha" in text


# ------------------------------------------------------------------------------------------ dates and thinking
def test_llama32_date_from_strftime_now():
    """Llama 3.2 stamps today's date through strftime_now unless date_string is passed."""
    name = "meta-llama-Llama-3.2-3B-Instruct"
    for _ in range(3):  # re-render if the day changed between the two renderings
        before = datetime.now().strftime("%d %b %Y")
        ours, theirs = render_both(name, [SYSTEM, CHAT[0]], add_generation_prompt=True)
        if before == datetime.now().strftime("%d %b %Y"):
            break
    assert ours == theirs and f"Today Date: {before}\n" in ours
    fixed = assert_same(name, [SYSTEM, CHAT[0]], add_generation_prompt=True, **FIXED_DATE)
    assert "Today Date: 05 Mar 2025\n" in fixed


@pytest.mark.parametrize("enable_thinking", [None, True, False])
def test_qwen3_enable_thinking(enable_thinking):
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    text = assert_same("Qwen-Qwen3-0.6B", [SYSTEM, *CHAT], add_generation_prompt=True, **kwargs)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n" if enable_thinking is False
                         else "<|im_start|>assistant\n")


def test_qwen3_reasoning_fields():
    """The last assistant turn keeps its reasoning; HF offers `thinking` / `reasoning` as reasoning_content."""
    for field in ("reasoning_content", "thinking", "reasoning"):
        turns = [CHAT[0], {"role": "assistant", "content": "4.", field: "2+2 is 4"}]
        text = assert_same("Qwen-Qwen3-0.6B", turns, add_generation_prompt=False)
        assert "<think>\n2+2 is 4\n</think>\n\n4.<|im_end|>" in text
    inline = [CHAT[0], {"role": "assistant", "content": "<think>\nhmm\n</think>\n\n4."}]
    assert "<think>\nhmm\n</think>\n\n4." in assert_same("Qwen-Qwen3-0.6B", inline, add_generation_prompt=False)


# ------------------------------------------------------------------------------------------ continue_final_message
@pytest.mark.parametrize("name", ["HuggingFaceTB-SmolLM2-135M-Instruct", "Qwen-Qwen2.5-7B-Instruct",
                                  "google-gemma-3-it", "meta-llama-Llama-3.3-70B-Instruct"])
def test_continue_final_message(name):
    turns = [CHAT[0], {"role": "assistant", "content": "The answer is "}]
    kwargs = FIXED_DATE if name.startswith("meta-llama") else {}
    text = assert_same(name, turns, add_generation_prompt=False, continue_final_message=True, **kwargs)
    assert text.endswith("The answer is") or text.endswith("The answer is ")
    # our default add_generation_prompt (None) yields to continue_final_message
    bos, eos = FAMILIES[name]
    assert render_chat(IdTokenizer(template_text(name), bos, eos), turns, continue_final_message=True,
                       **kwargs) == text
    with pytest.raises(ValueError, match="cannot both"):
        render_chat(IdTokenizer(template_text(name), bos, eos), turns, True, continue_final_message=True)


# ------------------------------------------------------------------------------------------ environment details
ENV_TEMPLATE = (
    "{% set ns = namespace(n=0) %}"
    "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
    "{% if m.role == 'skip' %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}"
    "{% generation %}[{{ m.role }}:{{ m.content }}]{% endgeneration %}{% endfor %}"
    "|{{ ns.n }}|{{ tools | tojson }}|{{ tools | tojson(indent=2, sort_keys=true) }}"
    "|{{ {'b': 1, 'a': [1, 2]} | tojson(separators=(',', ':')) }}|{{ dict(x=1) | tojson }}"
    "|{{ documents | tojson }}|{{ bos_token }}{{ eos_token }}|{{ unk_token is defined }}|{{ pad_token is defined }}"
    "|{{ custom_flag }}|{{ add_generation_prompt }}"
)


def test_environment_matches_hf():
    messages = [{"role": "skip", "content": "x"}, {"role": "user", "content": "<é>"},
                {"role": "assistant", "content": "never"}]
    docs = [{"title": "T", "text": "Ünï"}]
    tools = [{"name": "f", "z": "<&>", "a": "é"}]
    ours = render_chat(IdTokenizer(ENV_TEMPLATE, "<s>", "</s>"), messages, add_generation_prompt=False,
                       tools=tools, documents=docs, custom_flag=42)
    theirs = hf_tokenizer(ENV_TEMPLATE, "<s>", "</s>").apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, tools=tools, documents=docs, custom_flag=42)
    assert ours == theirs
    assert ours.startswith("[user:<é>]|1|")


def test_special_token_strings_and_attributes():
    """String attributes win over decoded ids; tokens the tokenizer lacks stay undefined, as under HF."""
    template = "{{ bos_token }}|{{ eos_token }}|{{ unk_token }}|{{ pad_token }}|{{ bos_token is defined }}"

    class Strings:
        chat_template = template
        bos_token, eos_token, unk_token, pad_token = "<B>", "<E>", "<U>", "<P>"
        bos_id = 99  # never decoded: the string is there

    assert render_chat(Strings(), CHAT) == "<B>|<E>|<U>|<P>|True"
    assert render_chat(IdTokenizer(template, None, "<E>"), CHAT) == "|<E>|||False"
    # an explicit keyword overrides the tokenizer's, as HF's kwargs do
    assert render_chat(IdTokenizer(template, "<s>", "</s>"), CHAT, bos_token="[X]").startswith("[X]|</s>")


def test_namespace_refuses_underscore_names():
    template = "{% set ns = namespace(_x=1) %}{{ ns._x }}"
    with pytest.raises(ValueError, match="underscore"):
        render_chat(IdTokenizer(template, None, None), CHAT)


def test_generation_tag_renders_its_body():
    template = template_text("HuggingFaceTB-SmolLM2-135M-Instruct").replace(
        "{{'<|im_start|>' + message['role']", "{% generation %}{{'<|im_start|>' + message['role']").replace(
        "'<|im_end|>' + '\n'}}", "'<|im_end|>' + '\n'}}{% endgeneration %}")
    assert "{% generation %}" in template
    tok = IdTokenizer(template, "<|im_start|>", "<|im_end|>")
    plain = IdTokenizer(template_text("HuggingFaceTB-SmolLM2-135M-Instruct"), "<|im_start|>", "<|im_end|>")
    assert render_chat(tok, CHAT) == render_chat(plain, CHAT)


def test_named_templates_pick_tool_use():
    named = {"default": "D{{ messages | length }}", "tool_use": "T{{ tools | length }}"}
    tok = IdTokenizer(named, None, None)
    assert render_chat(tok, CHAT) == "D3"
    assert render_chat(tok, CHAT, tools=TOOLS) == "T2"
    assert render_chat(tok, CHAT, template_name="default", tools=TOOLS) == "D3"
    hf = hf_tokenizer(named, None, None)
    assert hf.apply_chat_template(CHAT, tokenize=False, tools=TOOLS) == "T2"
    with pytest.raises(ValueError, match="no chat template named"):
        render_chat(tok, CHAT, template_name="rag")


def test_messages_are_not_mutated_and_objects_are_accepted():
    @dataclasses.dataclass
    class Message:
        role: str
        content: str | None = None

    messages = [Message("user", "hi"), {"role": "assistant", "content": "yo", "reasoning": "r"}]
    snapshot = copy.deepcopy(messages)
    tok = IdTokenizer("{% for m in messages %}{{ m.role }}={{ m.content }}/{{ m.reasoning_content }};{% endfor %}",
                      None, None)
    assert render_chat(tok, messages) == "user=hi/;assistant=yo/r;"
    assert messages == snapshot


# ------------------------------------------------------------------------------------------ validation, fallback
@pytest.mark.parametrize("bad", [
    "hello", None, {"role": "user", "content": "x"}, [], ["just a string"], [{"role": "user", "content": 3}],
    [{"content": "no role"}], [{"role": 1, "content": "x"}], [{"role": "user", "content": ["part as str"]}],
    [{"role": "assistant", "content": "", "tool_calls": "call"}], [{"role": "user", "content": object()}],
])
def test_garbage_is_a_value_error(bad):
    tok = IdTokenizer(template_text("HuggingFaceTB-SmolLM2-135M-Instruct"), "<|im_start|>", "<|im_end|>")
    with pytest.raises(ValueError):
        render_chat(tok, bad)
    with pytest.raises(ValueError):
        render_chat(IdTokenizer(None, None, None), bad)


def test_bad_tools_and_documents():
    tok = IdTokenizer(template_text("Qwen-Qwen3-0.6B"), None, "<|im_end|>")
    with pytest.raises(ValueError, match="tools"):
        render_chat(tok, CHAT, tools="get_weather")
    with pytest.raises(ValueError, match="documents"):
        render_chat(tok, CHAT, documents=["text"])


def test_invalid_template_is_a_value_error():
    with pytest.raises(ValueError, match="not valid Jinja"):
        render_chat(IdTokenizer("{% for m in messages %}", None, None), CHAT)


def test_without_template_contents_are_joined():
    tok = IdTokenizer(None, None, None)
    messages = [{"role": "system", "content": "a"}, {"role": "user", "content": [{"type": "text", "text": "b"},
                                                                                 {"type": "image"}]},
                {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}]
    assert render_chat(tok, messages) == "a\nb\n"
    assert render_chat(tok, CHAT[:2], False) == "Hello! What's 2+2?\n4."  # the positional signature still works


def test_scratchlm_gguf_tokenizer_matches_hf(default_model_path):
    """End to end with the default model's real tokenizer (SmolLM2 GGUF): bos/eos come from decode(id)."""
    from scratchlm.tokenizer.formats import from_gguf

    tok = from_gguf(default_model_path)
    assert tok.chat_template == template_text("HuggingFaceTB-SmolLM2-135M-Instruct")
    hf = hf_tokenizer(tok.chat_template, tok.decode([tok.bos_id]), tok.decode([tok.eos_id]))
    for messages in ([SYSTEM, *CHAT], CHAT):
        for agp in (True, False):
            assert render_chat(tok, messages, agp) == hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=agp)
