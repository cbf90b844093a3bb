"""Prepacked oneDNN linears: nn.Linear results up to rounding, batch-invariant, fp32 only."""

from __future__ import annotations

import pytest
import torch

from specpair_runtime.engine.cpu import onednn as cpu_kernels
from specpair_runtime.engine.cpu.onednn import (
    default_kernel_copy,
    onednn_available,
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
        single = model(x[:1, :1])  # one token, the target-only shape
    assert got.shape == expected.shape and single.shape == (1, 1, 8)
    assert torch.allclose(got, expected, atol=1e-5)
    assert torch.allclose(single, expected[:1, :1], atol=1e-5)


@pytest.mark.parametrize(("inputs", "outputs"), [(1536, 8960), (8960, 1536), (64, 400)])
def test_a_row_gets_the_same_bits_whatever_the_number_of_rows(inputs: int, outputs: int) -> None:
    # Greedy identity on the CPU rests on this: a 1-token target-only step and a
    # (k+1)-token verify must compute the shared row alike. These shapes are the
    # real target's MLP (where oneDNN's one-row path rounds differently) and a tiny one.
    torch.manual_seed(0)
    layer = torch.nn.Linear(inputs, outputs)
    use_onednn_linears(layer)
    x = torch.randn(9, inputs)
    with torch.inference_mode():
        alone = torch.cat([layer(x[i : i + 1]) for i in range(9)])
        for rows in (2, 3, 4, 5, 9):
            together = layer(x[:rows])
            assert torch.equal(together, alone[:rows]), f"{rows} rows differ from one row each"


def test_untied_plain_weights_are_released_and_tied_ones_kept() -> None:
    embedding = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = embedding.weight  # tied, as many LMs do
    body = torch.nn.Linear(4, 4)
    model = torch.nn.ModuleDict({"embed": embedding, "body": body, "head": head})
    x = torch.randn(3, 4)
    with torch.inference_mode():
        expected = head(body(x))
        assert use_onednn_linears(model) == 2
        got = head(body(x))
    assert body.weight.numel() == 0  # released: the packed copy replaces it
    assert head.weight is embedding.weight and head.weight.shape == (10, 4)
    assert torch.allclose(got, expected, atol=1e-5)
    with pytest.raises(ValueError, match="keep_plain=True"):
        default_kernel_copy(model)


def test_a_default_kernel_copy_shares_the_weights_of_a_switch_that_kept_them() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    assert use_onednn_linears(model, keep_plain=True) == 2
    twin = default_kernel_copy(model)
    assert all("forward" not in vars(m) for m in twin.modules())
    assert all("forward" in vars(m) for m in model.modules() if isinstance(m, torch.nn.Linear))
    shared = {p.data_ptr() for p in model.parameters()}
    assert {p.data_ptr() for p in twin.parameters()} == shared  # no weight copied
    x = torch.randn(3, 8)
    with torch.inference_mode():
        assert torch.allclose(twin(x), model(x), atol=1e-5)
    assert use_onednn_linears(twin, keep_plain=True) == 2  # and it can be switched again


def test_a_call_with_few_rows_runs_as_min_gemm_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    # Fewer rows are padded (one row alone rounds differently; 2-3 rows ran
    # slower than 4 on AMD EPYC), and the padding never reaches the result.
    seen: list[int] = []
    real = cpu_kernels._linear

    def recording(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        seen.append(x.shape[0])
        return real(x, packed, bias)

    monkeypatch.setattr(cpu_kernels, "_linear", recording)
    layer = torch.nn.Linear(8, 3)
    expected_layer = torch.nn.Linear(8, 3)
    expected_layer.load_state_dict(layer.state_dict())
    use_onednn_linears(layer)
    seen.clear()  # the availability probe's own call
    x = torch.randn(1, 6, 8)
    with torch.inference_mode():
        for rows in (1, 2, 3, 4, 6):
            got = layer(x[:, :rows])
            assert got.shape == (1, rows, 3)
            assert torch.allclose(got, expected_layer(x[:, :rows]), atol=1e-5)
    assert seen == [cpu_kernels.MIN_GEMM_ROWS] * 4 + [6]
