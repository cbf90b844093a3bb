"""oneDNN linears: same results as nn.Linear up to rounding, applied once, fp32 only."""

from __future__ import annotations

import pytest
import torch

from specpair_runtime.engine.cpu_kernels import (
    onednn_available,
    restore_default_linears,
    use_onednn_linears,
)

pytestmark = pytest.mark.skipif(not onednn_available(), reason="torch build without oneDNN")


def test_linears_are_switched_and_agree_with_the_default_kernel() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8, bias=False)
    )
    half = torch.nn.Linear(4, 4).to(torch.bfloat16)
    x = torch.randn(2, 5, 16)
    with torch.inference_mode():
        expected = model(x)
        assert use_onednn_linears(model) == 2
        assert use_onednn_linears(model) == 0  # already switched
        assert use_onednn_linears(half) == 0  # fp32 only
        got = model(x)
        single = model(x[:, :1])  # one token, the target-only shape
    assert torch.allclose(got, expected, atol=1e-5)
    assert torch.allclose(single, expected[:, :1], atol=1e-5)


def test_restoring_the_default_kernels_undoes_the_switch() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    assert use_onednn_linears(model) == 2
    assert restore_default_linears(model) == 2
    assert all("forward" not in vars(m) for m in model.modules())
    assert restore_default_linears(model) == 0
    assert use_onednn_linears(model) == 2  # and it can be switched again
