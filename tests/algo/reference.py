"""Float64 reference losses, written independently of megatron_rl.algo: plain Python loops over
rows, tokens and segments, following the papers' formulas literally. Slow and obviously correct is
the point; autograd through these loops gives the reference gradients."""

from __future__ import annotations

import math

import torch


def _clip(x, lo, hi):
    return torch.clamp(x, lo, hi)


def _rows(mask):
    """(row index, list of response positions) for every row that has response tokens."""
    for i in range(mask.shape[0]):
        positions = [t for t in range(mask.shape[1]) if bool(mask[i, t])]
        if positions:
            yield i, positions


def _adv(advantages, i, t):
    return advantages[i] if advantages.dim() == 1 else advantages[i, t]


def _aggregate(rows, loss_agg, max_response_len):
    """rows: list of (list of per-token objectives). Returns the loss to minimise."""
    if loss_agg == "seq-mean-token-mean":
        return -sum(sum(objs) / len(objs) for objs in rows) / len(rows)
    if loss_agg == "token-mean":
        return -sum(sum(objs) for objs in rows) / sum(len(objs) for objs in rows)
    if loss_agg == "seq-mean-token-sum":
        return -sum(sum(objs) for objs in rows) / len(rows)
    if loss_agg == "seq-mean-token-sum-norm":
        return -sum(sum(objs) / max_response_len for objs in rows) / len(rows)
    raise AssertionError(loss_agg)


def _dual(obj, adv, dual_clip):
    """PPO dual-clip: for A < 0, max(obj, c * A)."""
    if dual_clip is None or float(adv) >= 0:
        return obj
    return torch.maximum(obj, dual_clip * adv)


def grpo(
    logp,
    old_logp,
    advantages,
    mask,
    clip_low,
    clip_high,
    loss_agg,
    max_len=None,
    *,
    dual_clip=None,
    weights=None,
):
    """`weights` [B, T]: a constant factor on each token's objective (mismatch correction)."""
    rows = []
    for i, positions in _rows(mask):
        objs = []
        for t in positions:
            ratio = torch.exp(logp[i, t] - old_logp[i, t])
            adv = _adv(advantages, i, t)
            obj = torch.minimum(ratio * adv, _clip(ratio, 1 - clip_low, 1 + clip_high) * adv)
            obj = _dual(obj, adv, dual_clip)
            objs.append(obj if weights is None else weights[i, t] * obj)
        rows.append(objs)
    return _aggregate(rows, loss_agg, max_len)


def gspo(
    logp,
    old_logp,
    advantages,
    mask,
    clip_low,
    clip_high,
    loss_agg,
    max_len=None,
    *,
    dual_clip=None,
    weights=None,
):
    """`weights` [B, T]: a factor on each token's share of its sequence's objective (mismatch
    correction). Each token's share is then written as verl writes GSPO, in GSPO-token's form
    s_it = sg[s_i] * exp(logp_t - sg[logp_t]), so that the factor scales that token's gradient
    alone; without weights the sequence's objective itself is spread over its tokens."""
    rows = []
    for i, positions in _rows(mask):
        log_seq = sum(logp[i, t] - old_logp[i, t] for t in positions) / len(positions)
        adv = advantages[i]

        def clipped(s, adv=adv):
            obj = torch.minimum(s * adv, _clip(s, 1 - clip_low, 1 + clip_high) * adv)
            return _dual(obj, adv, dual_clip)

        if weights is None:
            rows.append([clipped(torch.exp(log_seq))] * len(positions))
            continue
        shares = [
            torch.exp(log_seq).detach() * torch.exp(logp[i, t] - logp[i, t].detach())
            for t in positions
        ]
        rows.append([weights[i, t] * clipped(s) for t, s in zip(positions, shares, strict=True)])
    return _aggregate(rows, loss_agg, max_len)


def gspo_token(logp, old_logp, advantages, mask, clip_low, clip_high, loss_agg, max_len=None):
    rows = []
    for i, positions in _rows(mask):
        log_seq = sum(logp[i, t] - old_logp[i, t] for t in positions) / len(positions)
        objs = []
        for t in positions:
            s_it = torch.exp(log_seq).detach() * torch.exp(logp[i, t] - logp[i, t].detach())
            adv = _adv(advantages, i, t)
            objs.append(torch.minimum(s_it * adv, _clip(s_it, 1 - clip_low, 1 + clip_high) * adv))
        rows.append(objs)
    return _aggregate(rows, loss_agg, max_len)


