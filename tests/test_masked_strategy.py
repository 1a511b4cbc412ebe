"""The CUDA strategy of the tie passes (every row under a mask, no host synchronisation) run on
CPU tensors: the cases of test_topk.py and test_exact.py again with pefa_gpu.topk.MASKED set,
against the same float64 references."""

from __future__ import annotations

import pytest

from pefa_gpu import topk
from test_exact import *  # noqa: F401,F403  (their cases, collected again here)
from test_topk import *  # noqa: F401,F403


pytestmark = pytest.mark.slow  # ~1 min on 2 cores: test_exact's cases once more


@pytest.fixture(autouse=True)
def masked_strategy(monkeypatch):
    monkeypatch.setattr(topk, "MASKED", True)
