"""`trainer.wrap_ddp`: a DDP that never rebuilds its gradient buckets (bitwise resume at >= 3 ranks;
the 4-rank kill-and-resume test in tests/integration/test_kill_resume.py checks the outcome)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trainer import wrap_ddp
from trainer.ddp import layout_is_stable

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_wrap_ddp_keeps_one_layout_and_plain_ddp_does_not(group: None) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    assert layout_is_stable(wrap_ddp(model))
    assert not layout_is_stable(DistributedDataParallel(model))
    assert layout_is_stable(model)  # not DDP: nothing to rebuild


@pytest.mark.parametrize("kwargs,flag", [({"static_graph": True}, "static_graph"),
                                         ({"find_unused_parameters": False}, "find_unused_parameters")])
def test_wrap_ddp_refuses_settings_that_rebuild_buckets(kwargs: dict[str, bool], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        wrap_ddp(torch.nn.Linear(2, 2), **kwargs)
