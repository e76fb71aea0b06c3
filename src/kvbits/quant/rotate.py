"""Orthogonal rotations of the head dimension before quantizing (QuaRot / SpinQuant / llama.cpp style).

A key or value vector ``x`` (one token, one head, ``D`` channels) is stored as the codes of ``x @ R`` and
read back as ``dequant(x @ R) @ R^T``, with ``R = diag(s) @ H_D / sqrt(D)``: ``H_D`` the Sylvester
Walsh-Hadamard matrix and ``s`` fixed random signs (seed 0). ``R`` is orthogonal, so ``q . k`` and the
attention output are unchanged before quantization, while a channel with 10x the others' range is spread
over all ``D`` channels: per-token scales then fit every channel, which is what per-token keys lack.

``kind="hadamard-vllm"`` is the same matrix with vLLM's signs instead (``int4_per_token_head``'s randomized
Hadamard transform, ``_get_rht_signs(D, 0)`` in ``vllm/v1/attention/ops/int4_per_token_head.py``: a CPU
``torch.Generator`` seeded ``0x9E3779B9`` drawing ``2 * bernoulli(0.5) - 1``). vLLM stores ``H_D @ (s * x)``,
unnormalised: ``sqrt(D)`` times ``x @ R`` with these signs (``H_D`` is symmetric), so per-token codes are the
same. Which signs are drawn matters: on Qwen2.5 a rotated INT4 cache's perplexity moves several-fold from one
sign vector to another (BENCHMARKS.md §23c), so a scheme that predicts vLLM's cache uses vLLM's.

``R`` depends on ``D`` and ``kind`` alone and is rebuilt from nothing (no stored bytes per cache, layer or
token); each process keeps one copy per (D, kind, dtype, device): ``D * D`` elements, 64 KiB for D = 128 in
float32.
"""

from __future__ import annotations

import functools

import torch

from kvbits.schemes.spec import ROTATIONS

SIGN_SEED = 0
VLLM_SIGN_SEED = 0x9E3779B9  # vLLM's _get_rht_signs(d, round_idx=0)

__all__ = ["ROTATIONS", "check_rotatable", "rotate", "rotation_matrix", "signs", "unrotate"]


def check_rotatable(head_dim: int, kind: str) -> None:
    """``ValueError`` unless ``kind`` is a known rotation that fits ``head_dim`` channels."""
    if kind not in ROTATIONS:
        raise ValueError(f"unknown rotation {kind!r}; expected one of {ROTATIONS}")
    if head_dim < 2 or head_dim & (head_dim - 1):
        raise ValueError(
            f"a Hadamard rotation needs a head dim that is a power of two (64, 128, 256), got {head_dim}; "
            "use a scheme without rotate for this model"
        )


def signs(head_dim: int, kind: str = "hadamard") -> torch.Tensor:
    """The ``(D,)`` float64 vector of +-1 signs ``s`` of ``kind`` (``R = diag(s) @ H_D / sqrt(D)``)."""
    check_rotatable(head_dim, kind)
    if kind == "hadamard-vllm":  # vLLM's draw, as it makes it (CPU generator, bernoulli)
        gen = torch.Generator(device="cpu").manual_seed(VLLM_SIGN_SEED)
        return (2.0 * torch.bernoulli(torch.full((head_dim,), 0.5), generator=gen) - 1.0).to(torch.float64)
    gen = torch.Generator().manual_seed(SIGN_SEED)
    return torch.randint(0, 2, (head_dim,), generator=gen).to(torch.float64) * 2 - 1


@functools.lru_cache(maxsize=32)
def _matrix(head_dim: int, kind: str, dtype: torch.dtype, device: str) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < head_dim:  # Sylvester: H_2n = [[H, H], [H, -H]]
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    r = signs(head_dim, kind)[:, None] * h / head_dim**0.5
    return r.to(device=device, dtype=dtype)


def rotation_matrix(
    head_dim: int, kind: str = "hadamard", *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The orthogonal ``(D, D)`` matrix ``R`` of ``kind`` (``x_rotated = x @ R``)."""
    check_rotatable(head_dim, kind)
    return _matrix(head_dim, kind, dtype, str(torch.device(device)))


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def rotate(x: torch.Tensor, kind: str) -> torch.Tensor:
    """``x @ R`` over the last dim, ``(..., D)`` -> ``(..., D)`` in float32 (float64 for float64 input)."""
    work = _work_dtype(x.dtype)
    return x.to(work) @ rotation_matrix(x.shape[-1], kind, dtype=work, device=x.device)


def unrotate(x: torch.Tensor, kind: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ R^T`` over the last dim (the inverse of ``rotate``), ``(..., D)``, cast to ``dtype`` (default
    ``x.dtype``); computed in float32 (float64 for float64 ``x`` or ``dtype``)."""
    out_dtype = x.dtype if dtype is None else dtype
    work = torch.float64 if torch.float64 in (x.dtype, out_dtype) else torch.float32
    r = rotation_matrix(x.shape[-1], kind, dtype=work, device=x.device)
    return (x.to(work) @ r.T).to(out_dtype)
