"""Check a checkpoint's whole state tree against the live objects before anything is loaded.

Two kinds of problem, two errors:
- InvalidStateError: the tree is not what `Resumable` writes (a damaged or crafted checkpoint):
  `model` not a mapping of tensors, an RNG entry of the wrong type or size, optimizer state
  tensors that do not have the shape of their parameter, a malformed data position, scheduler
  or scaler state that is not a mapping, extras that are not a JSON-able dict. The caller treats
  it like a damaged file: an older checkpoint is used.
- StateMismatchError: the tree is well formed but does not fit this run (another model, optimizer
  class or parameter order, scheduler class, other data settings): a user error, reported as such.

Order matters: the tree's own structure is checked first, then its fit with this run, then the
optimizer's tensors against the parameters they belong to (that needs the fit: the same parameters).

A sharded model's tree (FSDP2 / TP: `get_state_dict`'s form) keys the optimizer state by parameter
name, not position, and is checked against this run's own tree (`template`): the same names in the
same groups (else StateMismatchError), state tensors of their parameter's global shape. The global
shape of each DTensor against the saved one is ckpt's check (ShardMismatchError, trainer/agree.py).
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard

import torch

from ckpt import CheckpointMismatchError, check_compatible
from ckpt.format import short_repr
from trainer import rng
from trainer.data import ElasticSampler
from trainer.errors import InvalidStateError, StateMismatchError

# Per-parameter optimizer state that torch.optim keeps with the parameter's shape (zeros_like(p)
# in Adam, AdamW, SGD, Adagrad, RMSprop, Adadelta, Adamax, ASGD, Rprop, NAdam, RAdam, Adafactor),
# and state that is one number. Other keys (LBFGS's history, Adafactor's factored variances) are
# checked for their type only.
_PARAM_SHAPED = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "sum", "square_avg",
                           "acc_delta", "grad_avg", "exp_inf", "ax", "prev", "step_size", "variance"})
_SCALAR = frozenset({"step", "eta", "mu", "mu_product"})
# What torch's Adam and AdamW read from a parameter's state once it has any (an entry missing one failed the first
# step after the restore with a KeyError, on every restart); amsgrad adds "max_exp_avg_sq".
_ADAM_STATE = ("step", "exp_avg", "exp_avg_sq")
_NEEDS_STATE: dict[type[torch.optim.Optimizer], tuple[str, ...]] = {
    torch.optim.Adam: _ADAM_STATE, torch.optim.AdamW: _ADAM_STATE}
# What a torch scheduler's get_lr raises on a state that cannot step (StepLR's step_size 0: ZeroDivisionError);
# not ValueError, which OneCycleLR raises past its last step (a finished run's last checkpoint is still good).
_CANNOT_STEP = (ZeroDivisionError, TypeError, KeyError, IndexError, AttributeError, OverflowError)


def param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str | None]]:
    """The model's name of each optimizer parameter, group by group (None: not a model parameter).

    Saved with the optimizer state: torch keys that state by position, so this is what tells a
    reordered optimizer (a mismatch) from state that does not fit its own parameters (damage)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names.get(id(p)) for p in g["params"]] for g in optimizer.param_groups]


def check_state(
    state: Mapping[str, Any],
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    sampler: ElasticSampler | None,
    template: Mapping[str, Any] | None = None,
    step: int | None = None,
    stateful: Mapping[str, Any] | None = None,
) -> None:
    """Raise InvalidStateError or StateMismatchError (see the module docstring); change nothing. `step`: the
    checkpoint's step, where the data position must be. `stateful`: the run's scheduler and scaler by name
    ("scheduler", "scaler"), whose saved states must hold what theirs do.

    `template` (a sharded model's): this run's own state tree, to check against instead of `model`
    and `optimizer` (its model and optimizer state are `get_state_dict`'s, keyed by parameter name;
    a DTensor's shape is its global shape, which ckpt has checked against the saved one)."""
    _check_structure(state, by_name=template is not None)
    model_state = template["model"] if template is not None else model.state_dict()
    try:
        check_compatible(state["model"], model_state)
    except CheckpointMismatchError as exc:
        raise StateMismatchError(str(exc)) from exc
    if sampler is not None:
        if state.get("data") is None:
            raise StateMismatchError("the checkpoint has no data position but this run has a sampler; "
                                     "resume without one, or start from a fresh --ckpt-dir")
        sampler.check_state(state["data"], step)
    for name, obj in (stateful or {}).items():
        if obj is not None and state.get(name):
            _check_stateful(name, obj, state[name])
    if optimizer is not None and template is not None:
        saved = _check_optimizer_fits(optimizer, state.get("optimizer"))
        _check_param_names(template["optimizer"]["param_groups"], saved["param_groups"])
        _check_named_optimizer_tensors(model_state, saved)
    elif optimizer is not None:
        saved = _check_optimizer_fits(optimizer, state.get("optimizer"))
        saved_names = state.get("param_names")
        if saved_names is not None:
            _check_param_order(param_names(model, optimizer), saved_names)
        _check_optimizer_tensors(optimizer, saved)
    if optimizer is not None:
        _check_optimizer_class(optimizer, state.get("optimizer_class"))  # after the fit, which names keys that differ
        _check_optimizer_values(optimizer, state["optimizer"])


