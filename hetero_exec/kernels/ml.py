"""ai.onnx.ml ops (ArrayFeatureExtractor, Binarizer, LabelEncoder, TreeEnsemble) and
TfIdfVectorizer. They take strings or table-driven lookups and run on the host."""

from __future__ import annotations

import math

import numpy as np

from hetero_exec.kernels.registry import kernel

ML = "ai.onnx.ml"
_HOST = "table lookups over host data (strings, python dicts, tree tables)"


@kernel("ArrayFeatureExtractor", since=1, domain=ML, host_only=_HOST)
def ArrayFeatureExtractor(xp, X, Y):
    idx = np.asarray(Y, dtype=np.int64).reshape(-1)
    n = X.shape[-1]
    if idx.size and (idx.min() < -n or idx.max() >= n):
        raise IndexError(f"ArrayFeatureExtractor index out of range for last dimension {n}")
    out = np.take(X, idx, axis=-1)
    if X.ndim == 1:
        out = out.reshape(1, idx.size)
    return (out,)


@kernel("Binarizer", since=1, domain=ML, host_only=_HOST)
def Binarizer(xp, X, *, threshold=0.0):
    return ((X > threshold).astype(X.dtype),)


def _string_array(values, shape):
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out.reshape(shape)


def _lookup(x, keys, values, default, out_dtype):
    """Map each element of x through keys -> values; vectorised unless keys are strings."""
    x = np.asarray(x)
    out_dtype = np.dtype(out_dtype)
    to_str = out_dtype.kind == "O"
    if x.dtype.kind == "O" or (len(keys) and isinstance(keys[0], str)):
        table = dict(zip([str(k) for k in keys], values))
        flat = [
            table.get(v.decode() if isinstance(v, bytes) else v, default) for v in x.reshape(-1)
        ]
        if to_str:
            return _string_array(flat, x.shape)
        return np.array(flat, dtype=out_dtype).reshape(x.shape)
    keys = np.asarray(keys)
    vals = np.asarray(values, dtype=out_dtype)
    if keys.dtype.kind == "f":
        x_cmp = x.astype(np.float64)
        keys = keys.astype(np.float64)
    else:
        x_cmp = x
    order = np.argsort(keys, kind="stable")
    skeys, svals = keys[order], vals[order]
    pos = np.searchsorted(skeys, x_cmp)
    pos_c = np.minimum(pos, max(len(skeys) - 1, 0))
    if len(skeys):
        found = skeys[pos_c] == x_cmp
        if keys.dtype.kind == "f":  # a NaN key matches a NaN input
            nan_keys = np.isnan(skeys)
            if nan_keys.any():
                found = found | np.isnan(x_cmp)
                pos_c = np.where(np.isnan(x_cmp), int(np.argmax(nan_keys)), pos_c)
    else:
        found = np.zeros(x.shape, dtype=bool)
    if to_str:
        out = np.full(x.shape, default, dtype=object)
        out[found] = svals[pos_c[found]]
        return out
    return np.where(
        found,
        svals[pos_c] if len(svals) else np.asarray(default, dtype=out_dtype),
        np.asarray(default, dtype=out_dtype),
    ).astype(out_dtype)


