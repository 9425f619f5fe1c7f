"""A task prompt as the policy sees it: the tokenizer's chat template around it (one user turn, then the
assistant's turn opened) when the tokenizer has one and rollout.chat_template = "auto", else the plain
text. One function for the RL generator, the warm start and the evaluator, so the three give the model the
same tokens. The template is rendered to text and tokenized without special tokens added, which is what
vLLM's chat route does with it. A later turn of an episode (`turn_ids`) is rendered on its own and its ids
appended: the text of earlier turns is never tokenized again."""

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


# A stand-in conversation `turn_ids` renders a turn after: only what the template adds for the new turn is kept.
_BEFORE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


def turn_ids(tokenizer: Any, text: str, mode: ChatTemplateMode, role: str = "tool") -> list[int]:
    """The ids an episode appends after a policy turn for an observation `text`: with the chat template
    (`uses_chat_template`), the template's `role` turn holding it and the assistant's next turn opened, rendered
    after a stand-in conversation and cut from it after the assistant's content and its end-of-sequence text (the
    policy's turn ends with that token when it stopped there); otherwise the plain text. Tokenized on its own,
    without special tokens added, so the ids before it are the ones sampled."""
    if not uses_chat_template(tokenizer, mode):
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    before = tokenizer.apply_chat_template(_BEFORE, tokenize=False)
    after = tokenizer.apply_chat_template(
        [*_BEFORE, {"role": role, "content": text}], add_generation_prompt=True, tokenize=False
    )
    cut = before.rindex("y") + 1
    if not after.startswith(before[:cut]):
        raise ValueError(
            f"the tokenizer's chat template renders a conversation differently once a {role!r} turn follows it, so "
            "an observation cannot be appended as tokens; set rollout.chat_template = 'off' or use a template whose "
            "rendering of earlier turns does not change"
        )
    eos = getattr(tokenizer, "eos_token", None) or ""
    if eos and after.startswith(eos, cut):
        cut += len(eos)
    return list(tokenizer(after[cut:], add_special_tokens=False)["input_ids"])