def optimizer_class(optimizer: torch.optim.Optimizer) -> str:
    """The name a checkpoint records its optimizer's class by (no module: torch moves its classes between files)."""
    return type(optimizer).__qualname__


def _check_optimizer_class(optimizer: torch.optim.Optimizer, saved: str | None) -> None:
    """The optimizer is of the class the checkpoint was written with (recorded since session 50: older checkpoints
    pass). Adam and AdamW keep the same group keys in this torch, so the swap loaded without a word, and the saved
    groups' hyperparameters replaced the new optimizer's (an AdamW's weight_decay 0.01 into an Adam)."""
    live = optimizer_class(optimizer)
    if saved is not None and saved != live:
        raise StateMismatchError(f"the checkpoint's optimizer is {saved} and this run's is {live}: resume with "
                                 f"{saved}, or start from a fresh --ckpt-dir")


def _check_stateful(name: str, obj: Any, saved: Mapping[str, Any]) -> None:
    """A scheduler's or scaler's saved state holds the kinds of value its state_dict() does, names none of its
    objects (a key 'optimizer' replaced the scheduler's optimizer), and loads into a copy of it: load_state_dict
    takes almost anything, and the next step failed on it after the model and optimizer were loaded, on every
    restart. Other differences of keys pass (another torch version's, another scheduler class's): as before."""
    live = obj.state_dict()
    if not live:  # a disabled GradScaler (saved enabled): loading is a no-op
        return
    objects = sorted(k for k in saved if k not in live and not _plain(getattr(obj, k, None)))
    if objects:
        raise InvalidStateError(f"{name!r} has entries {objects[:5]} that would replace its {objects[0]} object")
    _check_like(live, saved, name, counts=type(obj).__module__.startswith("torch."))
    if name == "scaler" and isinstance(saved.get("scale"), (int, float)) and not 0 < saved["scale"] < math.inf:
        raise InvalidStateError(f"'scaler' scale is {saved['scale']!r}: a GradScaler's scale is positive and finite")
    try:  # a deep copy, of its optimizer too but for the parameters: a shallow one loaded into the live nested
        # schedulers and lambdas, and a trial get_lr (OneCycleLR's, CyclicLR's) sets its optimizer's momentum
        optimizer = getattr(obj, "optimizer", None)
        trial = copy.deepcopy(obj, {} if optimizer is None else {id(optimizer): _GroupsOnly(optimizer)})
    except Exception:  # noqa: BLE001 - cannot copy it now (a GradScaler mid-step): not judged by a load
        return
    try:
        trial.load_state_dict(copy.deepcopy(dict(saved)))
    except Exception as exc:  # noqa: BLE001 - whatever it raises, the saved state does not load
        if set(saved) != set(live):  # another class's entries (StepLR's into a LambdaLR): the run's code changed
            raise StateMismatchError(
                f"the checkpoint's {name!r} state does not load into this {type(obj).__name__} ({exc!r}); its "
                f"entries {sorted(saved)[:8]} are another {name}'s: resume with the {name} it was written with, "
                "or start from a fresh --ckpt-dir") from exc
        raise InvalidStateError(f"{name!r} state does not load into this {type(obj).__name__}: {exc!r}") from exc
    _check_next_lr(name, trial)


