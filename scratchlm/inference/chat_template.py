"""Rendering a conversation with the model's Jinja chat template (as HF `apply_chat_template`)."""

from __future__ import annotations

from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise(message: str) -> None:
    raise TemplateError(message)


def render_chat(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The prompt text for `messages`. Without a template (e.g. llama2.c models), the contents are
    joined by newlines. Malformed messages raise ValueError."""
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        raise ValueError('messages must be a list of {"role": str, "content": str} dicts')
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return "\n".join(m["content"] for m in messages)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise

    def token(attr: str) -> str:
        tid = getattr(tokenizer, attr, None)
        return tokenizer.decode([tid]) if tid is not None else ""

    try:
        return env.from_string(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=token("bos_id"), eos_token=token("eos_id"),
        )
    except TemplateError as e:
        raise ValueError(f"the model's chat template rejected the messages: {e}") from e