@kernel("LabelEncoder", since=(1, 2, 4), domain=ML, host_only=_HOST)
def LabelEncoder(
    xp,
    X,
    *,
    classes_strings=None,
    default_float=-0.0,
    default_int64=-1,
    default_string="_Unused",
    default_tensor=None,
    keys_floats=None,
    keys_int64s=None,
    keys_strings=None,
    keys_tensor=None,
    values_floats=None,
    values_int64s=None,
    values_strings=None,
    values_tensor=None,
):
    keys = next(
        (k for k in (keys_floats, keys_int64s, keys_strings, keys_tensor) if k is not None), None
    )
    if keys is None:
        # LabelEncoder-1: strings <-> indices into classes_strings
        classes = list(classes_strings or [])
        if X.dtype == object:
            return (
                _lookup(
                    X, classes, np.arange(len(classes), dtype=np.int64), default_int64, np.int64
                ),
            )
        idx = np.asarray(X, dtype=np.int64)
        ok = (idx >= 0) & (idx < len(classes))
        flat = [
            classes[i] if k else default_string for i, k in zip(idx.reshape(-1), ok.reshape(-1))
        ]
        return (_string_array(flat, X.shape),)
    if isinstance(keys, np.ndarray):
        keys = (
            keys.reshape(-1).tolist()
            if keys.dtype != object
            else [k.decode() if isinstance(k, bytes) else k for k in keys.reshape(-1)]
        )
    if values_tensor is not None:
        out_dtype = values_tensor.dtype
        if out_dtype.kind in "OSU":
            out_dtype = np.dtype(object)
            values = [
                v.decode() if isinstance(v, bytes) else str(v) for v in values_tensor.reshape(-1)
            ]
        else:
            values = values_tensor.reshape(-1)
        if default_tensor is not None:
            d = np.asarray(default_tensor).reshape(-1)[0]
            default = (
                d.decode() if isinstance(d, bytes) else (d.item() if hasattr(d, "item") else d)
            )
        else:
            default = (
                "_Unused" if out_dtype.kind == "O" else (-1 if out_dtype.kind in "iub" else -0.0)
            )
    elif values_floats is not None:
        out_dtype, values, default = np.dtype(np.float32), values_floats, default_float
    elif values_int64s is not None:
        out_dtype, values, default = np.dtype(np.int64), values_int64s, default_int64
    elif values_strings is not None:
        out_dtype, values, default = np.dtype(object), values_strings, default_string
    else:
        raise ValueError("LabelEncoder needs one values_* attribute")
    if len(keys) != len(values):
        raise ValueError(f"LabelEncoder has {len(keys)} keys but {len(values)} values")
    return (_lookup(X, keys, values, default, out_dtype),)


# -- TreeEnsemble ---------------------------------------------------------------


def _erfinv(x):
    # the approximation onnxruntime uses for PROBIT
    sgn = np.where(x < 0, -1.0, 1.0)
    x = (1 - x) * (1 + x)
    lg = np.log(x)
    v = 2 / (math.pi * 0.147) + 0.5 * lg
    v2 = 1 / 0.147 * lg
    return sgn * np.sqrt(-v + np.sqrt(v * v - v2))


def _post_transform(res, post_transform):
    if post_transform == 0:
        return res
    if post_transform == 1:
        e = np.exp(res - res.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)
    if post_transform == 2:
        return 1 / (1 + np.exp(-res))
    if post_transform == 3:
        nz = res != 0
        m = np.where(nz, res, -np.inf).max(axis=1, keepdims=True)
        e = np.where(nz, np.exp(res - np.where(np.isfinite(m), m, 0)), 0)
        s = e.sum(axis=1, keepdims=True)
        return np.where(s > 0, e / np.where(s > 0, s, 1), 0)
    if post_transform == 4:
        return math.sqrt(2) * _erfinv(res * 2 - 1)
    raise ValueError(f"unknown post_transform {post_transform}")


