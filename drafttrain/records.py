"""Record normalisation: one raw chat record (ShareGPT, OpenAI or plain text) → uniform messages.

`normalize_record` turns a parsed JSON object into ``[{"role", "content"}]`` turns with roles
``system`` / ``user`` / ``assistant`` (or one ``text`` turn for a plain-text record), the shape
`drafttrain.chat` renders, or says why the record cannot be used:

* ``sharegpt``: ``conversations: [{"from", "value"}]``, ``from`` in human/user/gpt/chatgpt/
  assistant/system (any case).
* ``openai``: ``messages: [{"role", "content"}]``, ``role`` in user/assistant/system/developer;
  ``content`` a string or a list of ``{"type": "text", "text"}`` parts.
* ``text``: ``text``: the whole text is trained on.
* ``auto`` picks by key: ``conversations``, else ``messages``, else ``text``.

The training data pipeline (`drafttrain.data`) and the corpus proposer
(`drafttrain.decode.proposers.corpus`) both read records through it, so a record means the same
to training and decoding.

Deliberately not here: reading files, de-duplication, splitting and caching (`drafttrain.data`);
tokenizing (`drafttrain.chat`). A leaf: it imports nothing of ours.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FORMATS", "OPENAI_ROLES", "SHAREGPT_ROLES", "jsonl_lines", "normalize_record"]

FORMATS = ("auto", "sharegpt", "openai", "text")
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}
OPENAI_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


def _openai_content(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        texts = [p.get("text") for p in content]
        return "".join(texts) if all(isinstance(t, str) for t in texts) else None
    return None


def normalize_record(record: Any, fmt: str = "auto") -> tuple[list[dict[str, str]] | None, str]:
    """One raw record → ``(messages, "")`` or ``(None, skip reason)``.

    Messages are ``{"role": system|user|assistant, "content": str}``, starting with optional system
    turns then a user turn, ending with an assistant turn; a text record is one ``text`` turn.
    Skip reasons: ``not_an_object``, ``unknown_format``, ``wrong_type``, ``unknown_role``,
    ``empty_turn``, ``no_assistant_turn``.
    """
    if not isinstance(record, dict):
        return None, "not_an_object"
    if fmt == "auto":
        fmt = next(
            (
                f
                for k, f in (("conversations", "sharegpt"), ("messages", "openai"), ("text", "text"))
                if k in record
            ),
            "",
        )
    if fmt == "text":
        text = record.get("text")
        if not isinstance(text, str):
            return None, "wrong_type"
        return ([{"role": "text", "content": text}], "") if text.strip() else (None, "empty_turn")
    if fmt == "sharegpt":
        turns, role_key, content_key, roles = record.get("conversations"), "from", "value", SHAREGPT_ROLES
    elif fmt == "openai":
        turns, role_key, content_key, roles = record.get("messages"), "role", "content", OPENAI_ROLES
    else:
        return None, "unknown_format"
    if not isinstance(turns, list):
        return None, "wrong_type"
    messages: list[dict[str, str]] = []
    for t in turns:
        if not isinstance(t, dict) or not isinstance(t.get(role_key), str):
            return None, "wrong_type"
        content = _openai_content(t.get(content_key)) if fmt == "openai" else t.get(content_key)
        if not isinstance(content, str):
            return None, "wrong_type"
        role = roles.get(t[role_key].lower())
        if role is None:
            return None, "unknown_role"
        if not content.strip():
            return None, "empty_turn"
        messages.append({"role": role, "content": content})
    # Drop assistant turns before the first user turn (no prompt) and turns after the last reply.
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first_user is not None:
        head = [m for m in messages[:first_user] if m["role"] == "system"]
        messages = head + messages[first_user:]
    last_reply = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if first_user is None or last_reply is None or last_reply < first_user:
        return None, "no_assistant_turn"
    return messages[: last_reply + 1], ""


def jsonl_lines(text: str) -> list[str]:
    """The lines of a JSON Lines text: split at "\\n" only. `str.splitlines` also splits at U+2028,
    U+2029, U+0085 and form feeds, which JSON keeps raw inside strings (`json.dumps(...,
    ensure_ascii=False)` writes them as they are): a record holding one came back as two broken
    halves (the target's own answers do, now and then)."""
    return text.split("\n")
