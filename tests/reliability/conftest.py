"""Fixtures shared by the reliability tests."""
from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture
def fake_pair_of_ranks():
    """A default process group of 2 ranks on torch's fake backend (this process is rank 0): collectives return at
    once, so a test can drive the code that arms the guards around them without a second process."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()
