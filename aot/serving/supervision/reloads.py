"""How the supervisor brings a broken python step back, through the repository API (--model-control-mode=explicit,
with the admin key): one instance alone when the model allows it, else the whole model.

- replace: the broken instances leave the model first (an in-place update: the model stays loaded and its other
  instances take every request), then new instances join it (aot.serving.supervision.instance_groups). Requests fail
  only where a broken instance held them.
- reload: unload, then load (and the ensembles the unload took down): every request of the model fails meanwhile
  ("has no available versions"). For a model whose instances share one group (a repository exported before
  instances had groups of their own), and when an update fails.
- load: a model that is not loaded (an unloaded ensemble).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from aot.serving.supervision.instance_groups import addressable, group_of, replacement
from aot.serving.supervision.triton_api import TritonApi

UNLOAD_TIMEOUT = 10.0  # seconds for an unload (a hung model's stubs are killed first)
LOAD_TIMEOUT = 20.0  # seconds for a load or an update (the backbone's takes ~1 s)


@dataclass
class Reloads:
    api: TritonApi

    def can_replace(self, model: str, instances: set[str]) -> bool:
        """The instances can be replaced alone: each has a group of its own in the loaded config."""
        config = self.api.config(model)
        return addressable(config) and all(group_of(config, i) is not None for i in instances)

    def replace(self, model: str, instances: set[str]) -> None:
        """The instances leave the model, then new ones join it; the model stays loaded throughout."""
        leave, join = replacement(self.api.config(model), instances)
        if leave is not None:
            self.api.load(model, LOAD_TIMEOUT, leave)
        self.api.load(model, LOAD_TIMEOUT, join)

    def reload(self, model: str) -> None:
        """Unload and load the model, then load the ensembles its unload took down."""
        self.api.unload(model, UNLOAD_TIMEOUT)
        deadline = time.monotonic() + UNLOAD_TIMEOUT
        while self.api.model_ready(model) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.load(model)

    def load(self, model: str) -> None:
        """Load the model, then every model that was loaded and is not ready now (the ensembles an unload took down
        with it; models never loaded, e.g. `aot_lookup` on CPU, stay unloaded)."""
        self.api.load(model, LOAD_TIMEOUT)
        for entry in self.api.index():
            if entry.get("state") and entry["state"] != "READY":
                self.api.load(entry["name"], LOAD_TIMEOUT)
