"""The on-policy fast path of the update, and prompt-prefix sharing in training forwards.

**On-policy fast path.** With ``ppo_epochs = 1`` and ``mini_batches = 1`` the single update uses
the very weights that sampled the batch: ``pi_old == pi_theta``, every importance ratio is 1 and
the clip never binds. The separate no-grad pass that today's path runs for old log-probs and
entropies then computes nothing the gradient forward does not compute anyway. Here the gradient
forward supplies both: per micro-batch ``token_stats(grad=True)`` gives ``lp`` (with graph) and
``H``; the token weighting sees ``lp.detach()`` and ``H`` (computed without gradient, before any
backward), the loss uses ``old = lp.detach()`` (so ``ratio = exp(lp - sg(lp)) = 1`` with gradient
``d lp``), and then each micro-batch's loss is backpropagated. Same update as the two-pass path up
to float rounding (tests/unit/test_onpolicy.py checks 1e-6 on a tiny model).

Micro-batching and mini-batch-wide statistics: STAPO's S2T threshold ``tau_h`` is a percentile of
the whole (global) mini-batch's entropies, and every aggregation's normalizer (``sum(m)`` for
STAPO) is a mini-batch sum, so the weights of micro-batch 1 are known only once the last
micro-batch's forward has run. Options weighed:

1. a forward per micro-batch keeping each graph until all stats are in, then weights, then the
   backwards (chosen): no extra compute; memory is that of a micro-batch as large as the mini-batch;
2. a cheap statistics pass first: there is none cheaper than a no-grad forward, which is exactly
   the pass the fast path removes;
3. deferring the normalizer (the loss is linear in ``1/norm``) works for the normalizer but not
   for a percentile threshold, which changes *which* tokens get gradient.

So: weightings that read no statistics (``none``: GRPO, DAPO, JustRL) get weights before the
forward and backpropagate each micro-batch at once (memory as today, any micro-batching);
weightings that read statistics (``s2t``, ``top_entropy``, ``stare``, ``lp_reg``) keep the graphs of
the mini-batch's micro-batches (option 1). ``trainer.onpolicy_fast_path = auto`` does the latter
only where memory is not what micro-batching protects (CPU, or a single micro-batch); ``always``
also there; ``never`` never (the two-pass path). The fast path uses the unfused ``token_stats(grad=True)``
(the fused loss needs its coefficients, i.e. the weights, before its forward).

**Prompt-prefix sharing** (``trainer.share_prompt_prefix``, torch backend). The G responses of a
group share their prompt, and the prompt is usually most of each row (the demo: ~40 prompt tokens,
<= 16 response tokens). A training forward then runs the distinct prompts once (batch = groups),
repeats their KV cache G times along the batch (``index_select``: differentiable, so the prompt
tokens' gradient is the sum over the G responses, as in the full-row forward), runs the responses on
top of it, and takes the first response token's prediction from the prompt's last hidden state.
Same log-probs, entropies and gradients as the full rows up to float rounding (test).
"""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = [
    "STATS_FREE_WEIGHTINGS",
    "onpolicy_applies",
    "onpolicy_update",
    "prefix_shared_token_stats",
    "prompt_groups",
    "can_share_prefix",
    "trim_columns",
]

# Token weightings whose weights do not depend on log-probs or entropies (only on the mask).
STATS_FREE_WEIGHTINGS = frozenset({"none"})


def onpolicy_blockers(cfg: Any) -> list[str]:
    """Config features the fast path does not carry (each needs the two-pass path in core/loop.py):
    the per-step extras that read the sampling policy's statistics before the update (KL to a
    reference, Lp-Reg's proxy, STARE's schedule), the entropy bonus, DEEP-GRPO's local loss hook,
    and sequence-level ratios (GSPO). The loop also takes the two-pass path on several ranks (its
    lockstep plan) and on token-dump steps (the dump records the update's weights per row)."""
    a = cfg.algorithm
    out = []
    if a.kl_coef > 0:
        out.append("algorithm.kl_coef > 0")
    if a.lp_reg.enabled:
        out.append("algorithm.lp_reg.enabled")
    if a.token_weighting == "stare":
        out.append("algorithm.token_weighting=stare")
    if a.entropy_coef:
        out.append("algorithm.entropy_coef")
    if a.deep_grpo.enabled:
        out.append("algorithm.deep_grpo.enabled")
    if a.policy_loss not in ("ppo_clip", "maspo"):
        out.append(f"algorithm.policy_loss={a.policy_loss}")
    return out


