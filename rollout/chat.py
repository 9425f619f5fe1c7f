"""A task prompt as the policy sees it: the tokenizer's chat template around it (one user turn, then the
assistant's turn opened) when the tokenizer has one and rollout.chat_template = "auto", else the plain
text. One function for the RL generator, the warm start and the evaluator, so the three give the model the
same tokens. The template is rendered to text and tokenized without special tokens added, which is what
vLLM's chat route does with it."""

from __future__ import annotations

from typing import Any, Literal

ChatTemplateMode = Literal["auto", "off"]


def uses_chat_template(tokenizer: Any, mode: ChatTemplateMode) -> bool:
    """True when prompts go through `tokenizer`'s chat template: mode "auto" and it has one."""
    if mode not in ("auto", "off"):
        raise ValueError(f"rollout.chat_template = {mode!r}; use 'auto' or 'off'")
    return mode == "auto" and bool(getattr(tokenizer, "chat_template", None))


def prompt_token_ids(tokenizer: Any, text: str, mode: ChatTemplateMode) -> list[int]:
    """The token ids of a task prompt `text`, templated as a user turn when `uses_chat_template`."""
    if not uses_chat_template(tokenizer, mode):
        return list(tokenizer(text)["input_ids"])
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
