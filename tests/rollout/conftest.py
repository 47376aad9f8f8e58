import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """The tiny models' ops are microseconds long: on a shared 2-core machine, OpenMP threads of such ops
    spin-wait on each other (30x slower steps were measured). One intra-op thread, restored after each test."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)
