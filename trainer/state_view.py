"""A Resumable's checkpoint state, flattened cheaply enough for a snapshot every step.

`Resumable.state()` followed by ckpt's `flatten` walks every module (`model.state_dict()`) and every
tensor of the tree: ~10 ms of the training thread per step for a 12-layer GPT and its AdamW state on a
busy 2-core host, ~3% of the GPT's throughput on one H200 (bench/results/goodput_cuda_h200_tier0_probe_*).
Yet from one step to the next the model's parameters and buffers and the optimizer's state are the same
tensor objects, updated in place. `StateView.flat(rest)` returns what `flatten(state())` would (ckpt's
`Flat`: the same names, the same skeleton), taking those two parts from its cache while they are the same
objects, and flattening only the rest (step, data position, RNG, scheduler, extras: small).

When the cache holds: the model has no state_dict hooks, no `_save_to_state_dict` or `get_extra_state` of
its own in any module (checked once), and its modules, parameters and buffers are the ones cached (a count
per module, then the objects themselves, every call); the optimizer state's values are the cached objects
(its `state_dict()` is called every call: it is cheap, and its param_groups change: lr). Anything else, or
a sharded model (FSDP / TP: trainer/sharding.py's state), takes the full walk, as before.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch

from ckpt.tree import Flat, flatten

_DYNAMIC_MODEL = ("_state_dict_hooks", "_state_dict_pre_hooks")


class StateView:
    """See the module docstring. `full()` is `Resumable.state()`; `model`/`optimizer` are what it saves."""

    def __init__(self, full: Callable[[], dict[str, Any]], model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | None) -> None:
        self._full = full
        self._model = model
        self._optimizer = optimizer
        self._cache: _Cache | None = None
        self.rebuilds = 0
        """Full walks (for tests: 1 while nothing changes)."""

    def flat(self, rest: dict[str, Any]) -> Flat:
        """The flattened state; `rest` is the state without "model" and "optimizer" (in its key order, with
        placeholders None for those two)."""
        optimizer_sd = self._optimizer.state_dict() if self._optimizer is not None else None
        cache = self._cache
        if cache is None or not cache.holds(self._model, optimizer_sd):
            return self._rebuild()
        tensors = dict(cache.tensors)
        rest_tensors, rest_skeleton = flatten({k: v for k, v in rest.items() if k not in ("model", "optimizer")})
        skeleton: dict[str, Any] = {}
        for key in rest:
            if key == "model":
                skeleton[key] = cache.model_skeleton
            elif key == "optimizer":
                skeleton[key] = self._optimizer_skeleton(cache, optimizer_sd, tensors)
            else:
                skeleton[key] = rest_skeleton[key]
        for name, tensor in rest_tensors.items():
            tensors[name] = tensor
        return Flat(tensors, skeleton)

    def _optimizer_skeleton(self, cache: _Cache, optimizer_sd: dict[str, Any] | None,
                            tensors: dict[str, torch.Tensor]) -> Any:
        if optimizer_sd is None:
            return None
        groups_tensors, groups_skeleton = flatten({"optimizer": {"param_groups": optimizer_sd["param_groups"]}})
        tensors.update(groups_tensors)
        return {"state": cache.optimizer_state_skeleton, "param_groups": groups_skeleton["optimizer"]["param_groups"]}

    def _rebuild(self) -> Flat:
        state = self._full()
        tensors, skeleton = flatten(state)
        self.rebuilds += 1
        self._cache = _Cache.of(self._model, self._optimizer, state, tensors, skeleton)
        return Flat(tensors, skeleton)


class _Cache:
    """The model's and the optimizer state's flattened parts, and how to tell they still hold."""

    def __init__(self) -> None:
        self.modules: list[torch.nn.Module] = []
        self.counts: tuple[tuple[int, ...], ...] = ()
        self.model_objects: list[tuple[dict[str, Any], str, torch.Tensor]] = []
        self.optimizer_objects: list[tuple[int, str, Any]] = []
        self.model_values: list[torch.Tensor] = []
        self.optimizer_values: list[Any] = []
        self.optimizer_params = 0
        self.tensors: dict[str, torch.Tensor] = {}
        self.model_skeleton: Any = None
        self.optimizer_state_skeleton: Any = None

    @staticmethod
    def of(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any],
           tensors: dict[str, torch.Tensor], skeleton: dict[str, Any]) -> _Cache | None:
        if not _plain(model):
            return None
        cache = _Cache()
        cache.modules = list(model.modules())
        cache.counts = _counts(cache.modules)
        # The model's entries, as state_dict() makes them (its own walk, so that the names match exactly).
        live = model.state_dict(keep_vars=True)
        sources: dict[str, tuple[dict[str, Any], str]] = {}
        for prefix, module in model.named_modules():
            for store in (module._parameters, module._buffers):
                for attr in store:
                    sources[f"{prefix}.{attr}" if prefix else attr] = (store, attr)
        for key, value in live.items():
            name = f"model/{key}"
            found = sources.get(key)
            if found is None or found[0][found[1]] is not value or name not in tensors:
                return None
            cache.model_objects.append((found[0], found[1], value))
            cache.tensors[name] = value  # the live object: the copy reads it (state_dict() detaches a view of it)
        if len(cache.model_objects) != sum(1 for n in tensors if n.startswith("model/")):
            return None  # something else under "model"
        cache.model_skeleton = skeleton.get("model")
        if optimizer is not None:
            optimizer_sd = state.get("optimizer")
            if not isinstance(optimizer_sd, dict) or not isinstance(optimizer_sd.get("state"), dict):
                return None
            for index, entries in optimizer_sd["state"].items():
                for key, value in entries.items():
                    cache.optimizer_objects.append((index, key, value))
                    if isinstance(value, torch.Tensor):
                        name = f"optimizer/state/{index}/{key}"
                        if tensors.get(name) is not value:
                            return None
                        cache.tensors[name] = value
            cache.optimizer_state_skeleton = skeleton["optimizer"]["state"]
        cache.model_values = [v for _, _, v in cache.model_objects]
        cache.optimizer_values = [v for _, _, v in cache.optimizer_objects]
        cache.optimizer_params = len({i for i, _, _ in cache.optimizer_objects})
        return cache

    def holds(self, model: torch.nn.Module, optimizer_sd: dict[str, Any] | None) -> bool:
        if _counts(self.modules) != self.counts:
            return False
        live = [store.get(attr) for store, attr, _ in self.model_objects]
        if not all(map(operator.is_, live, self.model_values)):
            return False
        if optimizer_sd is None:
            return not self.optimizer_objects
        state = optimizer_sd["state"]
        if len(state) != self.optimizer_params or sum(map(len, state.values())) != len(self.optimizer_objects):
            return False
        try:
            live = [state[index][key] for index, key, _ in self.optimizer_objects]
        except KeyError:
            return False
        return all(map(operator.is_, live, self.optimizer_values))


def _counts(modules: list[torch.nn.Module]) -> tuple[tuple[int, ...], ...]:
    # C loops (map): checked every snapshot, over every module.
    return tuple(tuple(map(len, map(get, modules))) for get in _STORES)


_STORES = (operator.attrgetter("_parameters"), operator.attrgetter("_buffers"), operator.attrgetter("_modules"))


def _plain(model: torch.nn.Module) -> bool:
    """Whether every module's state_dict() entries are its own parameters and persistent buffers, as they are."""
    base_save = torch.nn.Module._save_to_state_dict
    base_extra = torch.nn.Module.get_extra_state
    for module in model.modules():
        if type(module)._save_to_state_dict is not base_save or type(module).get_extra_state is not base_extra:
            return False
        if any(getattr(module, hooks, None) for hooks in _DYNAMIC_MODEL):
            return False
    return True
