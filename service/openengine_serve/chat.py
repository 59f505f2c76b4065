"""A user message in the served model's chat template, for `openengine-serve generate --chat`.

The protocol is prompt-level: the frontend serves text or token ids as they
are. The client renders the template the model ships (GGUF
`tokenizer.chat_template`, published in ModelInfo.extra) the way Hugging Face's
tokenizers do: Jinja2 in a sandbox, with `add_generation_prompt`.
"""

from __future__ import annotations

from datetime import datetime


class ChatTemplateError(ValueError):
    """The model has no chat template, or rendering it failed; the message says which."""


def render_chat(model_info, prompt: str, system: str | None = None) -> str:
    """The prompt of one user turn (after an optional system turn), ready for the assistant's answer."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    extra = model_info.extra
    template = extra["chat_template"] if "chat_template" in extra else ""
    if not template:
        raise ChatTemplateError(
            f"model {model_info.served_model_name!r} has no chat template; send the prompt as it is (without --chat)"
        )

    def raise_exception(message: str) -> None:
        raise ChatTemplateError(f"the chat template refused the conversation: {message}")

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    try:
        return environment.from_string(template).render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=extra["bos_token"] if "bos_token" in extra else "",
            eos_token=extra["eos_token"] if "eos_token" in extra else "",
        )
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the model's chat template does not render: {exc}") from None
