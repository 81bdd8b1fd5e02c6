"""Unit tests of ckpt.tree: flatten/unflatten of nested training state."""

from __future__ import annotations

import collections
import json
import math
import struct
from typing import Any

import pytest
import torch

from ckpt.tree import flatten, unflatten

pytestmark = pytest.mark.timeout(30)


def raw_bytes(t: torch.Tensor) -> list[int]:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).tolist()


def assert_identical(a: Any, b: Any, path: str = "") -> None:
    """Equal values of identical types, floats compared by bits, tensors bitwise."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert raw_bytes(a) == raw_bytes(b), path
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b), f"{path}: {a!r} != {b!r}"
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), path
        for key in a:
            assert_identical(a[key], b[key], f"{path}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_identical(x, y, f"{path}/{i}")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def roundtrip(state: Any) -> Any:
    tensors, skeleton = flatten(state)
    # The skeleton must survive strict JSON, as it does in the manifest.
    skeleton = json.loads(json.dumps(skeleton, allow_nan=False))
    # Clone, as a load from disk would: optimizers keep loaded tensors without copying.
    return unflatten(skeleton, {name: t.clone() for name, t in tensors.items()})


def test_scalars_bytes_tuples_and_special_floats_roundtrip_exactly() -> None:
    nan_with_payload = struct.unpack("<d", struct.pack("<Q", 0x7FF8_0000_DEAD_BEEF))[0]
    state = {
        "int": 3,
        "float_integral": 3.0,
        "neg_zero": -0.0,
        "tiny": 5e-324,
        "third": 1 / 3,
        "big_int": 2**80,
        "inf": math.inf,
        "ninf": -math.inf,
        "nan": math.nan,
        "nan_payload": nan_with_payload,
        "true": True,
        "none": None,
        "text": "héllo \u2603",
        "raw": b"\x00\xff binary",
        "empty_bytes": b"",
        "tuple": (1, (2.5, "x"), []),
        "list": [1, [2, (3,)]],
        "empty": {},
    }
    assert_identical(roundtrip(state), state)


def test_dict_key_forms_roundtrip() -> None:
    state = {
        "ints": {0: "a", 1: "b"},
        "mixed": {None: 1, True: 2, 2.5: 3, "s": 4, -7: 5, math.inf: 6},
        "dunder": {"__tensor__": "not a tensor", "__x": 1},
        "marker_lookalike": {"__bytes__": "AAAA"},
    }
    out = roundtrip(state)
    assert_identical(out, state)
    assert out["marker_lookalike"] == {"__bytes__": "AAAA"}


def test_tensor_names_are_key_paths_and_tensors_are_not_copied() -> None:
    w = torch.ones(2, 2)
    state = {"model": {"fc.weight": w}, "optim": {"state": {0: {"exp_avg": torch.zeros(2)}}}}
    tensors, skeleton = flatten(state)
    assert set(tensors) == {"model/fc.weight", "optim/state/0/exp_avg"}
    assert tensors["model/fc.weight"] is w
    assert skeleton["model"] == {"fc.weight": {"__tensor__": "model/fc.weight"}}


def test_adam_state_dict_roundtrip_and_resume_is_identical() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.95))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    x = torch.randn(8, 4)
    model(x).sum().backward()
    opt.step()
    sched.step()
    state = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "sched": sched.state_dict(),
        "rng": torch.get_rng_state(),
    }
    out = roundtrip(state)

    assert_identical(out["optim"], opt.state_dict())
    assert_identical(out["sched"], sched.state_dict())
    assert isinstance(out["model"], dict)
    assert set(out["optim"]["state"]) == {0, 1, 2, 3}
    assert out["optim"]["param_groups"][0]["betas"] == (0.8, 0.95)

    model2 = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    opt2 = torch.optim.Adam(model2.parameters(), lr=0.01, betas=(0.8, 0.95))
    model2.load_state_dict(out["model"])
    opt2.load_state_dict(out["optim"])
    for m, o in ((model, opt), (model2, opt2)):
        o.zero_grad()
        m(x).sum().backward()
        o.step()
    for p1, p2 in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p1, p2)


def test_ordered_dict_comes_back_as_dict_in_order() -> None:
    state = collections.OrderedDict([("b", 1), ("a", torch.arange(3))])
    out = roundtrip(state)
    assert type(out) is dict
    assert list(out) == ["b", "a"]
    assert torch.equal(out["a"], torch.arange(3))


@pytest.mark.parametrize(
    "state",
    [
        {"a/b": torch.zeros(1), "a": {"b": torch.ones(1)}},
        {"s": {0: torch.zeros(1), "0": torch.ones(1)}},
    ],
)
def test_tensor_name_collision_raises_value_error(state: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="a/b|s/0"):
        flatten(state)


@pytest.mark.parametrize(
    ("state", "path"),
    [
        ({"a": [1, object()]}, "a/1"),
        ({"a": {"b": {1, 2}}}, "a/b"),
        ({"p": collections.namedtuple("P", "x")(1)}, "p"),
        ({"k": {(1, 2): 3}}, "k"),
        ({"ba": bytearray(b"x")}, "ba"),
    ],
)
def test_unsupported_leaf_raises_type_error_naming_path(state: dict[str, Any], path: str) -> None:
    with pytest.raises(TypeError, match=f"'{path}'"):
        flatten(state)


@pytest.mark.parametrize(
    "skeleton",
    [
        {"t": {"__tensor__": "missing"}},
        {"x": {"__nope__": 1}},
        {"x": {"__bytes__": "!!not base64!!"}},
        {"x": {"__dict__": [[1]]}},
        {"x": {"__float__": "zz"}},
        {"__a": 1, "b": 2},
    ],
)
def test_malformed_skeleton_raises_value_error(skeleton: Any) -> None:
    with pytest.raises(ValueError, match="skeleton"):
        unflatten(skeleton, {})
