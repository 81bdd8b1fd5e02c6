"""The sharded-state rules of trainer without processes: the mesh layout (data-parallel coordinate),
the sampler and sample log per data-parallel rank, the RNG streams derived per data-parallel rank,
the whole-tree check of a by-name (get_state_dict) optimizer state, and ckpt's ShardMismatchError
turned into StateMismatchError."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from ckpt import ShardMismatchError
from trainer import DataConfig, ElasticSampler, StateMismatchError, rng
from trainer.agree import agree_on_checkpoint
from trainer.errors import InvalidStateError
from trainer.samples import SAMPLE_LOG_ENV
from trainer.setup import checked_sampler
from trainer.sharding import Layout
from trainer.topology import Topology
from trainer.validate import check_state


def mesh(shape: tuple[int, ...], coordinate: tuple[int, ...], names: tuple[str, ...] | None) -> Any:
    """What Layout.of reads of a DeviceMesh."""
    return SimpleNamespace(mesh_dim_names=names, shape=shape, ndim=len(shape), get_coordinate=lambda: list(coordinate))


@pytest.mark.parametrize("shape,coordinate,names,expected", [
    ((4,), (3,), None, Layout(dp_rank=3, dp=4, tp=1, tp_rank=0)),  # 1-D FSDP
    ((2, 2), (1, 0), ("dp", "tp"), Layout(dp_rank=1, dp=2, tp=2, tp_rank=0)),
    ((2, 2), (0, 1), ("dp", "tp"), Layout(dp_rank=0, dp=2, tp=2, tp_rank=1)),
    ((2,), (1,), ("tp",), Layout(dp_rank=0, dp=1, tp=2, tp_rank=1)),  # tensor parallel alone
    ((2, 3, 2), (1, 2, 1), ("dp_replicate", "dp_shard", "tp"), Layout(dp_rank=5, dp=6, tp=2, tp_rank=1)),  # HSDP + TP
])
def test_the_layout_is_the_coordinate_on_the_data_parallel_dims(
    shape: tuple[int, ...], coordinate: tuple[int, ...], names: tuple[str, ...] | None, expected: Layout
) -> None:
    layout = Layout.of(mesh(shape, coordinate, names))
    assert layout == expected
    assert layout.record() == {"dp": expected.dp, "tp": expected.tp}


def test_a_2d_mesh_without_dim_names_is_refused() -> None:
    with pytest.raises(ValueError, match="mesh_dim_names=\\('dp', 'tp'\\)"):
        Layout.of(mesh((2, 2), (0, 0), None))


def test_the_ranks_of_one_tp_group_read_the_same_samples_and_one_logs_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SAMPLE_LOG_ENV, str(tmp_path))
    config = DataConfig(dataset_size=40, global_batch=8)
    # Mesh (dp=2, tp=2): ranks 2 and 3 are data-parallel rank 1.
    peers = [ElasticSampler(config, mesh=mesh((2, 2), (1, t), ("dp", "tp"))) for t in (0, 1)]
    assert [(s.rank, s.world_size) for s in peers] == [(1, 2), (1, 2)]
    assert peers[0].indices() == peers[1].indices() == ElasticSampler(config, rank=1, world_size=2).indices()
    assert peers[0].sample_log is not None and peers[1].sample_log is None
    # Resumable takes a sampler for this rank's data-parallel coordinate, and none other.
    layout = Layout.of(mesh((2, 2), (1, 1), ("dp", "tp")))
    topology = Topology(rank=3, world_size=4, local_rank=3)
    assert checked_sampler(peers[1], topology, layout) is peers[1]
    with pytest.raises(ValueError, match="data-parallel rank 1 of 2 .* ElasticSampler\\(config, mesh=mesh\\)"):
        checked_sampler(ElasticSampler(config, rank=3, world_size=4), topology, layout)


def draws() -> list[float]:
    return torch.rand(4).tolist()


def test_rng_streams_are_derived_per_data_parallel_rank() -> None:
    shared = rng.fingerprint(rng.capture())
    streams = {}
    for index in (0, 1, 0):
        rng.derive_from(shared, index)
        streams.setdefault(index, []).append(draws())
    assert streams[0][0] == streams[0][1]  # the TP peers of one data-parallel rank draw alike
    assert streams[0][0] != streams[1][0]  # other data-parallel ranks draw differently


def by_name_state() -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return model, optimizer, {"model": model_sd, "optimizer": optim_sd, "rng": rng.capture(),
                              "layout": {"dp": 2, "tp": 2}}


def test_a_by_name_optimizer_state_is_checked_whole() -> None:
    model, optimizer, template = by_name_state()
    check_state(template, model=model, optimizer=optimizer, sampler=None, template=template)

    damaged = copy.deepcopy(template)
    damaged["optimizer"]["state"]["1.weight"]["exp_avg"] = torch.zeros(3)
    with pytest.raises(InvalidStateError, match="'exp_avg' of parameter '1.weight' has shape \\(3,\\); its "
                                                "parameter has \\(2, 3\\)"):
        check_state(damaged, model=model, optimizer=optimizer, sampler=None, template=template)

    by_position = copy.deepcopy(template)
    by_position["optimizer"]["param_groups"][0]["params"] = [0, 1, 2, 3]
    with pytest.raises(InvalidStateError, match="param_groups\\[0\\] has no list of parameter names"):
        check_state(by_position, model=model, optimizer=optimizer, sampler=None, template=template)

    # A plain run's (DDP) checkpoint, whole: not damage but another kind of run, so no older step is tried.
    plain = copy.deepcopy(template)
    names = [n for g in plain["optimizer"]["param_groups"] for n in g["params"]]
    plain["optimizer"] = {"state": {names.index(n): v for n, v in plain["optimizer"]["state"].items()},
                          "param_groups": [{**g, "params": [names.index(n) for n in g["params"]]}
                                           for g in plain["optimizer"]["param_groups"]]}
    with pytest.raises(StateMismatchError, match="saved by a run whose model was not sharded .* resume it with the "
                                                 "plain model, or start this run from a fresh --ckpt-dir"):
        check_state(plain, model=model, optimizer=optimizer, sampler=None, template=template)

    reordered = copy.deepcopy(template)
    reordered["optimizer"]["param_groups"][0]["params"].reverse()
    with pytest.raises(StateMismatchError, match="group 0 holds other parameters .* another order"):
        check_state(reordered, model=model, optimizer=optimizer, sampler=None, template=template)

    bad_layout = {**template, "layout": {"dp": 0, "tp": 1}}
    with pytest.raises(InvalidStateError, match="'layout'"):
        check_state(bad_layout, model=model, optimizer=optimizer, sampler=None, template=template)


class ShardMismatchCheckpointer:
    """A checkpointer whose newest step holds a sharded tensor of another global shape."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def restore(self, **kwargs: Any) -> None:
        self.calls.append(kwargs)
        raise ShardMismatchError("'model/tok.weight': saved global shape (64, 32), the state restored into has "
                                 "(64, 64)")


def test_a_sharded_tensor_of_another_global_shape_stops_the_restore_with_a_clear_error() -> None:
    checkpointer = ShardMismatchCheckpointer()
    template = {"model": {}}
    expected = "the newest checkpoint in /ckpt does not fit this run's model: 'model/tok.weight': saved global shape"
    with pytest.raises(StateMismatchError, match=expected + " \\(64, 32\\).* fresh --ckpt-dir"):
        agree_on_checkpoint(checkpointer, Topology(rank=0, world_size=1, local_rank=0),  # type: ignore[arg-type]
                            check=lambda r: None, where="/ckpt", into=template)
    # not retried on older steps
    assert checkpointer.calls == [{"step": None, "max_step": None, "into": template, "detach": False,
                                   "if_unsure": "none"}]
