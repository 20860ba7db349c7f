"""Export: turn a drafter folder into what the Hub, vLLM and SGLang load, and prove it loads back.

The engine layouts, by drafter family, parameterised by structure rather than by method name:
`eagle` (`EagleExport`: EAGLE-3 with fused aux layers, or EAGLE-1), `medusa` (`MedusaExport`:
heads with or without a target adapter) and `draft_lm` (`DraftLMExport`: a plain HF causal LM);
each drafter method names its layout (`drafttrain.methods`). `layout` holds what they share (the
`ExportPlan`, aux-layer numbering, config pieces), `formats` reads a folder, plans, writes and
checks an export by asking the folder's method, `card` renders the model card, `hub` uploads,
`security` keeps pickles and secrets out, `command` is `drafttrain export`.

What this package does not do: train, evaluate or run an engine, or branch on a method's name. It
never imports vLLM or SGLang; their loaders were read and their key names and config fields are
written down in the layout modules, each citing the engine source it mirrors.
"""

from __future__ import annotations

from drafttrain.errors import ExportError

__all__ = ["ExportError"]
