"""megatron's ``gradient_accumulation_fusion`` without apex (``wgrad_fusion``): the sum, and the
refusal where torch has no fp32-accumulating GEMM. megatron's fused backward driven through it
end to end (TP1xDP2, TP2xDP1): ``test_gradient_accumulation_fusion_matches_unfused`` in
``test_cpu_compat.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nemo_gtp.integrations.megatron.wgrad_fusion import (
    TorchWgradAccumulation,
    accumulate_wgrad,
    enable_gradient_accumulation_fusion,
    fused_accumulation_available,
)


def test_accumulates_in_place_over_leading_dims() -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8, 3, 16, generator=generator).bfloat16()  # [s, b, in]
    dy = torch.randn(8, 3, 12, generator=generator).bfloat16()  # [s, b, out]
    main_grad = torch.randn(12, 16, generator=generator)
    expected = main_grad.double() + dy.reshape(-1, 12).double().t() @ x.reshape(-1, 16).double()
    address = main_grad.data_ptr()
    TorchWgradAccumulation.wgrad_gemm_accum_fp32(x, dy, main_grad)
    assert main_grad.data_ptr() == address and main_grad.dtype == torch.float32
    torch.testing.assert_close(main_grad.double(), expected, rtol=1e-6, atol=1e-5)


def test_half_precision_main_grad() -> None:
    x = torch.ones(4, 2, 3, dtype=torch.bfloat16)
    dy = torch.ones(4, 2, 5, dtype=torch.bfloat16)
    main_grad = torch.ones(5, 3, dtype=torch.bfloat16)
    TorchWgradAccumulation.wgrad_gemm_accum_fp16(x, dy, main_grad)
    assert torch.equal(main_grad, torch.full((5, 3), 9.0, dtype=torch.bfloat16))


def test_off_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.tensor_parallel import layers

    monkeypatch.delattr(layers, "fused_weight_gradient_mlp_cuda", raising=False)
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", False)
    assert enable_gradient_accumulation_fusion(None) is None
    assert enable_gradient_accumulation_fusion(SimpleNamespace()) is None
    config = SimpleNamespace(gradient_accumulation_fusion=False)
    assert enable_gradient_accumulation_fusion(config) is None
    assert not hasattr(layers, "fused_weight_gradient_mlp_cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a stack without the GEMM")
def test_refused_by_name_without_the_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.tensor_parallel import layers

    monkeypatch.delattr(layers, "fused_weight_gradient_mlp_cuda", raising=False)
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", False)
    assert not fused_accumulation_available()
    with pytest.raises(ValueError, match="set model.gradient_accumulation_fusion=false"):
        enable_gradient_accumulation_fusion(SimpleNamespace(gradient_accumulation_fusion=True))
    assert not hasattr(layers, "fused_weight_gradient_mlp_cuda")
    assert layers._grad_accum_fusion_available is False


def test_apex_extension_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.tensor_parallel import layers

    apex = SimpleNamespace(name="apex's extension")
    monkeypatch.setattr(layers, "fused_weight_gradient_mlp_cuda", apex, raising=False)
    assert (
        enable_gradient_accumulation_fusion(SimpleNamespace(gradient_accumulation_fusion=True))
        is None
    )
    assert layers.fused_weight_gradient_mlp_cuda is apex


def test_accumulate_wgrad_same_dtype_is_addmm() -> None:
    x = torch.randn(6, 4)
    dy = torch.randn(6, 5)
    main_grad = torch.randn(5, 4)
    expected = main_grad.clone().addmm_(dy.t(), x)
    accumulate_wgrad(x, dy, main_grad)
    assert torch.equal(main_grad, expected)
