"""A conversation in the served model's chat template: for `openengine-serve generate --chat` (client side) and
the frontend's OpenAI `/v1/chat/completions` (server side).

The template is the one the model ships (GGUF `tokenizer.chat_template`, published in ModelInfo.extra),
rendered the way Hugging Face's tokenizers do: Jinja2 in a sandbox, with `add_generation_prompt`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from datetime import datetime


class ChatTemplateError(ValueError):
    """The model has no chat template, or rendering it failed; the message says which."""


def render_chat(model_info, prompt: str, system: str | None = None) -> str:
    """The prompt of one user turn (after an optional system turn), ready for the assistant's answer."""
    extra = model_info.extra
    template = extra["chat_template"] if "chat_template" in extra else ""
    if not template:
        raise ChatTemplateError(
            f"model {model_info.served_model_name!r} has no chat template; send the prompt as it is (without --chat)"
        )
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return render_messages(
        template,
        messages,
        bos_token=extra["bos_token"] if "bos_token" in extra else "",
        eos_token=extra["eos_token"] if "eos_token" in extra else "",
    )


def render_messages(
    template: str,
    messages: Sequence[dict],
    *,
    bos_token: str,
    eos_token: str,
    add_generation_prompt: bool = True,
) -> str:
    """`messages` ({"role", "content"} dicts) in `template`, ready for the assistant's answer."""
    import jinja2

    try:
        return _compiled(template).render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
        )
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the model's chat template does not render: {exc}") from None


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"the chat template refused the conversation: {message}")


@functools.lru_cache(maxsize=4)
def _compiled(template: str):
    """The template compiled once (a model has one; compiling costs milliseconds)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        return environment.from_string(template)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the model's chat template does not compile: {exc}") from None
