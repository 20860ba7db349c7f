"""Errors a user can cause, and the one way their messages are cut to one line.

Every class here means "something the user can fix": the message is one line that names the bad
thing and the fix, and the CLI prints it as ``drafttrain: error: ...`` with a non-zero exit, never
a traceback (DESIGN.md, "Commands"). The modules that raise them re-export their own
(``drafttrain.data.DataError``, ``drafttrain.config.ConfigError``, ...), so either import works;
``isinstance`` checks agree because there is one class per name.

`first_line` is how a foreign exception (YAML, JSON, HTTP, a loader) becomes part of such a line.

Deliberately not here: ``drafttrain.chat.TemplateError``. It is a per-record signal (the data
pipeline counts such records as skipped, ``template_error``), not a message for a user, and it
stays in the chat-template leaf so that module imports nothing of ours. Also not here: printing
and exit codes (`drafttrain.cli.run_guarded`).

This module is a leaf: it imports nothing of ours, so anything may import it.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "DataError",
    "DraftLMError",
    "DrafterMismatchError",
    "EvalError",
    "ExportError",
    "HubError",
    "TargetError",
    "TrainingError",
    "UnsafeFileError",
    "first_line",
]


class ConfigError(ValueError):
    """A bad key or value; the message is one line that names it and the fix."""


class EvalError(ConfigError):
    """A bad proposer, benchmark or file; one line naming it and the fix."""


class DataError(ValueError):
    """A data problem the user can fix; the message is one line naming the file and the fix."""


class TargetError(ValueError):
    """A target that cannot be loaded, with a one-line message that says what to do."""


class DrafterMismatchError(ValueError):
    """The drafter was trained for a different target; the message says what differs."""


# models/draft_lm.py still defines its own DraftLMError; its owner replaces it with an import from here.
class DraftLMError(ValueError):
    """A student that cannot be built for this target (bad layers, tokenizer mismatch); one line."""


class TrainingError(RuntimeError):
    """A run that must stop (NaN loss, bad cache); the message names step, batch and what was kept."""


class ExportError(ValueError):
    """Anything a user can get wrong while exporting or uploading; the message is one line."""


class HubError(ExportError):
    """The upload could not happen (no token, no network, refused); nothing was uploaded."""


class UnsafeFileError(ExportError):
    """A drafter folder holds a file that could execute code when loaded (a pickle)."""


def first_line(err: BaseException) -> str:
    """The first line of ``str(err)``, or the exception's class name when the message is empty.

    Foreign messages (YAML parse errors, HTTP responses, stack-like loader errors) often run to
    many lines; a one-line user error keeps only the first.
    """
    text = str(err)
    return text.splitlines()[0] if text else type(err).__name__
