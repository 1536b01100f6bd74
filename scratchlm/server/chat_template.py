"""Turning chat messages into a prompt.

The template comes from the model (``engine.apply_chat_template``: the Jinja template in the GGUF or
``tokenizer_config.json``; ChatML for SmolLM2). A model without one (a base model such as llama2.c's
stories260K) gets :func:`plain_chat_prompt`, a documented plain-text layout, so the chat endpoint
still works for experiments.
"""

from __future__ import annotations

from typing import Any

ROLE_NAMES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}


def plain_chat_prompt(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """``"User: hi\\nAssistant:"``: one ``Role: content`` line per message, then the assistant cue."""
    lines = [f"{ROLE_NAMES.get(m['role'], m['role'].title())}: {m['content']}" for m in messages]
    if add_generation_prompt:
        lines.append("Assistant:")
    return "\n".join(lines)


def has_chat_template(engine: Any) -> bool:
    return bool(getattr(engine.tokenizer, "chat_template", None))


def render_chat(engine: Any, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """The prompt text for `messages`: the model's own template, else :func:`plain_chat_prompt`."""
    if has_chat_template(engine):
        return engine.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    return plain_chat_prompt(messages, add_generation_prompt)