def sspo(
    logp,
    old_logp,
    advantages,
    mask,
    clip_low,
    clip_high,
    loss_agg,
    max_len=None,
    *,
    segment_ids,
    old_entropy,
    beta=1.0,
    lower="entropy",
):
    rows = []
    for i, positions in _rows(mask):
        by_segment: dict[int, list[int]] = {}
        for t in positions:
            by_segment.setdefault(int(segment_ids[i, t]), []).append(t)
        obj_of_token = {}
        for seg_positions in by_segment.values():
            n = len(seg_positions)
            s = torch.exp(sum(logp[i, t] - old_logp[i, t] for t in seg_positions) / n)
            h = sum(float(old_entropy[i, t]) for t in seg_positions) / n if beta else 0.0
            hi = 1 + clip_high + beta * h
            lo = max(1 - clip_low - beta * h, 1e-3) if lower == "entropy" else 1 - clip_low
            adv = advantages[i]
            obj = torch.minimum(s * adv, _clip(s, lo, hi) * adv)
            for t in seg_positions:
                obj_of_token[t] = obj
        rows.append([obj_of_token[t] for t in positions])
    return _aggregate(rows, loss_agg, max_len)


def gmpo(logp, old_logp, advantages, mask, clip_low, clip_high, loss_agg, max_len=None):
    """Eq. 4 of arXiv 2507.20673 in its product form: (prod_t |min(rho A, clip(rho) A)|)^(1/|o|)
    times sgn(A), with the ratio clipped to [e^-clip_low, e^clip_high]."""
    rows = []
    for i, positions in _rows(mask):
        adv = advantages[i]
        if float(adv) == 0.0:
            rows.append([adv * 0.0 * logp[i, positions[0]]] * len(positions))
            continue
        product = 1.0
        for t in positions:
            rho = torch.exp(logp[i, t] - old_logp[i, t])
            clipped = _clip(rho, math.exp(-clip_low), math.exp(clip_high))
            product = product * torch.abs(torch.minimum(rho * adv, clipped * adv))
        obj = product ** (1.0 / len(positions)) * torch.sign(adv)
        rows.append([obj] * len(positions))
    return _aggregate(rows, loss_agg, max_len)


def cispo_paper(logp, old_logp, advantages, mask, clip_low, clip_high, loss_agg, max_len=None):
    """Eq. 4 of arXiv 2506.13585 literally: sg(clip(r)) * A * log pi. Same gradient as ours."""
    rows = []
    for i, positions in _rows(mask):
        objs = []
        for t in positions:
            ratio = torch.exp(logp[i, t] - old_logp[i, t])
            weight = _clip(ratio, 1 - clip_low, 1 + clip_high).detach()
            objs.append(weight * _adv(advantages, i, t) * logp[i, t])
        rows.append(objs)
    return _aggregate(rows, loss_agg, max_len)


def cispo_value(logp, old_logp, advantages, mask, clip_low, clip_high, loss_agg, max_len=None):
    """The value our cispo reports: the surrogate sg(clip(r)) * A at the current point."""
    rows = []
    for i, positions in _rows(mask):
        objs = []
        for t in positions:
            ratio = torch.exp(logp[i, t] - old_logp[i, t]).detach()
            objs.append(_clip(ratio, 1 - clip_low, 1 + clip_high) * _adv(advantages, i, t))
        rows.append(objs)
    return _aggregate(rows, loss_agg, max_len)


def segments(token_ids, mask, newline_ids):
    """The segmentation rule, token by token."""
    out = [[-1] * token_ids.shape[1] for _ in range(token_ids.shape[0])]
    for i in range(token_ids.shape[0]):
        segment, seen_content, previous_newline = 0, False, False
        for t in range(token_ids.shape[1]):
            if not bool(mask[i, t]):
                continue
            newline = int(token_ids[i, t]) in newline_ids
            if not newline and previous_newline and seen_content:
                segment += 1
            out[i][t] = segment
            seen_content = seen_content or not newline
            previous_newline = newline
    return torch.tensor(out, dtype=torch.long)


def group_advantages(rewards, group_size, std_normalize=True, eps=1e-6):
    out = []
    for g in range(0, len(rewards), group_size):
        group = [float(r) for r in rewards[g : g + group_size]]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (len(group) - 1))
        for r in group:
            if max(group) == min(group):
                out.append(0.0)
            else:
                out.append((r - mean) / (std + eps) if std_normalize else r - mean)
    return torch.tensor(out, dtype=torch.float64)
