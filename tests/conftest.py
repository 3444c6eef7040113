import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models are overhead-bound: one intra-op thread is much faster on a busy 2-core box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