class _GroupsOnly:
    """A copy of an optimizer's param_groups without their parameters: what a trial scheduler reads and sets."""

    def __init__(self, optimizer: Any) -> None:
        self.defaults = copy.deepcopy(getattr(optimizer, "defaults", {}))
        self.param_groups: list[dict[str, Any]] = [{k: _copied(v) for k, v in g.items() if k != "params"} | {
            "params": []} for g in optimizer.param_groups]


def _copied(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def _check_next_lr(name: str, trial: Any) -> None:
    """A torch scheduler that computes its own rates (get_lr) can compute the next step's from the loaded state
    (`trial`, a copy over a copy of its optimizer's groups). StepLR(step_size=0) loaded and failed the first step."""
    kind = type(trial)
    if not (isinstance(trial, torch.optim.lr_scheduler.LRScheduler) and kind.__module__.startswith("torch.")
            and "get_lr" in vars(kind) and type(getattr(trial, "last_epoch", None)) is int
            and not hasattr(trial, "lr_lambdas") and getattr(trial, "_scale_fn_custom", None) is None):
        return  # a user's function (LambdaLR's, CyclicLR's scale_fn) may end with the schedule (a table)
    trial.last_epoch += 1  # what step() does before it asks get_lr
    trial._get_lr_called_within_step = True  # (torch warns when get_lr is called outside step)
    try:
        trial.get_lr()
    except _CANNOT_STEP as exc:
        raise InvalidStateError(f"{name!r} state loads into this {kind.__name__}, but its next step fails: "
                                f"{exc!r}") from exc
    except Exception:  # noqa: BLE001 - a schedule that has ended (OneCycleLR's ValueError): judged by the loop
        pass


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str, list, tuple, dict, torch.Tensor))


_COUNTS = frozenset({"_step_count", "growth_interval", "_growth_tracker"})
"""Entries of torch's schedulers and scaler that are whole numbers (a float one shifted the schedule)."""
_PER_GROUP = frozenset({"base_lrs", "_last_lr", "lr_lambdas", "max_lrs", "min_lrs", "initial_lrs", "betas"})
"""Sequences of a fixed length: one entry per parameter group (torch's schedulers), Adam's two betas."""


def _check_like(live: Any, saved: Any, where: str, *, counts: bool = True) -> None:
    """`saved` holds the kinds of value `live` (the object's own state_dict now) does where both have a value:
    numbers where it has numbers (ints for torch's counts in _COUNTS), strings, tensors, sequences (of its length
    for the per-group ones), mappings. Keys only one side has pass; a value may grow (a user's history)."""
    if live is None or callable(live):
        return
    problem = None
    if saved is None:
        problem = f"a {type(live).__name__}"  # an lr of None failed at the first step
    elif isinstance(live, bool) or isinstance(saved, bool):
        problem = None if type(live) is type(saved) else "a bool"
    elif isinstance(live, (int, float)):
        count = counts and where.rsplit(".", 1)[-1] in _COUNTS
        ok = type(saved) is int if count else isinstance(saved, (int, float)) or _scalar_tensor(saved)
        problem = None if ok else ("an int" if count else "a number")
    elif isinstance(live, str):
        problem = None if isinstance(saved, str) else "a string"
    elif isinstance(live, torch.Tensor):
        # A one-number tensor and a number are one kind: an lr given as a tensor (for capturable or fused steps)
        # in one run and as a float in the other, both of which torch steps with.
        ok = isinstance(saved, torch.Tensor) or (live.numel() == 1 and isinstance(saved, (int, float)))
        problem = None if ok else "a tensor"
    elif _is_list(live):
        per_group = where.rsplit(".", 1)[-1] in _PER_GROUP
        if not _is_list(saved) or (per_group and len(saved) != len(live)):
            problem = f"a sequence of {len(live)}" if per_group else "a sequence"
        elif per_group or len(saved) == len(live):
            for i, (a, b) in enumerate(zip(live, saved, strict=True)):
                _check_like(a, b, f"{where}[{i}]", counts=counts)
    elif isinstance(live, Mapping):
        if not isinstance(saved, Mapping):
            problem = "a mapping"
        else:
            for key in set(saved) & set(live):
                _check_like(live[key], saved[key], f"{where}.{key}", counts=counts)
    if problem is not None:
        raise InvalidStateError(f"{where!r} is {short_repr(saved)}, not {problem} as this run's")


def _scalar_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.numel() == 1 and (value.is_floating_point() or value.is_complex())


