"""Find out why a TransformerEngine GEMM refuses its operands (GPU diagnostic, no fix).

``install()`` wraps ``general_gemm`` where TE's linear modules call it. When a call raises, the
probe records every operand (type, shape, strides, storage offset, the address modulo 256 of
its data / transpose / scale_inv, dtypes, usages) and retries the same call with one change
at a time (a fresh copy of ``_scale_inv``; of ``_data``; of ``_transpose``; all three), and
records which retry succeeds: the first one that does names the operand cuBLAS refused. The
original error is raised again afterwards, so the run fails as it would have.

    import te_gemm_probe; te_gemm_probe.install()
    ...   # run the failing model
    te_gemm_probe.FINDINGS   # list of dicts, one per failing call (the first few)
"""

from __future__ import annotations

import traceback

import torch

FINDINGS: list[dict] = []
SUCCESSES: list[dict] = []  # the first calls that worked (a reference for the failing ones)
_FIELDS = ("_data", "_transpose", "_scale_inv", "_rowwise_data", "_columnwise_data")


def _describe(value: object) -> object:
    if not isinstance(value, torch.Tensor):
        return repr(value)[:80]
    out = {"type": type(value).__name__, "shape": list(value.shape)}
    parts = {name: getattr(value, name, None) for name in _FIELDS}
    parts = {k: v for k, v in parts.items() if isinstance(v, torch.Tensor)}
    if not parts:
        parts = {"self": value}
    for name, t in parts.items():
        out[name] = {
            "shape": list(t.shape),
            "stride": list(t.stride()),
            "offset": t.storage_offset(),
            "dtype": str(t.dtype),
            "ptr_mod_256": t.data_ptr() % 256,
            "contiguous": t.is_contiguous(),
        }
    for flag in ("_transpose_invalid", "_fp8_dtype"):
        if hasattr(value, flag):
            out[flag] = str(getattr(value, flag))
    quantizer = getattr(value, "_quantizer", None)
    if quantizer is not None:
        out["quantizer"] = {
            "type": type(quantizer).__name__,
            "rowwise": getattr(quantizer, "rowwise_usage", None),
            "columnwise": getattr(quantizer, "columnwise_usage", None),
        }
    return out


def _with_copy(value: object, names: tuple[str, ...]) -> object:
    """``value`` with fresh copies of the named fields (same object: restored by the caller)."""
    for name in names:
        t = getattr(value, name, None)
        if isinstance(t, torch.Tensor):
            setattr(value, name, t.clone())
    return value


def _probe(gemm, args: tuple, kwargs: dict, error: Exception) -> dict:  # noqa: ANN001
    finding = {
        "error": str(error).splitlines()[0][:300],
        "where": traceback.format_stack(limit=6)[-4].strip()[:300],
        "args": [_describe(a) for a in args[:2]],
        "out": _describe(kwargs.get("out")),
        "kwargs": {k: repr(v)[:60] for k, v in kwargs.items() if k != "out"},
        "retries": {},
    }
    quantized = [a for a in args[:2] if isinstance(a, torch.Tensor) and hasattr(a, "_scale_inv")]
    for label, names in (
        ("copy _scale_inv", ("_scale_inv",)),
        ("copy _data", ("_data",)),
        ("copy _transpose", ("_transpose",)),
        ("copy all", ("_scale_inv", "_data", "_transpose")),
    ):
        saved = [{n: getattr(a, n, None) for n in names} for a in quantized]
        try:
            for a in quantized:
                _with_copy(a, names)
            gemm(*args, **kwargs)
            finding["retries"][label] = "ok"
        except Exception as retry_error:  # noqa: BLE001 - recorded
            finding["retries"][label] = str(retry_error).splitlines()[0][-120:]
        finally:
            for a, fields in zip(quantized, saved):
                for n, t in fields.items():
                    setattr(a, n, t)
    return finding


def install(limit: int = 4) -> None:
    """Wrap ``general_gemm`` in TE's linear modules (idempotent)."""
    import transformer_engine.pytorch.module.grouped_linear as grouped
    import transformer_engine.pytorch.module.layernorm_linear as ln_linear
    import transformer_engine.pytorch.module.layernorm_mlp as ln_mlp
    import transformer_engine.pytorch.module.linear as linear

    for module in (linear, ln_linear, ln_mlp, grouped):
        gemm = getattr(module, "general_gemm", None)
        if gemm is None or getattr(gemm, "_probe", False):
            continue

        def wrapped(*args, _gemm=gemm, **kwargs):  # noqa: ANN002, ANN003, ANN202
            try:
                out = _gemm(*args, **kwargs)
            except RuntimeError as error:
                if len(FINDINGS) < limit:
                    torch.cuda.synchronize()
                    FINDINGS.append(_probe(_gemm, args, kwargs, error))
                raise
            if len(SUCCESSES) < limit:
                SUCCESSES.append({"args": [_describe(a) for a in args[:2]]})
            return out

        wrapped._probe = True
        module.general_gemm = wrapped
