"""The three coordination modes over the same kernels: `co`, `da`, `sc` (DESIGN §2).

`run_mode(spec, ...)` picks the mode named by `spec.placement.mode` from the `MODES` registry, or,
for a spec of `kind: sft`, the single-host SFT loop (locojax.sft), which takes the same keywords.
"""

from __future__ import annotations

import importlib

from locojax.registry import Registry

# mode name -> "module:function"; imported on use so CO never pays for Ray.
MODES: Registry[str] = Registry("mode")
MODES.register("co")("locojax.modes.co:run_co")
MODES.register("sc")("locojax.modes.sc:run_sc")
MODES.register("da")("locojax.modes.da:run_da")


def run_mode(spec, **kwargs):
    target = "locojax.sft:run_sft" if spec.kind == "sft" else MODES.get(spec.placement.mode)
    module_name, function = target.split(":")
    return getattr(importlib.import_module(module_name), function)(spec, **kwargs)
