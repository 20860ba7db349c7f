"""Chat templates: a conversation → token ids plus an assistant-only loss mask.

Three ways to render, picked by `resolve_template`:

* ``tokenizer`` with ``{% generation %}`` markers: ``tokenizer.apply_chat_template(...,
  return_assistant_tokens_mask=True)`` gives the ids and the mask directly.
* ``tokenizer`` without markers: the conversation is rendered prefix by prefix. For the assistant
  turn at index i, the text ``render(messages[:i+1])`` adds after ``render(messages[:i],
  add_generation_prompt=True)`` is that turn's span (its content and end-of-turn marker; trailing
  whitespace such as the newline after ``<|im_end|>`` is left out of the mask). A template whose
  renders are not prefixes of each other cannot be split this way; such records are skipped
  (reason ``template_error``).
* ``plain``: for base models that have no template (the default target, Gemma 3 270M converted
  from GGUF, has none; its turn tokens were never trained and make it emit junk)::

      <bos>System: {system}

      User: {user 1}

      Assistant: {assistant 1}

      User: {user 2}

      Assistant: {assistant 2}<eos>

  Turns are separated by one blank line; role names are ``System``, ``User``, ``Assistant``;
  contents are stripped of surrounding whitespace. The generation prompt is ``Assistant:`` with
  NO trailing space: the space belongs to the reply (``" " + content``), so the prompt's last
  token is the same in training and in decoding. The loss mask covers each reply and, after the
  final reply, ``<eos>`` (so the drafter learns to stop). ``<bos>``/``<eos>`` are added only when the
  tokenizer defines them. Contents are tokenized with ``split_special_tokens=True``: text like
  ``"<eos>"`` inside a message never becomes a control token.

Plain-text records (one message with role ``text``) are ``<bos>{text}<eos>`` with everything after
``<bos>`` in the mask, whatever the template.

Except for the ``{% generation %}`` path, a conversation is tokenized segment by segment (template
text, then reply, then template text, ...), so the ids `render_prompt` gives for decoding are a
prefix of the training ids token for token — train and eval see the same prompt.

Deliberately not here: reading files, splitting, caching (`drafttrain.data`); tools, documents
and multimodal content in templates.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

TEMPLATES = ("auto", "plain", "tokenizer")
PLAIN_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}
PLAIN_SEP = "\n\n"

Messages = list[dict[str, str]]
# A segment is template/prompt text or a reply, as text or as ready ids (bos/eos).
Segment = tuple[str | list[int], bool]


class TemplateError(ValueError):
    """The template cannot render this conversation (raised by Jinja, or renders not prefix-stable)."""


def has_generation_markers(tokenizer) -> bool:
    """Whether the tokenizer's chat template marks assistant text with ``{% generation %}``."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "{% generation %}" in template.replace("{%-", "{%").replace(
        "-%}", "%}"
    )


def resolve_template(tokenizer, template: str = "auto") -> str:
    """Turn ``auto`` into ``plain`` or ``tokenizer``; check the choice is possible.

    Raises:
        ValueError: unknown template name, or ``tokenizer`` asked for a tokenizer without one.
    """
    if template not in TEMPLATES:
        raise ValueError(f"unknown template {template!r}; expected one of {', '.join(TEMPLATES)}")
    has = bool(getattr(tokenizer, "chat_template", None))
    if template == "auto":
        return "tokenizer" if has else "plain"
    if template == "tokenizer" and not has:
        raise ValueError("template=tokenizer but the tokenizer has no chat template; use template=plain")
    return template


def with_system_prompt(messages: Messages, system_prompt: str) -> Messages:
    """Prepend ``system_prompt`` as a system turn unless empty or the conversation has one."""
    if not system_prompt or (messages and messages[0]["role"] == "system"):
        return messages
    return [{"role": "system", "content": system_prompt}, *messages]


def _special_ids(tokenizer) -> tuple[list[int], list[int]]:
    bos = getattr(tokenizer, "bos_token_id", None)
    eos = getattr(tokenizer, "eos_token_id", None)
    return ([bos] if bos is not None else []), ([eos] if eos is not None else [])


def _plain_segments(tokenizer, messages: Messages, add_generation_prompt: bool) -> list[Segment]:
    bos, eos = _special_ids(tokenizer)
    segments: list[Segment] = [(bos, False)]
    text = ""
    for i, m in enumerate(messages):
        sep = PLAIN_SEP if i else ""
        content = m["content"].strip()
        if m["role"] == "assistant":
            segments += [(text + sep + "Assistant:", False), (" " + content, True)]
            text = ""
        else:
            text += f"{sep}{PLAIN_ROLES[m['role']]}: {content}"
    if add_generation_prompt:
        text += (PLAIN_SEP if messages else "") + "Assistant:"
    elif messages and messages[-1]["role"] == "assistant":
        segments.append((eos, True))
    segments.append((text, False))
    return segments


