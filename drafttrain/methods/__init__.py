"""Drafter methods: one module per method, a registry mapping names to them.

    registry.py   name -> method object (built-in modules imported on first use), folder_method
    base.py       DrafterMethod: the hooks the trainer, the proposer loader and the exporter call
    eagle.py      what EAGLE-3 and EAGLE-1 share (EagleMethod); eagle3.py, eagle1.py
    medusa.py     what Medusa-1 and Medusa-2 share (MedusaMethod); medusa1.py, medusa2.py
    draft_lm.py   a small causal LM distilled from the target

A new method: a module with a `DrafterMethod` subclass, `register(TheMethod())` at its end, and
its name in `registry.BUILTIN` (or a `register` call by whoever uses it). Nothing else changes.
"""

from drafttrain.methods.registry import folder_method, get_method, method_names, register

__all__ = ["get_method", "register", "method_names", "folder_method"]
