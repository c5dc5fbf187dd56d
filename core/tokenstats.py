"""Memory-bounded log-probs and entropies of sampled tokens, computed chunk by chunk.

RL on LLMs needs, for every response token, log pi(token) (with gradient) and the entropy of the
full next-token distribution (usually without gradient). The naive way materializes float32
logits [tokens, vocab] for the whole batch, plus their softmax and their gradient: at vocab 151,936
that is 0.6 GB per 1,000 tokens per copy. Here tokens are processed in chunks of ``chunk_size``:

- ``token_logprobs_entropy_from_hidden(hidden [N, D], lm_head_weight [V, D], labels [N])`` goes
  from the last hidden states. A custom ``torch.autograd.Function`` keeps only hidden, weight and
  two floats per token for backward and RECOMPUTES each chunk's logits in backward, so at no time
  does more than one chunk of [chunk, V] float32 exist. Gradients flow to hidden, weight and bias
  (and to the entropy when ``entropy_grad=True``).
- ``token_logprobs_entropy_from_logits(logits [N, V], labels [N])`` starts from logits the model
  already produced (any dtype) and upcasts one chunk at a time; its gradient w.r.t. the logits is
  written chunk by chunk into one buffer of the logits' own dtype.

Both upcast to float32 per chunk (float64 stays float64, which the gradient tests use), divide the
logits by ``temperature`` (the sampling temperature, so that log-probs match the rollout's), and
return ``(logprobs [N], entropy [N])``. Labels < 0 are ignored positions: log-prob 0, no gradient.

Math per token (z = logits / T, lse = logsumexp z, log p = z - lse, H = -sum p log p):
    d logp_y / dz = onehot(y) - p,        dH / dz = -p * (log p + H).

Fused loss (``fused_token_loss_from_hidden``): when the training loss is a sum of per-token terms
``l_i(logp_i)`` whose constants (old log-probs, advantages, token weights, the global normalizer)
are known before the pass, as for PPO-clip, the gradient w.r.t. each chunk's logits is known the
moment that chunk's softmax is: ``dL/dz = l_i'(logp_i) * (onehot(y) - p)``. So the forward computes
the hidden and weight gradients chunk by chunk (Liger-kernel's fused linear cross-entropy idea,
applied to an RL token loss) and backward only scales them: 3 matmuls per chunk, as many as the
naive path, instead of the recompute path's 4, with the same chunk-bounded memory.

Benchmark against the naive computation: ``python benchmarks/tokenstats.py --help``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "token_logprobs_entropy_from_hidden",
    "fused_token_loss_from_hidden",
    "token_logprobs_entropy_from_logits",
    "reference_logprobs_entropy",
]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _validate_labels(labels: Tensor, n: int, vocab: int) -> None:
    if not isinstance(labels, Tensor) or labels.dim() != 1 or labels.shape[0] != n:
        shape = tuple(labels.shape) if isinstance(labels, Tensor) else type(labels).__name__
        raise ValueError(f"labels must be a 1-D tensor of length N={n}, got {shape}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"labels must be an integer tensor (token ids), got dtype {labels.dtype}")
    if n and int(labels.max()) >= vocab:
        raise ValueError(f"labels contain id {int(labels.max())} >= vocab size {vocab}")


def _check_common(chunk_size: int, temperature: float) -> None:
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def _stats_from_logits_(z: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """In place on z ([n, V], compute dtype, already / T): returns (label logp [n], entropy [n], lse [n])."""
    # two [n, V] buffers at most: z (shifted in place, then log p) and p
    zmax = z.amax(dim=-1, keepdim=True)  # [n, 1]
    z.sub_(zmax)
    p = z.exp()  # [n, V] unnormalized
    sumexp = p.sum(dim=-1, keepdim=True)  # [n, 1]
    lse = (zmax + sumexp.log()).squeeze(-1)  # [n]
    logp_all = z.sub_(sumexp.log())  # [n, V], in place: z now holds log p
    p.div_(sumexp)
    # sum_v p log p without a temp; autocast off so a CUDA bf16 region cannot run this matmul in bf16
    with torch.autocast(device_type=p.device.type, enabled=False):
        ent = -torch.bmm(p.unsqueeze(1), logp_all.unsqueeze(2)).reshape(-1)  # [n]
    del p
    valid = labels >= 0
    lp = logp_all.gather(1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)  # [n]
    lp = torch.where(valid, lp, torch.zeros_like(lp))
    return lp, ent, lse


def _grad_logits_(
    z: Tensor, labels: Tensor, lse: Tensor, ent: Tensor, g_lp: Tensor, g_ent: Tensor | None
) -> Tensor:
    """In place on z ([n, V], compute dtype, already / T): returns dLoss/dz for this chunk.

    g_lp, g_ent are the incoming gradients of the chunk's logp and entropy (already scaled by 1/T
    so the result is the gradient w.r.t. the raw logits).
    """
    valid = labels >= 0
    g_lp = torch.where(valid, g_lp, torch.zeros_like(g_lp))  # ignored labels carry no logp gradient
    logp_all = z.sub_(lse.unsqueeze(-1))  # [n, V] log p
    if g_ent is None:
        grad = logp_all.exp_().mul_(-g_lp.unsqueeze(-1))  # [n, V] = -g_lp * p
    else:
        p = logp_all.exp()  # [n, V]
        # -p * (g_lp + g_ent * (log p + H))
        grad = (
            logp_all.add_(ent.unsqueeze(-1)).mul_(g_ent.unsqueeze(-1)).add_(g_lp.unsqueeze(-1)).mul_(p).neg_()
        )
        del p
    grad.scatter_add_(1, labels.clamp_min(0).unsqueeze(-1), g_lp.unsqueeze(-1))  # + g_lp * onehot(y)
    return grad


def _chunked_stats(
    chunk_logits: Callable[[int, int], Tensor],
    labels: Tensor,
    *,
    chunk_size: int,
    temperature: float,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[Tensor, Tensor, Tensor]:
    """(label logp [N], entropy [N], lse [N]) one chunk of rows at a time.

    ``chunk_logits(s, e)`` returns a fresh [e - s, V] tensor in ``dtype`` that may be modified in
    place; only one chunk's logits exist at a time.
    """
    n = labels.shape[0]
    logp = torch.empty(n, dtype=dtype, device=device)
    ent = torch.empty(n, dtype=dtype, device=device)
    lse = torch.empty(n, dtype=dtype, device=device)
    for s in range(0, n, chunk_size):
        e = min(s + chunk_size, n)
        z = chunk_logits(s, e)  # [c, V]
        if temperature != 1.0:
            z.div_(temperature)
        logp[s:e], ent[s:e], lse[s:e] = _stats_from_logits_(z, labels[s:e])
        del z
    return logp, ent, lse


def _accum_dtype(requested: torch.dtype | None, weight_dtype: torch.dtype) -> torch.dtype:
    """Dtype of the LM-head gradient buffer summed over chunks: float32 (float64 for float64
    weights) unless the caller asks otherwise. Summing many chunk contributions in bf16 drops the
    small ones (bf16 keeps 8 bits of mantissa); the buffer is cast to the weight's dtype once, at
    the end, as autograd expects."""
    if requested is not None:
        return requested
    return torch.float64 if weight_dtype == torch.float64 else torch.float32


def _accumulate_weight_grad_(
    grad_w: Tensor, gz: Tensor, gz_w: Tensor, h: Tensor, *, autocast: bool
) -> None:
    """grad_w [V, D] += gz.T @ h for one chunk (gz [c, V] in the compute dtype, h [c, D]).

    When the buffer has the weight's dtype (and no autocast) the product is accumulated in place
    (addmm, no [V, D] temporary). Otherwise (a float32 buffer for bf16/fp16 weights, or autocast)
    the chunk's product is one matmul in the weight's (autocast's) dtype, as lm_head's own backward
    would run it (tensor cores; the GEMM accumulates in float32 internally), and is ADDED to the
    float32 buffer: each chunk's product is rounded once, the running sum never is. Costs a [V, D]
    temporary in the low-precision dtype. ``gz`` (float32) is kept for callers that need it.
    """
    del gz
    if grad_w.dtype == gz_w.dtype and not autocast:
        grad_w.addmm_(gz_w.t(), h.to(gz_w.dtype))  # [V, D] += [V, c] @ [c, D]
    else:
        grad_w.add_(gz_w.t() @ h.to(gz_w.dtype))  # [V, D] (+)= low-precision product, summed in fp32


class _FromHidden(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_size, entropy_grad, temperature, grad_accum_dtype):  # type: ignore[override]
        cdt = _compute_dtype(hidden.dtype)
        logp, ent, lse = _chunked_stats(
            lambda s, e: F.linear(hidden[s:e], weight, bias).to(cdt),  # [c, V]
            labels, chunk_size=chunk_size, temperature=temperature, dtype=cdt, device=hidden.device,
        )
        ctx.save_for_backward(hidden, weight, bias, labels, lse, ent)
        ctx.chunk_size = chunk_size
        ctx.entropy_grad = entropy_grad
        ctx.temperature = temperature
        ctx.grad_accum_dtype = grad_accum_dtype
        if not entropy_grad:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):  # type: ignore[override]
        hidden, weight, bias, labels, lse, ent = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        n = hidden.shape[0]
        cdt = lse.dtype
        t = ctx.temperature
        if g_logp is None:
            g_logp = torch.zeros(n, dtype=cdt, device=hidden.device)
        g_logp = g_logp.to(cdt) / t
        use_ent = ctx.entropy_grad and g_ent is not None
        g_ent = g_ent.to(cdt) / t if use_ent else None
        acc = _accum_dtype(ctx.grad_accum_dtype, weight.dtype)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = (
            torch.zeros(bias.shape, dtype=acc, device=bias.device) if (need_b and bias is not None) else None
        )
        for s in range(0, n, ctx.chunk_size):
            e = min(s + ctx.chunk_size, n)
            h = hidden[s:e]  # [c, D]
            z = F.linear(h, weight, bias).to(cdt)  # [c, V]
            if t != 1.0:
                z.div_(t)
            gz = _grad_logits_(
                z, labels[s:e], lse[s:e], ent[s:e], g_logp[s:e], None if g_ent is None else g_ent[s:e]
            )
            if grad_b is not None:
                grad_b.add_(gz.sum(dim=0).to(acc))
            gz_w = gz.to(weight.dtype)  # [c, V]
            del z
            if grad_h is not None:
                grad_h[s:e] = (gz_w @ weight).to(hidden.dtype)  # [c, D]
            if grad_w is not None:
                _accumulate_weight_grad_(grad_w, gz, gz_w, h, autocast=False)
            del gz_w, gz
        if grad_w is not None and grad_w.dtype != weight.dtype:
            grad_w = grad_w.to(weight.dtype)
        if grad_b is not None and grad_b.dtype != bias.dtype:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None


class _FromLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, chunk_size, entropy_grad, temperature):  # type: ignore[override]
        cdt = _compute_dtype(logits.dtype)
        logp, ent, lse = _chunked_stats(
            lambda s, e: logits[s:e].to(cdt, copy=True),  # [c, V], never the caller's tensor
            labels, chunk_size=chunk_size, temperature=temperature, dtype=cdt, device=logits.device,
        )
        ctx.save_for_backward(logits, labels, lse, ent)
        ctx.chunk_size = chunk_size
        ctx.entropy_grad = entropy_grad
        ctx.temperature = temperature
        if not entropy_grad:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):  # type: ignore[override]
        logits, labels, lse, ent = ctx.saved_tensors
        n = logits.shape[0]
        cdt = lse.dtype
        t = ctx.temperature
        if g_logp is None:
            g_logp = torch.zeros(n, dtype=cdt, device=logits.device)
        g_logp = g_logp.to(cdt) / t
        use_ent = ctx.entropy_grad and g_ent is not None
        g_ent = g_ent.to(cdt) / t if use_ent else None
        grad = torch.empty_like(logits)  # [N, V] in the logits' dtype
        for s in range(0, n, ctx.chunk_size):
            e = min(s + ctx.chunk_size, n)
            z = logits[s:e].to(cdt, copy=True)
            if t != 1.0:
                z.div_(t)
            grad[s:e] = _grad_logits_(
                z, labels[s:e], lse[s:e], ent[s:e], g_logp[s:e], None if g_ent is None else g_ent[s:e]
            )
            del z
        return grad, None, None, None, None


def _validate_from_hidden(
    hidden: Tensor, lm_head_weight: Tensor, labels: Tensor, bias: Tensor | None, chunk_size: int, temperature: float
) -> None:
    """Shape checks shared by the from-hidden entry points; each error names the argument."""
    if not isinstance(hidden, Tensor) or hidden.dim() != 2:
        raise ValueError(f"hidden must have shape [N, D], got {tuple(getattr(hidden, 'shape', ()))}")
    if not isinstance(lm_head_weight, Tensor) or lm_head_weight.dim() != 2:
        raise ValueError(
            f"lm_head_weight must have shape [V, D], got {tuple(getattr(lm_head_weight, 'shape', ()))}"
        )
    if lm_head_weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"lm_head_weight has hidden size {lm_head_weight.shape[1]} but hidden has {hidden.shape[1]} (shape [V, D])"
        )
    if bias is not None and tuple(bias.shape) != (lm_head_weight.shape[0],):
        raise ValueError(f"bias must have shape [V]=[{lm_head_weight.shape[0]}], got {tuple(bias.shape)}")
    _check_common(chunk_size, temperature)
    _validate_labels(labels, hidden.shape[0], lm_head_weight.shape[0])


def token_logprobs_entropy_from_hidden(
    hidden: Tensor,
    lm_head_weight: Tensor,
    labels: Tensor,
    *,
    chunk_size: int = 1024,
    entropy_grad: bool = False,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    grad_accum_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """(logprobs [N], entropy [N]) of ``labels`` under softmax((hidden @ W.T + bias) / T), chunked.

    hidden [N, D] (flatten [B, L, D] first), lm_head_weight [V, D], labels [N] (negative = ignore).
    Peak extra memory is O(chunk_size * V) float32 plus the weight gradient; logits are recomputed
    in backward. ``grad_accum_dtype`` is the dtype the weight gradient is accumulated in across
    chunks (default float32, float64 for float64 weights, whatever the weight's dtype: a bf16 sum
    over many chunks loses the small contributions; costs one float32 [V, D] buffer).
    """
    _validate_from_hidden(hidden, lm_head_weight, labels, bias, chunk_size, temperature)
    labels = labels.long()
    return _FromHidden.apply(
        hidden,
        lm_head_weight,
        bias,
        labels,
        chunk_size,
        bool(entropy_grad),
        float(temperature),
        grad_accum_dtype,
    )


TokenLossFn = Callable[[Tensor, Tensor], Tensor]
"""``token_loss(logp [n] (requires grad), index [n] long) -> per-token loss [n]``, elementwise."""


def _autocast_on(device: torch.device) -> bool:
    return torch.is_autocast_enabled(device.type)


def _token_loss_grad(
    token_loss: TokenLossFn, lp: Tensor, valid: Tensor, start: int
) -> tuple[Tensor, Tensor]:
    """(sum of the chunk's token losses (0-dim), d loss / d logp [n], 0 at ignored labels).

    Only the chunk's valid positions are handed to ``token_loss``; ``index`` counts from the start
    of the whole [N] batch, so the caller can gather its per-token constants with it.
    """
    n = lp.shape[0]
    all_valid = bool(valid.all())
    pos = None if all_valid else valid.nonzero().squeeze(1)  # [n_valid]
    index = torch.arange(start, start + n, device=lp.device) if all_valid else pos + start
    with torch.enable_grad():
        x = (lp if all_valid else lp[pos]).detach().requires_grad_(True)  # [n_valid]
        loss = token_loss(x, index)
        if not isinstance(loss, Tensor) or tuple(loss.shape) != tuple(x.shape):
            got = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
            raise ValueError(
                f"token_loss must return one loss per token, shape {tuple(x.shape)}; got {got} "
                "(the fused path needs an elementwise per-token loss)"
            )
        total = loss.sum()
        if total.requires_grad:
            (g,) = torch.autograd.grad(total, x, allow_unused=True)
        else:
            g = None
    g = torch.zeros_like(x) if g is None else g.to(lp.dtype)
    if not all_valid:
        g = torch.zeros_like(lp).index_copy_(0, pos, g)  # [n]
    return total.detach().to(lp.dtype), g


_ROW_BLOCK_ELEMS = 1 << 22  # elements of the [rows, V] temporary in _softmax_inplace_ (16 MiB float32)


def _softmax_inplace_(z: Tensor, y0: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Turn z ([n, V] logits / T, compute dtype) into p = softmax(z) IN PLACE; also return the
    labels' log-probs [n] (y0 [n, 1], clamped ids) and the entropies [n].

    With z shifted so max = 0, S = sum exp(z) and M = sum exp(z) z: log p_y = z_y - log S and
    H = -sum p log p = log S - M / S. S and M are taken over blocks of rows, exp(z) written back
    into z as it goes, so besides z only a [rows, V] temporary exists (the gradient needs p, and
    p reuses z's memory).
    """
    n, v = z.shape
    z.sub_(z.amax(dim=-1, keepdim=True))  # [n, V], max 0 per row
    zy = z.gather(1, y0).squeeze(-1)  # [n]
    sumexp = torch.empty(n, dtype=z.dtype, device=z.device)  # [n] S
    zexp = torch.empty(n, dtype=z.dtype, device=z.device)  # [n] M
    rows = max(1, _ROW_BLOCK_ELEMS // max(v, 1))
    for r in range(0, n, rows):
        zb = z[r : r + rows]  # [rows, V] view
        eb = zb.exp()  # [rows, V] temporary
        sumexp[r : r + rows] = eb.sum(dim=-1)
        zexp[r : r + rows] = zb.mul_(eb).sum(dim=-1)  # elementwise, not bmm: autocast leaves it fp32
        zb.copy_(eb)
        del eb
    log_s = sumexp.log()  # [n]
    p = z.div_(sumexp.unsqueeze(-1))  # [n, V]
    return p, zy - log_s, log_s - zexp / sumexp


class _FusedLoss(torch.autograd.Function):
    """Forward computes the loss AND its gradients w.r.t. hidden, weight, bias, chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, token_loss, chunk_size, temperature, grad_accum_dtype):  # type: ignore[override]
        n = hidden.shape[0]
        t = temperature
        cdt = _compute_dtype(hidden.dtype)
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        need_b = need_b and bias is not None
        acc = _accum_dtype(grad_accum_dtype, weight.dtype)
        autocast = _autocast_on(hidden.device)
        logp = torch.zeros(n, dtype=cdt, device=hidden.device)  # [N]
        ent = torch.zeros(n, dtype=cdt, device=hidden.device)  # [N]
        loss = torch.zeros((), dtype=cdt, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None  # [N, D]
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None  # [V, D]
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None  # [V]
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            h = hidden[s:e]  # [c, D]
            y = labels[s:e]  # [c]
            z = F.linear(h, weight, bias).to(cdt)  # [c, V]
            if t != 1.0:
                z.div_(t)
            valid = y >= 0
            y0 = y.clamp_min(0).unsqueeze(-1)  # [c, 1]
            p, lp, ent[s:e] = _softmax_inplace_(z, y0)  # p [c, V] in z's memory: ONE [c, V] buffer
            del z
            lp = torch.where(valid, lp, torch.zeros_like(lp))
            logp[s:e] = lp
            chunk_loss, g = _token_loss_grad(token_loss, lp, valid, s)  # [c]: d loss / d logp
            loss = loss + chunk_loss
            if not (need_h or need_w or need_b):
                del p
                continue
            g = (g / t).unsqueeze(-1)  # [c, 1]: w.r.t. the raw logits
            gz = p.mul_(g.neg()).scatter_add_(1, y0, g)  # [c, V] = g * (onehot(y) - p) / T
            if grad_b is not None:
                grad_b.add_(gz.sum(dim=0).to(acc))
            gz_w = gz.to(weight.dtype)  # [c, V]
            if grad_h is not None:
                grad_h[s:e] = (gz_w @ weight).to(hidden.dtype)  # [c, D]
            if grad_w is not None:
                _accumulate_weight_grad_(grad_w, gz, gz_w, h, autocast=autocast)
            del gz_w, gz, p
        if grad_w is not None and grad_w.dtype != weight.dtype:
            grad_w = grad_w.to(weight.dtype)
        if grad_b is not None and grad_b.dtype != bias.dtype:
            grad_b = grad_b.to(bias.dtype)
        ctx.grads = (grad_h, grad_w, grad_b)
        ctx.mark_non_differentiable(logp, ent)
        return loss, logp, ent

    @staticmethod
    def backward(ctx, g_loss, g_logp, g_ent):  # type: ignore[override]
        if ctx.grads is None:
            raise RuntimeError(
                "fused_token_loss_from_hidden: backward ran twice on one forward (retain_graph); "
                "the precomputed gradients were already handed over"
            )
        grads, ctx.grads = ctx.grads, None  # hand over: autograd may keep them as .grad
        if g_loss is None:
            return None, None, None, None, None, None, None, None
        one = g_loss.numel() == 1 and float(g_loss) == 1.0
        grad_h, grad_w, grad_b = (
            gr if gr is None or one else gr * g_loss.to(gr.dtype) for gr in grads
        )
        return grad_h, grad_w, grad_b, None, None, None, None, None


def fused_token_loss_from_hidden(
    hidden: Tensor,
    lm_head_weight: Tensor,
    labels: Tensor,
    token_loss: TokenLossFn,
    *,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    bias: Tensor | None = None,
    grad_accum_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, logprobs [N], entropy [N]) with ``loss = sum_i token_loss(logp_i)``, fused and chunked.

    hidden [N, D], lm_head_weight [V, D], labels [N] (negative = ignored: log-prob 0, never handed
    to ``token_loss``, no gradient), logits = (hidden @ W.T + bias) / temperature.

    ``token_loss(logp [n], index [n]) -> [n]`` is called once per chunk with the chunk's log-probs
    (a leaf that requires grad) and their positions in [0, N). It must be ELEMENTWISE: token i's
    loss may depend on logp_i only (plus constants it gathers with ``index``), because its gradient
    is taken per chunk, while the chunk's softmax is at hand. Then dL/dlogits = l'(logp) (onehot - p)
    gives the gradients w.r.t. hidden, weight and bias right away; backward just scales them by the
    incoming gradient. Cost: 3 matmuls per chunk (logits, grad_hidden, grad_weight) like the naive
    path, vs 4 for :func:`token_logprobs_entropy_from_hidden` (which recomputes logits in backward);
    memory: one [chunk, V] float32 buffer (softmax in place, see ``_softmax_inplace_``) plus the
    [N, D] and [V, D] gradient buffers held from forward to backward.

    ``loss`` is differentiable w.r.t. hidden, weight and bias (backward once: the gradients are
    handed over, not copied); ``logprobs`` and ``entropy`` are detached. The entropy carries NO
    gradient here: losses with an entropy term (``entropy_grad=True``) need the unfused path.
    ``grad_accum_dtype`` is as in :func:`token_logprobs_entropy_from_hidden`.
    """
    if not callable(token_loss):
        raise ValueError(f"token_loss must be callable (logp [n], index [n]) -> [n], got {token_loss!r}")
    _validate_from_hidden(hidden, lm_head_weight, labels, bias, chunk_size, temperature)
    labels = labels.long()
    return _FusedLoss.apply(
        hidden, lm_head_weight, bias, labels, token_loss, chunk_size, float(temperature), grad_accum_dtype
    )


def token_logprobs_entropy_from_logits(
    logits: Tensor,
    labels: Tensor,
    *,
    chunk_size: int = 1024,
    entropy_grad: bool = False,
    temperature: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """(logprobs [N], entropy [N]) from logits [N, V] of any dtype, upcast one chunk at a time."""
    if not isinstance(logits, Tensor) or logits.dim() != 2:
        raise ValueError(f"logits must have shape [N, V], got {tuple(getattr(logits, 'shape', ()))}")
    _check_common(chunk_size, temperature)
    _validate_labels(labels, logits.shape[0], logits.shape[1])
    labels = labels.long()
    return _FromLogits.apply(logits, labels, chunk_size, bool(entropy_grad), float(temperature))


def reference_logprobs_entropy(
    logits: Tensor, labels: Tensor, *, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """The naive full-materialization computation (float32 [N, V] log-softmax), for tests and the
    benchmark baseline. Entropy carries gradient here; detach it if you do not want that."""
    z = logits.to(_compute_dtype(logits.dtype)) / temperature  # [N, V]
    logp_all = torch.log_softmax(z, dim=-1)  # [N, V]
    ent = -(logp_all.exp() * logp_all).sum(-1)  # [N]
    lp = logp_all.gather(1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)  # [N]
    lp = torch.where(labels >= 0, lp, torch.zeros_like(lp))
    return lp, ent
