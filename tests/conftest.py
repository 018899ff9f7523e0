import os

import pytest
import torch

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
