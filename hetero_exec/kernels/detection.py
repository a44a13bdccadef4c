"""Detection kernels: NonMaxSuppression."""

from __future__ import annotations

import numpy as np

from hetero_exec.kernels._tensor_common import to_host
from hetero_exec.kernels.registry import kernel


def _suppression_matrix(boxes: np.ndarray, center_point_box: int,
                        iou_threshold: float) -> np.ndarray:
    """(B, N, N) bool: box j is suppressed by box i (onnxruntime's IoU rules: empty
    intersections and degenerate boxes never suppress)."""
    b = boxes.astype(np.float64)
    if center_point_box:
        xc, yc, w, h = b[..., 0], b[..., 1], b[..., 2], b[..., 3]
        x_min, x_max = xc - w / 2, xc + w / 2
        y_min, y_max = yc - h / 2, yc + h / 2
    else:
        y_min = np.minimum(b[..., 0], b[..., 2])
        y_max = np.maximum(b[..., 0], b[..., 2])
        x_min = np.minimum(b[..., 1], b[..., 3])
        x_max = np.maximum(b[..., 1], b[..., 3])
    def overlap(lo, hi):
        return (np.minimum(hi[:, :, None], hi[:, None, :])
                - np.maximum(lo[:, :, None], lo[:, None, :]))

    ix = overlap(x_min, x_max)
    iy = overlap(y_min, y_max)
    area = (x_max - x_min) * (y_max - y_min)
    inter = ix * iy
    union = area[:, :, None] + area[:, None, :] - inter
    ok = (ix > 0) & (iy > 0) & (area[:, :, None] > 0) & (area[:, None, :] > 0) & (union > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        iou = np.where(ok, inter / np.where(union > 0, union, 1), 0)
    return ok & (iou > iou_threshold)


@kernel("NonMaxSuppression", since=(10, 11), host_only="greedy, data-dependent selection loop")
def NonMaxSuppression(xp, boxes, scores, max_output_boxes_per_class=None, iou_threshold=None,
                      score_threshold=None, center_point_box=0):
    def scalar(v, default):
        if v is None:
            return default
        a = to_host(v).reshape(-1)
        return a[0].item() if a.size else default

    max_out = max(int(scalar(max_output_boxes_per_class, 0)), 0)
    iou_thr = float(scalar(iou_threshold, 0.0))
    score_thr = scalar(score_threshold, None)
    if max_out == 0:
        return (xp.zeros((0, 3), dtype=np.int64),)
    bx = to_host(boxes)
    sc = to_host(scores)
    n_batch, n_class, n_box = sc.shape
    suppress = _suppression_matrix(bx, center_point_box, iou_thr)
    box_ids = np.arange(n_box)
    selected = []
    for bi in range(n_batch):
        sup_b = suppress[bi]
        for ci in range(n_class):
            s = sc[bi, ci]
            cand = box_ids if score_thr is None else box_ids[s > score_thr]
            order = cand[np.lexsort((cand, -s[cand].astype(np.float64)))]  # score desc, index asc
            alive = np.ones(n_box, dtype=bool)
            kept = 0
            for j in order:
                if not alive[j]:
                    continue
                selected.append((bi, ci, j))
                kept += 1
                if kept >= max_out:
                    break
                alive &= ~sup_b[j]
    out = np.array(selected, dtype=np.int64).reshape(-1, 3)
    return (xp.asarray(out),)