_IMPLEMENTATION_FLAGS = frozenset({"foreach", "fused"})
"""Optimizer options that choose how torch steps, not what (None: torch's choice): None, True and False are all
values of theirs. Turning one on between two runs is no damage (it had made every checkpoint 'malformed')."""

_VERSION_FLAGS = frozenset({"foreach", "maximize", "capturable", "differentiable", "fused", "amsgrad",
                            "decoupled_weight_decay"})
"""Optimizer options torch versions added (an older checkpoint lacks them; the optimizer's __setstate__ fills
them in). Any other option of the live group must be in the saved one: torch's load takes the saved group whole."""


def _check_optimizer_values(optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]) -> None:
    """The saved groups' hyperparameters are of the live ones' kinds (and lr >= 0); per-parameter state is tensors
    where torch keeps tensors, of a floating dtype, and a step that is a number >= 0. torch's load_state_dict takes
    the groups whole: a missing 'betas' or an lr that is a string failed at the first step, a negative lr was used."""
    for i, (group, saved_group) in enumerate(zip(optimizer.param_groups, saved["param_groups"], strict=False)):
        where = f"optimizer param_groups[{i}]"
        missing = sorted(k for k in set(group) - set(saved_group) - _VERSION_FLAGS if k in optimizer.defaults)
        if missing:
            raise InvalidStateError(f"'{where}' lacks {missing}, which this {type(optimizer).__name__} steps with")
        for key in set(group) & set(saved_group) - {"params", "param_names"}:
            if key in _IMPLEMENTATION_FLAGS and all(v is None or isinstance(v, bool)
                                                    for v in (group[key], saved_group[key])):
                continue
            _check_like(group[key], saved_group[key], f"{where}.{key}")
        lr = saved_group.get("lr")
        if isinstance(lr, (int, float)) and not isinstance(lr, bool) and not 0 <= lr < math.inf:
            raise InvalidStateError(f"'{where}' lr is {lr!r}: a learning rate is >= 0 and finite")
    needs = _NEEDS_STATE.get(type(optimizer), ())
    amsgrad = {pid for g in saved["param_groups"] if g.get("amsgrad") is True for pid in g.get("params", ())}
    for pid, entry in saved["state"].items():
        lacks = [k for k in (*needs, *(("max_exp_avg_sq",) if needs and pid in amsgrad else ())) if k not in entry]
        if entry and lacks:  # an empty entry is begun afresh by the first step
            raise InvalidStateError(f"'optimizer' state of parameter {pid!r} lacks {lacks}, which this "
                                    f"{type(optimizer).__name__} steps with")
        for key, value in entry.items():
            where = f"'optimizer' state {key!r} of parameter {pid!r}"
            if key in _PARAM_SHAPED and value is not None and not (isinstance(value, torch.Tensor) and (
                    value.is_floating_point() or value.is_complex())):  # None: an SGD-like buffer not made yet
                got = f"a {value.dtype} tensor" if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"
                raise InvalidStateError(f"{where} is {got}, not a floating-point tensor")
            if key == "step":
                number = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
                if isinstance(number, bool) or not isinstance(number, (int, float)) or not 0 <= number < math.inf:
                    raise InvalidStateError(f"{where} is {short_repr(value)}, not a count >= 0")