@kernel("TreeEnsemble", since=5, domain=ML, host_only=_HOST)
def TreeEnsemble(
    xp,
    X,
    *,
    aggregate_function=1,
    leaf_targetids=None,
    leaf_weights=None,
    membership_values=None,
    n_targets=None,
    nodes_falseleafs=None,
    nodes_falsenodeids=None,
    nodes_featureids=None,
    nodes_hitrates=None,
    nodes_missing_value_tracks_true=None,
    nodes_modes=None,
    nodes_splits=None,
    nodes_trueleafs=None,
    nodes_truenodeids=None,
    post_transform=0,
    tree_roots=None,
):
    X = np.asarray(X)
    if X.ndim == 1:
        X = X.reshape(1, -1)
    n, n_trees = X.shape[0], len(tree_roots)
    modes = np.asarray(nodes_modes, dtype=np.int64).reshape(-1)
    splits = np.asarray(nodes_splits, dtype=np.float64).reshape(-1)
    feats = np.asarray(nodes_featureids, dtype=np.int64)
    t_ids = np.asarray(nodes_truenodeids, dtype=np.int64)
    f_ids = np.asarray(nodes_falsenodeids, dtype=np.int64)
    t_leaf = np.asarray(nodes_trueleafs, dtype=bool)
    f_leaf = np.asarray(nodes_falseleafs, dtype=bool)
    n_nodes = modes.size
    miss = (
        np.asarray(nodes_missing_value_tracks_true, dtype=bool)
        if nodes_missing_value_tracks_true is not None
        else np.zeros(n_nodes, dtype=bool)
    )
    member_table = None
    if (modes == 6).any():
        if membership_values is None:
            raise ValueError("BRANCH_MEMBER nodes need membership_values")
        sets, cur = [], []
        for v in np.asarray(membership_values, dtype=np.float64).reshape(-1):
            if np.isnan(v):
                sets.append(cur)
                cur = []
            else:
                cur.append(v)
        if cur:
            sets.append(cur)
        member_nodes = np.nonzero(modes == 6)[0]
        if len(sets) < len(member_nodes):
            raise ValueError("membership_values has fewer sets than BRANCH_MEMBER nodes")
        width = max((len(s) for s in sets), default=1) or 1
        member_table = np.full((n_nodes, width), np.nan)
        for node_id, s in zip(member_nodes, sets):
            member_table[node_id, : len(s)] = s

    xf = X.astype(np.float64)
    rows = np.arange(n)[:, None]
    node = np.broadcast_to(np.asarray(tree_roots, dtype=np.int64), (n, n_trees)).copy()
    at_leaf = np.zeros((n, n_trees), dtype=bool)
    for _ in range(n_nodes + 1):
        active = ~at_leaf
        if not active.any():
            break
        nid = np.where(active, node, 0)
        xv = xf[rows, feats[nid]]
        sp = splits[nid]
        md = modes[nid]
        cond = np.select(
            [md == 0, md == 1, md == 2, md == 3, md == 4, md == 5],
            [xv <= sp, xv < sp, xv >= sp, xv > sp, xv == sp, xv != sp],
            default=False,
        )
        if member_table is not None:
            is_member = (member_table[nid] == xv[..., None]).any(axis=-1)
            cond = np.where(md == 6, is_member, cond)
        cond = cond | (np.isnan(xv) & miss[nid])
        nxt = np.where(cond, t_ids[nid], f_ids[nid])
        nxt_leaf = np.where(cond, t_leaf[nid], f_leaf[nid])
        node = np.where(active, nxt, node)
        at_leaf = at_leaf | (active & nxt_leaf)
    else:
        raise ValueError("TreeEnsemble: a tree does not reach a leaf (cycle in the node tables)")
    weights = np.asarray(leaf_weights, dtype=np.float64).reshape(-1)[node]
    targets = np.asarray(leaf_targetids, dtype=np.int64)[node]
    flat = (rows * n_targets + targets).reshape(-1)
    if aggregate_function in (0, 1):
        res = np.bincount(flat, weights=weights.reshape(-1), minlength=n * n_targets).reshape(
            n, n_targets
        )
        if aggregate_function == 0:
            res = res / n_trees
    elif aggregate_function == 2:
        res = np.full(n * n_targets, np.finfo(X.dtype).max, dtype=np.float64)
        np.minimum.at(res, flat, weights.reshape(-1))
        res = res.reshape(n, n_targets)
    elif aggregate_function == 3:
        res = np.full(n * n_targets, np.finfo(X.dtype).min, dtype=np.float64)
        np.maximum.at(res, flat, weights.reshape(-1))
        res = res.reshape(n, n_targets)
    else:
        raise ValueError(f"unknown aggregate_function {aggregate_function}")
    return (_post_transform(res, post_transform).astype(X.dtype),)


# -- TfIdfVectorizer ------------------------------------------------------------


def _prefix_levels(table, base):
    """Per position k, sorted keys ``prefix_id*base + token`` -> id of the k+1-token prefix.

    Chaining dense prefix ids keeps every key below (#prefixes * base): no overflow however
    long the n-grams or large the pool. Returns the levels and final id -> output column.
    """
    size = len(next(iter(table)))
    levels = []
    prev = {(): 0}
    for k in range(size):
        cur: dict[tuple[int, ...], int] = {}
        keys, ids = [], []
        for toks in table:
            p = toks[: k + 1]
            if p not in cur:
                cur[p] = len(cur) + 1
                keys.append(prev[toks[:k]] * base + toks[k])
                ids.append(cur[p])
        order = np.argsort(np.asarray(keys, dtype=np.int64), kind="stable")
        levels.append(
            (np.asarray(keys, dtype=np.int64)[order], np.asarray(ids, dtype=np.int64)[order])
        )
        prev = cur
    cols = np.zeros(len(prev) + 1, dtype=np.int64)
    for toks, col in table.items():
        cols[prev[toks]] = col
    return levels, cols


