"""Loss ops: NegativeLogLikelihoodLoss, SoftmaxCrossEntropyLoss."""

from __future__ import annotations

from hetero_exec.kernels.registry import kernel


def _nll(xp, logp, target, weight, ignore_index, reduction):
    """logp: (N, C, d1...), target: (N, d1...) -> loss per the reduction."""
    if logp.ndim < 2:
        raise ValueError(f"the loss input must be at least 2D (N, C, ...), got shape {logp.shape}")
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"unknown reduction {reduction!r}")
    n_classes = logp.shape[1]
    t = target.astype(xp.int64, copy=False)
    keep = None if ignore_index is None else (t != ignore_index)
    safe_t = t if keep is None else xp.where(keep, t, 0)
    picked = xp.take_along_axis(logp, xp.expand_dims(xp.clip(safe_t, 0, n_classes - 1), 1), axis=1)
    loss = -xp.squeeze(picked, axis=1)
    w = None
    if weight is not None:
        w = xp.take(weight, xp.clip(safe_t, 0, n_classes - 1)).astype(logp.dtype, copy=False)
        if keep is not None:
            w = xp.where(keep, w, 0).astype(logp.dtype, copy=False)
    elif keep is not None:
        w = keep.astype(logp.dtype)
    if w is not None:
        loss = loss * w
    if reduction == "none":
        return loss.astype(logp.dtype, copy=False)
    total = xp.sum(loss)
    if reduction == "sum":
        return xp.asarray(total).astype(logp.dtype)
    denom = xp.sum(w) if w is not None else loss.size
    return xp.asarray(total / denom).astype(logp.dtype)


@kernel("NegativeLogLikelihoodLoss", since=(12, 13))
def NegativeLogLikelihoodLoss(
    xp, input, target, weight=None, *, ignore_index=None, reduction="mean"
):
    return (_nll(xp, input, target, weight, ignore_index, reduction),)


@kernel("SoftmaxCrossEntropyLoss", since=(12, 13))
def SoftmaxCrossEntropyLoss(
    xp, scores, labels, weights=None, *, ignore_index=None, reduction="mean", num_outputs=2
):
    m = xp.max(scores, axis=1, keepdims=True)
    shifted = scores - m
    log_prob = shifted - xp.log(xp.sum(xp.exp(shifted), axis=1, keepdims=True))
    loss = _nll(xp, log_prob, labels, weights, ignore_index, reduction)
    return (loss, log_prob.astype(scores.dtype, copy=False))[: max(num_outputs, 1)]