def _render(tokenizer, messages: Messages, add_generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as e:  # Jinja raise_exception(), bad roles, ...: the record is skipped
        raise TemplateError(f"chat template failed: {e}") from e


def _template_segments(tokenizer, messages: Messages, add_generation_prompt: bool) -> list[Segment]:
    """Split the tokenizer-template rendering into prompt / reply segments by prefix diffs."""
    segments: list[Segment] = []
    done = ""  # text already emitted as segments
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = _render(tokenizer, messages[:i], True)
        full = _render(tokenizer, messages[: i + 1], False)
        if not prompt.startswith(done) or not full.startswith(prompt):
            raise TemplateError("chat template renders are not prefix-stable; cannot locate the reply")
        reply = full[len(prompt) :].rstrip()
        segments += [(prompt[len(done) :], False), (reply, True)]
        done = prompt + reply
    final = _render(tokenizer, messages, add_generation_prompt)
    if not final.startswith(done):
        raise TemplateError("chat template renders are not prefix-stable; cannot locate the reply")
    segments.append((final[len(done) :], False))
    return segments


def _text_segments(tokenizer, text: str) -> list[Segment]:
    bos, eos = _special_ids(tokenizer)
    return [(bos, False), (text, True), (eos, True)]


def _tokenize_segments(
    tokenizer, segments: list[Segment], split_special: bool
) -> tuple[list[int], list[int]]:
    texts = [s for s, _ in segments if isinstance(s, str) and s]
    kwargs: dict[str, Any] = {"add_special_tokens": False}
    if split_special:
        kwargs["split_special_tokens"] = True
    encoded = iter(tokenizer(texts, **kwargs)["input_ids"] if texts else [])
    ids: list[int] = []
    mask: list[int] = []
    for piece, is_reply in segments:
        if isinstance(piece, str):
            if not piece:
                continue
            piece = next(encoded)
        ids += piece
        mask += [int(is_reply)] * len(piece)
    return ids, mask


def tokenize_conversation(
    tokenizer, messages: Messages, template: str = "auto"
) -> tuple[list[int], list[int]]:
    """Token ids and loss mask (1 on assistant tokens) of a whole conversation.

    Args:
        tokenizer: a HF tokenizer.
        messages: normalised turns ``{"role", "content"}``; roles system/user/assistant, or one
            ``text`` turn for plain-text records.
        template: ``auto``, ``plain`` or ``tokenizer`` (see the module docstring).

    Returns:
        ``(input_ids, loss_mask)``, equal length, not truncated.

    Raises:
        TemplateError: the tokenizer's template cannot render or split this conversation.
    """
    if len(messages) == 1 and messages[0]["role"] == "text":
        return _tokenize_segments(tokenizer, _text_segments(tokenizer, messages[0]["content"]), True)
    kind = resolve_template(tokenizer, template)
    if kind == "plain":
        return _tokenize_segments(tokenizer, _plain_segments(tokenizer, messages, False), True)
    if has_generation_markers(tokenizer):
        try:
            out = tokenizer.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
        except Exception as e:
            raise TemplateError(f"chat template failed: {e}") from e
        return list(out["input_ids"]), [int(x) for x in out["assistant_masks"]]
    return _tokenize_segments(tokenizer, _template_segments(tokenizer, messages, False), False)


def render_prompt(
    tokenizer, messages: Messages, template: str = "auto", system_prompt: str = ""
) -> list[int]:
    """Token ids of ``messages`` followed by the assistant generation prompt, as in training.

    Use it to build decoding prompts: the ids equal the prefix of the training ids that precedes
    the reply (except under ``{% generation %}`` templates, where HF tokenizes the whole text).
    For a plain-text record the prompt is ``<bos>`` plus the text's tokens.

    Args:
        tokenizer: a HF tokenizer.
        messages: turns ``{"role", "content"}``, usually ending with a user turn.
        template: ``auto``, ``plain`` or ``tokenizer``.
        system_prompt: prepended as a system turn when the conversation has none.
    """
    if len(messages) == 1 and messages[0]["role"] == "text":
        bos, _ = _special_ids(tokenizer)
        return _tokenize_segments(tokenizer, [(bos, False), (messages[0]["content"], False)], True)[0]
    messages = with_system_prompt(list(messages), system_prompt)
    kind = resolve_template(tokenizer, template)
    if kind == "plain":
        return _tokenize_segments(tokenizer, _plain_segments(tokenizer, messages, True), True)[0]
    if has_generation_markers(tokenizer):
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, add_generation_prompt=True
        )
        return list(out["input_ids"])
    return _tokenize_segments(tokenizer, _template_segments(tokenizer, messages, True), False)[0]


def tokenizer_hash(tokenizer) -> str:
    """Stable 16-hex-digit hash of the vocabulary, special tokens and chat template.

    Two tokenizers with the same hash map the same strings to the same ids and render chats the
    same way; drafter folders record it and loading compares it to the target's.
    """
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    specials = {name: getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "pad", "unk")}
    added = sorted((int(i), str(t)) for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items())
    payload = {
        "vocab": vocab,
        "specials": specials,
        "added": added,
        "chat_template": getattr(tokenizer, "chat_template", None) or "",
    }
    blob = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]