def _check_structure(state: Mapping[str, Any], *, by_name: bool = False) -> None:
    for key in ("model", "rng"):
        if key not in state:
            raise InvalidStateError(f"the state has no {key!r} entry")
    model = state["model"]
    if not isinstance(model, Mapping):
        raise InvalidStateError(f"'model' is a {type(model).__name__}, not a mapping of tensors")
    for key, value in model.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise InvalidStateError(f"'model' entry {key!r} is a {type(value).__name__}, not a tensor")
    rng.check(state["rng"])
    world = state.get("world_size")
    if world is not None and (type(world) is not int or world < 1):
        raise InvalidStateError(f"'world_size' is {world!r}, not a positive int")
    data = state.get("data")
    if data is not None:
        if not isinstance(data, Mapping):
            raise InvalidStateError(f"'data' is a {type(data).__name__}, not a data position mapping")
        for key in ("seed", "dataset_size", "global_batch", "epoch", "position"):
            if type(data.get(key)) is not int:
                raise InvalidStateError(f"'data' entry {key!r} is {data.get(key)!r}, not an int")
        if data["epoch"] < 0 or data["position"] < 0:
            raise InvalidStateError(f"'data' holds epoch {data['epoch']}, position {data['position']}: "
                                    "both must be >= 0")
    layout = state.get("layout")
    if layout is not None and not (_is_str_mapping(layout) and set(layout) == {"dp", "tp"} and all(
            type(layout[k]) is int and layout[k] >= 1 for k in ("dp", "tp"))):
        raise InvalidStateError(f"'layout' is {layout!r}, not a mapping of positive ints 'dp' and 'tp' (only)")
    optimizer = state.get("optimizer")
    if optimizer is not None:
        _check_optimizer_structure(optimizer, by_name=by_name)
    kind = state.get("optimizer_class")
    if kind is not None and not isinstance(kind, str):
        raise InvalidStateError(f"'optimizer_class' is {short_repr(kind)}, not a class name")
    names = state.get("param_names")
    if names is not None and not (_is_list(names) and all(
            _is_list(g) and all(n is None or isinstance(n, str) for n in g) for g in names)):
        raise InvalidStateError("'param_names' is not a list of lists of parameter names")
    for key in ("scheduler", "scaler"):
        value = state.get(key)
        if value is not None and not _is_str_mapping(value):
            raise InvalidStateError(f"{key!r} is a {type(value).__name__}, not a mapping with str keys")
    extras = state.get("extras")
    if extras is not None:
        if not _is_str_mapping(extras):
            raise InvalidStateError(f"'extras' is a {type(extras).__name__}, not a dict with str keys")
        try:
            json.dumps(extras)
        except (TypeError, ValueError) as exc:
            raise InvalidStateError(f"'extras' is not JSON-able: {exc}") from exc


def _check_optimizer_structure(saved: Any, *, by_name: bool = False) -> None:
    # by_name: get_state_dict's form, which keys parameters by name (str) instead of by position (int).
    if not isinstance(saved, Mapping) or not isinstance(saved.get("state"), Mapping) \
            or not _is_list(saved.get("param_groups")):
        raise InvalidStateError("'optimizer' is not an optimizer state_dict (a mapping with 'state' and "
                                "'param_groups')")
    key_type, what = (str, "names") if by_name else (int, "ids")
    other = int if by_name else str
    groups = [g.get("params") if _is_str_mapping(g) else None for g in saved["param_groups"]]
    if groups and all(_is_list(p) and p and all(type(k) is other for k in p) for p in groups) \
            and all(type(k) is other for k in saved["state"]):
        # Whole and well formed, but the other run kind's: not damage, so no older step is tried in its place.
        raise StateMismatchError(
            "the checkpoint was saved by a run whose model was not sharded (DDP or one process; its optimizer state "
            "is by parameter position), and this run's model is sharded (FSDP or DTensor): resume it with the plain "
            "model, or start this run from a fresh --ckpt-dir" if by_name else
            "the checkpoint was saved by a sharded run (its optimizer state is by parameter name), and it is read as "
            "a plain one: restore it through Resumable, which takes it into a plain model")
    seen: set[int | str] = set()
    for i, group in enumerate(saved["param_groups"]):
        params = group.get("params") if _is_str_mapping(group) else None
        if not _is_list(params) or not all(type(p) is key_type for p in params):
            raise InvalidStateError(f"'optimizer' param_groups[{i}] has no list of parameter {what}")
        if seen & set(params) or len(set(params)) != len(params):
            raise InvalidStateError(f"'optimizer' param_groups[{i}] repeats a parameter id")
        seen |= set(params)
    for pid, entry in saved["state"].items():
        if pid not in seen:
            raise InvalidStateError(f"'optimizer' state has an entry for parameter {pid!r}, which no group holds")
        if not _is_str_mapping(entry):
            raise InvalidStateError(f"'optimizer' state of parameter {pid} is a {type(entry).__name__}, "
                                    "not a mapping")


