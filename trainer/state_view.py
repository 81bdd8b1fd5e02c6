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
per module, then the objects themselves, every call); the optimizer state's values are the cached objects.
A plain optimizer (torch's `state_dict`, no state_dict hooks) is read directly, its param_groups packed as
`state_dict()` packs them (their lr changes every step); any other has its `state_dict()` called every time.
Anything else, or a sharded model (FSDP / TP: trainer/sharding.py's state), takes the full walk, as before.

Two halves, so that a snapshot's bookkeeping can wait (trainer/deferred.py): `boundary(rest)` takes what the
next step changes (the rest, flattened, and the optimizer's param_groups) at the step boundary; `flat` takes
the model's and optimizer state's tensors, which only the optimizer's next step changes, whenever it runs.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain, repeat
from typing import Any

import torch

from ckpt.tree import Flat, flatten

_DYNAMIC_MODEL = ("_state_dict_hooks", "_state_dict_pre_hooks")

ParamKey = tuple[tuple[int, ...], tuple[int, ...]]
"""param_key's: each optimizer group's size, then every parameter's id in order."""


def _own(value: Any) -> Any:
    """A group's value as it is now: a tensor (an lr a scheduler changes in place) is copied."""
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


_ATOMS = (str, int, float, bool, type(None))


def copy_plain(value: Any) -> Any:
    """A deep copy of `value` (a scheduler's or scaler's state_dict, the extras), its dicts, lists, tuples and
    scalars copied by one walk, anything else by copy.deepcopy: taken every snapshot, and deepcopy's memo and
    dispatch for a handful of numbers took longer than the rest of the boundary's bookkeeping."""
    kind = type(value)
    if kind in _ATOMS:
        return value
    if kind is dict:
        return {k: copy_plain(v) for k, v in value.items()}
    if kind is list:
        return [copy_plain(v) for v in value]
    if kind is tuple:
        return tuple(copy_plain(v) for v in value)
    return copy.deepcopy(value)


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

    def boundary(self, rest: dict[str, Any], groups: list[dict[str, Any]] | None) -> Boundary:
        """What of the state the next step changes, flattened: `rest` is the state without "model" and
        "optimizer" (in its key order, with placeholders None for those two); `groups` the optimizer's
        param_groups as `param_groups()` took them at the boundary."""
        tensors, skeleton = flatten({k: v for k, v in rest.items() if k not in ("model", "optimizer")})
        group_tensors, group_skeleton = ({}, None) if groups is None else flatten(
            {"optimizer": {"param_groups": groups}})
        return Boundary(list(rest), tensors, skeleton, groups, group_tensors,
                        None if group_skeleton is None else group_skeleton["optimizer"]["param_groups"])

    def flat(self, rest: dict[str, Any] | Boundary) -> Flat:
        """The flattened state; `rest` as for `boundary`, or what `boundary` took earlier (then the model's and
        the optimizer's tensors are taken now: nothing but the optimizer's step may have changed them)."""
        at = rest if isinstance(rest, Boundary) else self.boundary(rest, self.param_groups())
        optimizer = self._optimizer
        cache = self._cache
        if cache is None or not cache.holds(self._model, optimizer):
            return self._rebuild(at)
        tensors = dict(cache.tensors)
        skeleton: dict[str, Any] = {}
        for key in at.keys:
            if key == "model":
                skeleton[key] = cache.model_skeleton
            elif key == "optimizer":
                skeleton[key] = None if optimizer is None else {
                    "state": cache.optimizer_state_skeleton, "param_groups": at.group_skeleton}
            else:
                skeleton[key] = at.skeleton[key]
        tensors.update(at.group_tensors)
        tensors.update(at.tensors)
        return Flat(tensors, skeleton)

    def param_groups(self, key: ParamKey | None = None) -> list[dict[str, Any]] | None:
        """The optimizer's param_groups as its state_dict() has them (params as indices), read directly from
        a plain optimizer while its parameters are the ones indexed; else from state_dict(). New dicts: a
        later change of a group's lr is not in them. `key`: param_key(optimizer.param_groups), taken now."""
        optimizer = self._optimizer
        if optimizer is None:
            return None
        cache = self._cache
        if cache is not None and cache.plain_optimizer and _plain_optimizer(optimizer):
            groups = optimizer.param_groups
            if (key or param_key(groups)) == cache.param_key:
                return [{**{k: _own(v) for k, v in g.items() if k != "params"}, "params": indices}
                        for g, indices in zip(groups, cache.group_indices, strict=True)]
        groups_sd: list[dict[str, Any]] = optimizer.state_dict()["param_groups"]
        return [{k: _own(v) for k, v in g.items()} for g in groups_sd]

    def _rebuild(self, at: Boundary) -> Flat:
        """The full walk: the model's and optimizer's parts from `state()` now, the rest as `at` took it."""
        full = self._full()
        parts: dict[str, Any] = {k: full[k] for k in ("model", "optimizer") if k in full}
        if at.groups is not None and isinstance(parts.get("optimizer"), dict):
            parts["optimizer"] = {**parts["optimizer"], "param_groups": at.groups}
        tensors, own_skeleton = flatten(parts)
        tensors.update(at.tensors)
        skeleton = {k: own_skeleton[k] if k in own_skeleton else at.skeleton[k] for k in at.keys}
        self.rebuilds += 1
        self._cache = _Cache.of(self._model, self._optimizer, parts, tensors, skeleton)
        return Flat(tensors, skeleton)


@dataclass(frozen=True)
class Boundary:
    """StateView.boundary(): the state's parts that the next step changes, flattened at the step boundary."""

    keys: list[str]
    """The state's keys, in order."""
    tensors: dict[str, torch.Tensor]
    skeleton: dict[str, Any]
    """The rest (all but "model" and "optimizer"), flattened."""
    groups: list[dict[str, Any]] | None
    """The optimizer's param_groups as its state_dict() has them (None without an optimizer), and flattened:"""
    group_tensors: dict[str, torch.Tensor]
    group_skeleton: Any


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
        self.plain_optimizer = False
        """Read directly (torch's state_dict, no state_dict hooks): the fields below index its parameters."""
        self.param_key: ParamKey = ((), ())
        self.group_indices: list[list[int]] = []
        self.object_params: list[torch.Tensor] = []
        self.object_keys: list[str] = []
        self.state_entries = 0
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
        if optimizer is not None and _plain_optimizer(optimizer):
            params = [p for g in optimizer.param_groups for p in g["params"]]
            groups = state["optimizer"].get("param_groups")
            indices = [list(g["params"]) for g in groups] if isinstance(groups, list) else []
            by_index = dict(zip([i for g in indices for i in g], params, strict=False))
            if len(by_index) == len(params) and all(i in by_index for i, _, _ in cache.optimizer_objects):
                cache.plain_optimizer = True
                cache.param_key = param_key(optimizer.param_groups)
                cache.group_indices = indices
                cache.object_params = [by_index[i] for i, _, _ in cache.optimizer_objects]
                cache.object_keys = [k for _, k, _ in cache.optimizer_objects]
                cache.state_entries = len(state["optimizer"]["state"])
        return cache

    def holds(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> bool:
        if _counts(self.modules) != self.counts:
            return False
        live = [store.get(attr) for store, attr, _ in self.model_objects]
        if not all(map(operator.is_, live, self.model_values)):
            return False
        if optimizer is None:
            return not self.optimizer_objects
        if self.plain_optimizer:
            return self._optimizer_holds(optimizer)
        state = optimizer.state_dict()["state"]
        if len(state) != self.optimizer_params or sum(map(len, state.values())) != len(self.optimizer_objects):
            return False
        try:
            live = [state[index][key] for index, key, _ in self.optimizer_objects]
        except KeyError:
            return False
        return all(map(operator.is_, live, self.optimizer_values))

    def _optimizer_holds(self, optimizer: torch.optim.Optimizer) -> bool:
        """holds() for a plain optimizer: its state read by parameter, without state_dict() (C loops)."""
        if not _plain_optimizer(optimizer):  # a state_dict hook registered since
            return False
        if param_key(optimizer.param_groups) != self.param_key:
            return False
        state = optimizer.state
        if len(state) != self.state_entries or sum(map(len, state.values())) != len(self.optimizer_objects):
            return False
        entries: list[dict[str, Any] | None] = list(map(state.get, self.object_params))  # [] would add one
        if not all(map(operator.is_not, entries, repeat(None))):
            return False
        live = list(map(_entry, entries, self.object_keys))
        return all(map(operator.is_, live, self.optimizer_values))


def _counts(modules: list[torch.nn.Module]) -> tuple[tuple[int, ...], ...]:
    # C loops (map): checked every snapshot, over every module.
    return tuple(tuple(map(len, map(get, modules))) for get in _STORES)


_STORES = (operator.attrgetter("_parameters"), operator.attrgetter("_buffers"), operator.attrgetter("_modules"))


_entry: Callable[[Any, str], Any] = dict.get


def param_key(groups: list[dict[str, Any]]) -> ParamKey:
    """The optimizer's parameters as its state_dict() indexes them: each group's size, then every id in order
    (C loops: taken every snapshot)."""
    params = [g["params"] for g in groups]
    return tuple(map(len, params)), tuple(map(id, chain.from_iterable(params)))


def _plain_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `state_dict()` is torch's own, with no hooks that could change what it returns."""
    return (type(optimizer).state_dict is torch.optim.Optimizer.state_dict
            and not getattr(optimizer, "_optimizer_state_dict_pre_hooks", None)
            and not getattr(optimizer, "_optimizer_state_dict_post_hooks", None))


def _plain(model: torch.nn.Module) -> bool:
    """Whether every module's state_dict() entries are its own parameters and persistent buffers, as they are."""
    base_save = torch.nn.Module._save_to_state_dict
    base_extra = torch.nn.Module.get_extra_state
    if isinstance(model, torch.jit.ScriptModule):
        return False  # its modules' parameters are C++ objects behind wrappers: always the full walk
    for module in model.modules():
        if type(module)._save_to_state_dict is not base_save or type(module).get_extra_state is not base_extra:
            return False
        if any(getattr(module, hooks, None) for hooks in _DYNAMIC_MODEL):
            return False
    return True
