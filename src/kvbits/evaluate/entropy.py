"""Entropy of attention distributions: how flat or sharp each query's attention is.

Quantized keys perturb every score ``q . k_j``; at long context these perturbations can flatten the
distribution (attention spreads over many keys whose noisy scores now look alike) or sharpen it
(a few keys pulled up by the noise). The entropy ``H = -sum_j p_j log p_j`` (nats) of a query's
attention over the keys it sees shows which: ``log(n)`` for uniform attention over ``n`` keys, 0
for attention on one key.

The simulator (:mod:`.simulate`) calls :func:`attention_entropy` for its sampled layers, on the
same chunk of queries and the same keys as its attention call, once over the quantized keys and
once over the exact ones. Scores are computed explicitly there (SDPA returns no probabilities), in
sub-chunks of queries so that at most ``budget`` scores exist at once.

The scores are computed in the inputs' precision (float32 at least), the softmax and ``-p log p`` in float64, as
:func:`kvbits.evaluate.metrics.exact_log_softmax` does for the other metrics: with near-one-hot attention the top
key's ``p`` rounds to 1 in float32 and its ``-p log p`` (about the mass of all the others) to 0, 4% of the entropy
for one key 25 nats above 4,095 others. The float64 sub-chunks hold half the scores, so the memory stays that of
float32.
"""

from __future__ import annotations

import torch

__all__ = ["ENTROPY_BUDGET", "attention_entropy"]

ENTROPY_BUDGET = 1 << 23  # float32 scores per sub-chunk, 32 MB (half as many in float64; a few times that with softmax)


@torch.no_grad()
def attention_entropy(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    *,
    budget: int = ENTROPY_BUDGET,
) -> torch.Tensor:
    """Entropy (nats) of each query's attention distribution, averaged over query heads.

    Args:
        q: queries ``(B, H_q, c, D)``.
        k: keys ``(B, H_kv, L, D)``; query head ``h`` attends with KV head ``h // G``,
            ``G = H_q / H_kv`` (as SDPA's ``enable_gqa``).
        mask: bool ``(c, L)``, True where query ``i`` sees key ``j``; every row must see a key (a row that sees
            none has no distribution: its entropy is NaN, not checked here to keep the call free of a host sync;
            the simulator's causal and sliding-window masks always include the query's own key).
        scale: the score scale (``D ** -0.5`` unless the model says otherwise).
        softcap: attention logit soft-cap ``tanh(s / cap) * cap`` (Gemma 2), or None.
        budget: most float32 scores computed at once (queries are taken in sub-chunks to stay below it; half as
            many in float64, where the probabilities are).

    Returns:
        ``(B, c)``: the mean over the ``H_q`` heads of ``-sum_j p_j log p_j`` (computed in float64), in float32
        (float64 for float64 inputs); all NaN when ``L == 0`` (no key seen), empty when ``c == 0``.

    Raises:
        ValueError: ``q`` / ``k`` not 4-D, of another batch size or head dim, ``H_q`` not a multiple of ``H_kv``, or
            a mask not bool ``(c, L)``.
    """
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be (B, H, T, D), got {tuple(q.shape)} and {tuple(k.shape)}")
    B, Hq, c, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k must be (B, H_kv, L, D) with B = {B} and D = {D} as q's, got {tuple(k.shape)}")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({Hkv})")
    if mask.shape != (c, L):
        raise ValueError(f"mask must be (c, L) = ({c}, {L}), got {tuple(mask.shape)}")
    if mask.dtype != torch.bool:  # an additive float mask (0 / -inf) would be inverted as if it were True / False
        raise ValueError(f"mask must be bool (True where query i sees key j), got dtype {mask.dtype}")
    G = Hq // Hkv
    dtype = torch.promote_types(q.dtype, torch.float32)
    if c == 0 or L == 0:  # no queries: nothing to average; no keys: no row has a distribution (NaN, as documented)
        return torch.full((B, c), float("nan"), dtype=dtype, device=q.device)
    kt = k.to(dtype).transpose(-1, -2)
    step = max(1, budget // 2 // max(1, B * Hq * L))  # float64 probabilities: half the scores in the same bytes
    out = []
    for a in range(0, c, step):
        b = min(c, a + step)
        # the G query heads of a KV head folded into the query axis: (B, H_kv, G * n, D)
        qf = q[:, :, a:b].to(dtype).reshape(B, Hkv, G * (b - a), D)
        s = torch.matmul(qf, kt) * scale
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        s = s.to(torch.float64).masked_fill(~mask[a:b].repeat(G, 1), float("-inf"))
        # entr(0) = 0: keys a query does not see contribute nothing
        h = torch.special.entr(torch.softmax(s, dim=-1)).sum(dim=-1)
        out.append(h.reshape(B, Hq, b - a).mean(dim=1).to(dtype))
    return torch.cat(out, dim=1)
