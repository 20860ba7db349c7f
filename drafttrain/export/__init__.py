"""Export: turn a drafter folder into what the Hub, vLLM and SGLang load, and prove it loads back.

`formats` writes and validates the engine layouts, `card` renders the model card, `hub` uploads,
`security` keeps pickles and secrets out, `command` is `drafttrain export`.

What this package does not do: train, evaluate or run an engine. It never imports vLLM or SGLang;
their loaders were read and their key names and config fields are written down in `formats`.
"""

from __future__ import annotations


class ExportError(ValueError):
    """Anything a user can get wrong while exporting or uploading; the message is one line."""


__all__ = ["ExportError"]