@kernel("TfIdfVectorizer", since=9, host_only=_HOST)
def TfIdfVectorizer(
    xp,
    X,
    *,
    max_gram_length=None,
    max_skip_count=None,
    min_gram_length=None,
    mode=None,
    ngram_counts=None,
    ngram_indexes=None,
    pool_int64s=None,
    pool_strings=None,
    weights=None,
):
    X = np.asarray(X)
    if X.ndim > 2:
        raise ValueError(f"TfIdfVectorizer input must be [C] or [B, C], got {list(X.shape)}")
    pool = list(pool_strings) if pool_strings is not None else [int(v) for v in (pool_int64s or [])]
    out_size = max(ngram_indexes) + 1
    rows2d = X.reshape(1, -1) if X.ndim < 2 else X
    n_rows, c = rows2d.shape

    # token -> small id (0 = not in the pool) so n-grams become integer keys
    vocab: dict = {}
    for tok in pool:
        vocab.setdefault(tok, len(vocab) + 1)
    base = len(vocab) + 1
    if X.dtype == object:
        tok_ids = np.array(
            [vocab.get(t.decode() if isinstance(t, bytes) else t, 0) for t in rows2d.reshape(-1)],
            dtype=np.int64,
        ).reshape(n_rows, c)
    else:
        keys = np.array(list(vocab.keys()), dtype=np.int64) if vocab else np.zeros(0, np.int64)
        ids = np.arange(1, len(keys) + 1, dtype=np.int64)
        order = np.argsort(keys)
        sk, si = keys[order], ids[order]
        flat = rows2d.astype(np.int64).reshape(-1)
        pos = np.minimum(np.searchsorted(sk, flat), max(len(sk) - 1, 0))
        tok_ids = (
            np.where(sk[pos] == flat, si[pos], 0) if len(sk) else np.zeros_like(flat)
        ).reshape(n_rows, c)

    # pool n-grams by size as token-id tuples -> output column (later duplicates win)
    grams: dict[int, dict[tuple[int, ...], int]] = {}
    gram_no = 0
    for i, start in enumerate(ngram_counts):
        size = i + 1
        end = ngram_counts[i + 1] if i + 1 < len(ngram_counts) else len(pool)
        for g in range((end - start) // size):
            if min_gram_length <= size <= max_gram_length:
                toks = tuple(vocab[t] for t in pool[start + g * size : start + (g + 1) * size])
                grams.setdefault(size, {})[toks] = ngram_indexes[gram_no]
            gram_no += 1

    freq = np.zeros((n_rows, out_size), dtype=np.int64)
    row_ix = np.arange(n_rows)[:, None]
    for size, table in grams.items():
        levels, cols = _prefix_levels(table, base)
        for skip in range(max_skip_count + 1 if size > 1 else 1):
            n_start = c - (size - 1) * (skip + 1)
            if n_start <= 0:
                continue
            gid = np.zeros((n_rows, n_start), dtype=np.int64)  # 0: no pool prefix matches
            for k, (lkeys, lids) in enumerate(levels):
                t = tok_ids[:, k * (skip + 1) : k * (skip + 1) + n_start]
                comb = gid * base + t
                pos = np.minimum(np.searchsorted(lkeys, comb), len(lkeys) - 1)
                gid = np.where(
                    (lkeys[pos] == comb) & (t > 0) & ((gid > 0) | (k == 0)), lids[pos], 0
                )
            hit = gid > 0
            np.add.at(freq, (np.broadcast_to(row_ix, gid.shape)[hit], cols[gid[hit]]), 1)

    w = np.asarray(weights if weights is not None else [], dtype=np.float32)
    if mode == "TF":
        out = freq.astype(np.float32)
    elif mode == "IDF":
        out = np.where(freq > 0, w[None, :out_size] if w.size else np.float32(1), 0).astype(
            np.float32
        )
    elif mode == "TFIDF":
        out = (freq * w[None, :out_size]).astype(np.float32) if w.size else freq.astype(np.float32)
    else:
        raise ValueError(f"unknown TfIdfVectorizer mode {mode!r}")
    return (out.reshape(out_size) if X.ndim < 2 else out,)