def _check_optimizer_fits(optimizer: torch.optim.Optimizer, saved: Any) -> Mapping[str, Any]:
    """`saved`, once it is known to fit `optimizer` (its structure was checked before)."""
    if saved is None:
        raise StateMismatchError("the checkpoint has no optimizer state but this run has an optimizer; "
                                 "start from a fresh --ckpt-dir")
    groups, saved_groups = optimizer.param_groups, saved["param_groups"]
    problems = []
    if len(groups) != len(saved_groups):
        problems.append(f"{len(saved_groups)} parameter group(s) in the checkpoint, {len(groups)} now")
    for i, (g, sg) in enumerate(zip(groups, saved_groups, strict=False)):
        if len(g["params"]) != len(sg["params"]):
            problems.append(f"group {i} has {len(sg['params'])} parameters in the checkpoint, {len(g['params'])} now")
        keys, saved_keys = set(g) - {"params"}, set(sg) - {"params"}
        # One-sided differences are how torch versions add options; both sides differing is another class.
        if keys - saved_keys and saved_keys - keys:
            problems.append(f"group {i} hyperparameters differ (another optimizer class?): only in the checkpoint "
                            f"{sorted(saved_keys - keys)}, only now {sorted(keys - saved_keys)}")
    if problems:
        raise StateMismatchError(f"the checkpoint's optimizer state does not fit this {type(optimizer).__name__}: "
                                 + "; ".join(problems)
                                 + ". Resume with the same optimizer, or start from a fresh --ckpt-dir.")
    return saved


def _check_param_order(names: list[list[str | None]], saved: Sequence[Sequence[str | None]]) -> None:
    for i, (group, saved_group) in enumerate(zip(names, saved, strict=False)):
        for j, (now, then) in enumerate(zip(group, saved_group, strict=False)):
            if now is not None and then is not None and now != then:
                raise StateMismatchError(
                    f"the optimizer's parameter order differs: group {i} position {j} is {then!r} in the "
                    f"checkpoint, {now!r} now. Build the optimizer's parameter groups in the same order, or "
                    "start from a fresh --ckpt-dir")


def _check_param_names(groups: Sequence[Mapping[str, Any]], saved: Sequence[Mapping[str, Any]]) -> None:
    for i, (group, saved_group) in enumerate(zip(groups, saved, strict=False)):
        if list(group["params"]) != list(saved_group["params"]):
            now, then = set(group["params"]), set(saved_group["params"])
            detail = (f"only in the checkpoint {sorted(then - now)[:5]}, only now {sorted(now - then)[:5]}"
                      if now != then else "the same names in another order")
            raise StateMismatchError(f"the optimizer's parameter group {i} holds other parameters than the "
                                     f"checkpoint's: {detail}. Build the optimizer's parameter groups as the saved "
                                     "run did, or start from a fresh --ckpt-dir")


def _check_named_optimizer_tensors(model_state: Mapping[str, Any], saved: Mapping[str, Any]) -> None:
    # Keyed by parameter name: state of the shape of its parameter (global shapes for DTensors).
    for name, entry in saved["state"].items():
        param = model_state.get(name)
        for key, value in entry.items():
            if not isinstance(value, torch.Tensor):
                continue
            where = f"'optimizer' state {key!r} of parameter {name!r}"
            if key in _PARAM_SHAPED and isinstance(param, torch.Tensor) and value.shape != param.shape:
                raise InvalidStateError(f"{where} has shape {tuple(value.shape)}; its parameter has "
                                        f"{tuple(param.shape)}")
            if key in _SCALAR and value.numel() != 1:
                raise InvalidStateError(f"{where} has shape {tuple(value.shape)}, not one number")


def _check_optimizer_tensors(optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]) -> None:
    # Groups and parameter counts fit (checked before), so position j of a saved group is the live
    # group's parameter j: its state must have that parameter's shape, or torch fails at step().
    for i, (group, saved_group) in enumerate(zip(optimizer.param_groups, saved["param_groups"], strict=True)):
        for j, (param, pid) in enumerate(zip(group["params"], saved_group["params"], strict=True)):
            for key, value in saved["state"].get(pid, {}).items():
                if not isinstance(value, torch.Tensor):
                    continue
                where = f"'optimizer' state {key!r} of group {i} parameter {j} (id {pid})"
                if key in _PARAM_SHAPED and value.shape != param.shape:
                    raise InvalidStateError(f"{where} has shape {tuple(value.shape)}; its parameter has "
                                            f"{tuple(param.shape)}")
                if key in _SCALAR and value.numel() != 1:
                    raise InvalidStateError(f"{where} has shape {tuple(value.shape)}, not one number")


def _is_list(value: Any) -> TypeGuard[list[Any] | tuple[Any, ...]]:
    return isinstance(value, (list, tuple))


def _is_str_mapping(value: Any) -> bool:
    return isinstance(value, Mapping) and all(isinstance(k, str) for k in value)