def onpolicy_applies(cfg: Any, backend: Any, n_rows: int) -> bool:
    """Whether this step's update takes the fast path (see the module docstring)."""
    a, t = cfg.algorithm, cfg.trainer
    if t.onpolicy_fast_path == "never" or a.ppo_epochs != 1 or a.mini_batches != 1:
        return False
    if onpolicy_blockers(cfg):
        return False
    if not hasattr(backend, "token_stats"):
        return False
    if t.onpolicy_fast_path == "always" or a.token_weighting in STATS_FREE_WEIGHTINGS:
        return True
    one_micro = n_rows <= t.micro_batch_size
    return one_micro or torch.device(getattr(backend, "device", "cpu")).type == "cpu"


# ----------------------------------------------------------------------------- prefix sharing


def prompt_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, p_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(first row holding each distinct prompt [U], index of every row's prompt in that list [B]).

    Rows are compared on their first ``p_len`` columns (prompt, left-padded) and mask; equal
    prompts need not be adjacent. Prompts are listed in order of first appearance.
    """
    key = torch.cat([input_ids[:, :p_len], attention_mask[:, :p_len].to(input_ids.dtype)], dim=1)  # [B, 2P]
    _, inverse = torch.unique(key, dim=0, return_inverse=True)  # [B] into sorted distinct rows
    B = key.shape[0]
    rows = torch.arange(B, device=key.device)
    first_of = torch.full((int(inverse.max()) + 1,), B, device=key.device).scatter_reduce(0, inverse, rows, "amin")
    order = torch.argsort(first_of)  # distinct prompts by first appearance
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=key.device)
    return first_of[order], rank[inverse]


def trim_columns(attention_mask: torch.Tensor) -> slice:
    """The columns holding any real token: a micro-batch drops padding the whole batch needed."""
    cols = attention_mask.bool().any(0).nonzero()
    if not cols.numel():
        return slice(0, attention_mask.shape[1])
    return slice(int(cols[0]), int(cols[-1]) + 1)


def _prompt_len(response_mask: torch.Tensor) -> int | None:
    """Column where responses start (collate: prompts left-padded to P, responses from P on)."""
    cols = response_mask.any(0).nonzero()
    return int(cols[0]) if cols.numel() else None


def can_share_prefix(model: Any, response_mask: torch.Tensor) -> bool:
    from stapo.core.trainer.base import head_logit_transform

    base = getattr(model, "base_model", None)
    p_len = _prompt_len(response_mask)
    return (
        base is not None and base is not model and p_len is not None and p_len >= 1
        and not head_logit_transform(model)[1] and model.get_output_embeddings() is not None
    )


def prefix_shared_token_stats(
    model: torch.nn.Module,
    input_ids: torch.Tensor,  # [B, L]: prompts left-padded to P columns, responses from column P
    attention_mask: torch.Tensor,  # [B, L]
    response_mask: torch.Tensor,  # [B, L] bool, True only at columns >= P
    *,
    chunk_size: int,
    entropy_grad: bool = False,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``compute_token_stats`` restricted to the response, with each distinct prompt run once.

    Returns (logprobs [B, L], entropy [B, L]) fp32, zero outside the response: the same values as
    ``compute_token_stats(model, ids, attn, response_mask)``. Gradient flows (when enabled) into the
    prompt's forward through the repeated KV cache.
    """
    from transformers import DynamicCache

    from stapo.core import tokenstats as ts
    from stapo.core.trainer.base import forward_as, head_logit_transform, position_ids_from_mask, stat_targets

    p_len = _prompt_len(response_mask)
    if p_len is None or p_len < 1:
        raise ValueError("prefix_shared_token_stats: response_mask must mark responses after a prompt")
    if response_mask[:, :p_len].any():
        raise ValueError("prefix_shared_token_stats: response_mask marks prompt columns")
    B, L = input_ids.shape
    attention_mask = attention_mask.to(input_ids.device)
    first, group = prompt_groups(input_ids, attention_mask, p_len)  # [U], [B]
    positions = position_ids_from_mask(attention_mask)  # [B, L]
    base = model.base_model
    cache = DynamicCache(config=model.config)
    out = base(
        input_ids=input_ids[first, :p_len], attention_mask=attention_mask[first, :p_len],
        position_ids=positions[first, :p_len], past_key_values=cache, use_cache=True,
    )
    h_last = out.last_hidden_state[:, -1]  # [U, D]: predicts each response's first token
    cache = out.past_key_values
    cache.batch_select_indices(group)  # [U, ...] -> [B, ...]: differentiable repeat
    out2 = base(
        input_ids=input_ids[:, p_len:], attention_mask=attention_mask, position_ids=positions[:, p_len:],
        past_key_values=cache, use_cache=True,
    )
    h_resp = out2.last_hidden_state  # [B, R, D]
    hidden = torch.cat([h_last[group].unsqueeze(1), h_resp[:, :-1]], dim=1)  # [B, R, D]: predicts column P + j
    target = stat_targets(attention_mask, response_mask)  # [B, L]
    tgt = target[:, p_len:]  # [B, R]
    h = hidden[tgt]  # [N, D]
    labels = input_ids[:, p_len:][tgt]  # [N]
    head = model.get_output_embeddings()
    scale, _ = head_logit_transform(model)

    def _stats(h_: torch.Tensor, labels_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ts.token_logprobs_entropy_from_hidden(
            h_, head.weight, labels_, chunk_size=chunk_size, entropy_grad=entropy_grad,
            bias=getattr(head, "bias", None), temperature=temperature / scale,
        )

    with forward_as(head, _stats):
        lp, ent = head(h, labels)  # [N], [N]
    where = target.nonzero(as_tuple=True)  # row-major, all at columns >= P: the order of hidden[tgt]
    logprobs = torch.zeros(B, L, dtype=torch.float32, device=input_ids.device).index_put(where, lp.float())
    entropy = torch.zeros(B, L, dtype=torch.float32, device=input_ids.device).index_put(where, ent.float())
    return logprobs, entropy


def shared_stats_fn(cfg: Any, backend: Any) -> Any | None:
    """A ``token_stats``-like callable using prefix sharing, or None where it does not apply."""
    if not cfg.trainer.share_prompt_prefix or type(backend).__name__ != "TorchBackend":
        return None
    model = backend.model
    if cfg.model.gradient_checkpointing:
        return None  # HF turns the KV cache off under activation checkpointing

    def stats(ids: torch.Tensor, attn: torch.Tensor, resp: torch.Tensor, *, grad: bool, temperature: float) -> Any:
        if not can_share_prefix(model, resp):
            return backend.token_stats(ids, attn, resp, grad=grad, temperature=temperature)
        model.train(grad)
        ctx = torch.enable_grad() if grad else torch.no_grad()
        autocast = backend._autocast() if hasattr(backend, "_autocast") else torch.autocast("cpu", enabled=False)
        with ctx, autocast:
            return prefix_shared_token_stats(
                model, ids.to(backend.device), attn.to(backend.device), resp.to(backend.device),
                chunk_size=cfg.trainer.logits_chunk_size, entropy_grad=cfg.trainer.entropy_grad,
                temperature=temperature,
            )

    return stats


# ----------------------------------------------------------------------------- the fast update


def onpolicy_update(run: Any, batch: Any, step: int, *, record: Any = None) -> tuple[dict[str, float], torch.Tensor, torch.Tensor]:
    """One exactly on-policy update -> (metrics, logprobs [N, L], entropy [N, L] before the update).

    The returned statistics are those of the sampling policy (the gradient forward ran before the
    optimizer step), for the step's token metrics and token dumps.
    """
    from stapo.core.algos import TokenContext
    from stapo.core.loop import (
        add_loss_sums,
        loss_sums,
        step_entropy_thresholds,
        update_diagnostics,
        update_metrics,
        update_parts,
    )

    cfg, backend = run.cfg, run.backend
    a = cfg.algorithm
    parts = update_parts(cfg)
    weigh, loss_fn, agg, params = parts.weigh, parts.loss_fn, parts.agg, parts.params
    micro, temp, loss_kw = parts.micro, parts.temperature, parts.loss_kw
    inner = shared_stats_fn(cfg, backend) or backend.token_stats

    def stats_fn(ids: torch.Tensor, attn: torch.Tensor, resp: torch.Tensor, *, grad: bool, temperature: float) -> Any:
        """Stats of a micro-batch on its own real columns, put back at the batch's width."""
        cols = trim_columns(attn)
        lp, ent = inner(ids[:, cols], attn[:, cols], resp[:, cols], grad=grad, temperature=temperature)
        pad = (cols.start, ids.shape[1] - cols.stop)
        return torch.nn.functional.pad(lp, pad), torch.nn.functional.pad(ent, pad)

    n = batch.input_ids.shape[0]
    # The single mini-batch is the whole batch; unlike the two-pass path's shuffled mini-batches the
    # rows stay in group order, so a micro-batch holds whole groups (one prompt forward each with
    # prefix sharing). Row order changes only float rounding: the gradient is a sum over rows.
    perm = torch.arange(n, device=batch.input_ids.device)
    mb = batch.rows(perm)
    gather = getattr(backend, "all_gather_1d", None)
    reduce = getattr(backend, "all_reduce_sum", None)
    t_weights = 0.0

    def weights_of(lp: torch.Tensor, ent: torch.Tensor) -> tuple[Any, Any]:
        ctx = TokenContext(logprobs=lp, entropy=ent, advantages=mb.advantages, mask=mb.response_mask,
                           gather=gather, all_reduce_sum=reduce)
        tw = weigh(ctx, **params)
        norm = agg.normalizer(tw, mb.response_mask)
        return tw, (reduce(norm) if reduce is not None else norm)

    sums = loss_sums()

    def backward_rows(rows: slice, lp: torch.Tensor, tw: Any, norm: Any) -> None:
        old = lp.detach()
        mask_rows, adv_rows = mb.response_mask[rows], mb.advantages[rows]
        per_tok, m = loss_fn(lp, old, adv_rows, mask_rows, **loss_kw)  # (KL terms: onpolicy_blockers)
        loss = agg.aggregate(per_tok, tw.select(rows), normalizer=norm)
        backend.backward(loss)
        add_loss_sums(sums, loss, m)

    slices = [slice(s, s + micro) for s in range(0, n, micro)]
    lps: list[torch.Tensor] = []
    ents: list[torch.Tensor] = []
    if a.token_weighting in STATS_FREE_WEIGHTINGS:
        t0 = time.time()
        zeros = torch.zeros(mb.response_mask.shape, dtype=torch.float32, device=mb.response_mask.device)
        tw, norm = weights_of(zeros, zeros)  # reads only the mask
        t_weights += time.time() - t0
        for rows in slices:
            lp, ent = stats_fn(mb.input_ids[rows], mb.attention_mask[rows], mb.response_mask[rows],
                               grad=True, temperature=temp)
            lps.append(lp.detach().float())
            ents.append(ent.detach().float())
            backward_rows(rows, lp, tw, norm)
    else:
        graphs = []
        for rows in slices:  # every micro-batch's graph is kept until the weights are known
            lp, ent = stats_fn(mb.input_ids[rows], mb.attention_mask[rows], mb.response_mask[rows],
                               grad=True, temperature=temp)
            graphs.append(lp)
            lps.append(lp.detach().float())
            ents.append(ent.detach().float())
        t0 = time.time()
        tw, norm = weights_of(torch.cat(lps), torch.cat(ents))
        t_weights += time.time() - t0
        for rows, lp in zip(slices, graphs, strict=True):
            backward_rows(rows, lp, tw, norm)
        del graphs
    out = backend.step()
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(n, device=perm.device)
    lp_all, ent_all = torch.cat(lps)[inv], torch.cat(ents)[inv]  # back to the batch's row order
    # Diagnostics from the update's own weighting, as update_policy logs them (one mini-batch = the
    # step batch, so tau_h_scope step and minibatch coincide).
    t0 = time.time()
    ctx = TokenContext(logprobs=torch.cat(lps), entropy=torch.cat(ents), advantages=mb.advantages,
                       mask=mb.response_mask, gather=gather, all_reduce_sum=reduce)
    p05, tau_step = step_entropy_thresholds(cfg, ctx.entropy, ctx.mask, gather)
    diag: dict[str, float] = {}
    tau = update_diagnostics(cfg, ctx, tw, tau_step, diag)
    if record is not None:  # what the update applied, per row, for the token dump
        record.put(0, perm, ctx, tw, tau, a.s2t.tau_p)
    t_weights += time.time() - t0
    metrics = update_metrics(diag, [tau], p05, sums, [out], epochs=1)
    metrics["time/weights_s"] = t_weights
    return metrics, lp_all, ent_all
