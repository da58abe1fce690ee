"""Mixtral-style expert target names (``w1`` / ``w2`` / ``w3``) are not normalised (every release).

Why: SGLang renames an adapter's expert weights ``.w1.`` / ``.w3.`` / ``.w2.`` to gate / up / down, but not
the names in its ``target_modules``: a start-up adapter whose config lists ``w1, w2, w3`` makes SGLang ask
the model for the size of ``w1`` (``NotImplementedError``), and the server does not start.

What the guard does: for an adapter whose expert weights use those names, its target names become
``gate_proj`` / ``up_proj`` / ``down_proj``, as its weights already are.
"""

from __future__ import annotations

from ..adapters import EXPERT, names
from ..catalogue import Defect, Deployment, Presence, Remedy, by_marker
from ..log import logger

UTILS = "sglang.srt.lora.utils"
RENAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class MixtralTargetNames(Defect):
    id = "mixtral-target-names"
    title = "Mixtral-style w1 / w2 / w3 expert targets are not normalised: the server does not start"
    first, last = "0.5.11", "0.5.23"
    exposed = "Mixtral-family adapters whose target_modules name w1, w2, w3"
    remedy = Remedy.FIX
    does = "the adapter's target names become gate_proj / up_proj / down_proj, as its weights are"

    def present(self) -> Presence:
        return by_marker(UTILS, '"w1"', where="get_normalized_target_modules",
                         fixed="SGLang maps w1 / w2 / w3 target names",
                         present="SGLang maps no w1 / w2 / w3 target name")

    def on_adapter(self, manager, adapter, deployment: Deployment) -> str | None:
        config = adapter.config
        targets = config.target_modules
        if isinstance(targets, str) or not any(t in RENAMES for t in targets or ()):
            return None
        if not any(EXPERT.search(name) for name in names(adapter)):
            return None  # w1 / w2 / w3 of something else than experts: not ours to rename
        renamed = [RENAMES.get(t, t) for t in targets]
        config.target_modules = renamed
        if isinstance(getattr(config, "hf_config", None), dict):
            config.hf_config["target_modules"] = renamed
        logger.info("LoRA adapter %s: target modules %s read as %s", getattr(adapter, "uid", "?"),
                    list(targets), renamed)
        return None


    def diagnose(self, adapter) -> str | None:
        targets = adapter.config.target_modules
        if isinstance(targets, str) or not any(t in RENAMES for t in targets or ()):
            return None
        if not any(EXPERT.search(name) for name in names(adapter)):
            return None
        return "its target_modules name w1 / w2 / w3: a server started with it does not start (get_hidden_dim)"


DEFECT = MixtralTargetNames()
