"""A decoder cut at layer boundaries into stage models (Ray-free: it reads ONNX only).

The graph is the generator's rewrite (`hetero_exec.genai.rewrite`): every layer's cache
grows through a KVAppend (or an attention op's shared buffer). A cut between layer
j-1 and layer j falls after the last cache node of layer j-1 and at or before the
first of layer j; among those positions the one whose crossing values are the fewest
bytes wins (the residual stream, and the few small values every layer reads: the
expanded mask, rotary tables, shape scalars). Values computed from weights alone
are not carried: every stage that reads one computes it itself. A cache (a KVAppend's
output) never crosses a cut: only activations do.

A stage sends on what the stages after it read from it or from before it: a value
stage 0 makes that stage 2 reads (Llama's rotary tables, read by every layer) goes
through stage 1 unchanged (`StagePart.passed`).

Values a later stage could make from the feeds alone with a few cheap nodes (the
expanded attention mask: 54-64 of the 200-218 plan steps of the tiny test decoders'
second stage) are sent when small and made again when not (`StagePart.remade`, made
by `StagePart.prelude`): a decode step's mask is one row of positions, a prompt's
their square (sent, it would outgrow the hidden states it goes with).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import onnx

from hetero_exec.genai.errors import GenaiError
from hetero_exec.genai.layout import CacheLayout
from hetero_exec.ir import load
from hetero_exec.ir.graph import Graph, node_reads

#: a symbolic dimension's guess when costing a cut (batch, sequence: small, alike for all)
SYMBOL_GUESS = 16


@dataclass(frozen=True)
class StagePart:
    """One stage of a split decoder: its ONNX model and the names it trades."""

    index: int
    model: bytes
    layers: tuple[int, ...]  # the cache layers whose entries it holds
    entries: tuple[str, ...]  # the past names of its cache entries
    inputs: tuple[str, ...]  # the graph inputs it reads and the values carried into it
    carried_in: tuple[str, ...]  # values computed by earlier stages
    carried_out: tuple[str, ...]  # values it makes that later stages read (none from the last)
    output: str | None  # the logits, on the last stage
    #: values an earlier stage made that a later one reads: received and sent on as they are
    passed: tuple[str, ...] = ()
    #: of ``carried_in``, those this stage makes again from the feeds (``prelude``, an ONNX
    #: model from the graph inputs to them) when a step does not carry them
    remade: tuple[str, ...] = ()
    prelude: bytes = b""
    #: of ``carried_out`` and ``passed``, those later stages can make again: sent only
    #: when small (`send_again`)
    optional: tuple[str, ...] = ()


def layer_counts(layers: int, stages: int, given: Sequence[int] | None = None) -> list[int]:
    """How many of a decoder's ``layers`` each of ``stages`` stages runs: ``given`` (one
    count a stage, each at least 1, adding up to ``layers``: an uneven split, as
    vLLM's ``VLLM_PP_LAYER_PARTITION``, for devices of unequal speed or memory), else
    even, with the layers left over going to the stages before the last, from the
    second-to-last back, as vLLM shares them (the last stage also runs the LM head and
    samples, while the first adds only the embedding lookup).

    >>> layer_counts(4, 2), layer_counts(5, 2), layer_counts(4, 3), layer_counts(7, 4)
    ([2, 2], [3, 2], [1, 2, 1], [2, 2, 2, 1])
    >>> layer_counts(4, 2, [3, 1])
    [3, 1]
    >>> layer_counts(4, 2, [2, 1])
    Traceback (most recent call last):
    ...
    hetero_exec.genai.errors.GenaiError: stage_layers=[2, 1] adds up to 3 layers; the decoder has 4
    """
    if given is not None and len(given) != stages:
        raise GenaiError(f"stage_layers={list(given)} names {len(given)} stage(s), for "
                         f"stages={stages}")
    if not 1 <= stages <= layers:
        raise GenaiError(f"stages={stages}: the decoder has {layers} layers, so 1 to "
                         f"{layers} stages")
    if given is None:
        counts = [layers // stages] * stages
        for k in range(2, layers % stages + 2):
            counts[-k] += 1
        return counts
    counts = list(given)
    if any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts):
        raise GenaiError(f"stage_layers={counts}: each stage runs a whole number of layers, "
                         "at least 1")
    if sum(counts) != layers:
        raise GenaiError(f"stage_layers={counts} adds up to {sum(counts)} layers; the decoder "
                         f"has {layers}")
    return counts


def split_decoder(model: onnx.ModelProto, layout: CacheLayout, stages: int,
                  stage_layers: Sequence[int] | None = None) -> list[StagePart]:
    """``model`` (rewritten) as ``stages`` stage models, each running the number of
    layers `layer_counts` gives it (``stage_layers``, or even)."""
    layers = sorted({e.layer for e in layout.entries})
    counts = layer_counts(len(layers), stages, stage_layers)
    _, graph = load(model)
    position = {n.name: i for i, n in enumerate(graph.nodes)}
    at = {}
    for e in layout.entries:
        if e.node not in position:
            raise GenaiError(f"the cache node {e.node!r} of layer {e.layer} is not in the graph")
        at.setdefault(e.layer, []).append(position[e.node])
    constant = _weights_only(graph)
    produced, last_read = _lifetimes(graph)
    caches = {o for n in graph.nodes if n.op_type in ("KVAppend", "KVPrefix") for o in n.outputs}
    cache_nodes = {e.node for e in layout.entries}
    tainted = _downstream(graph, {o for n in graph.nodes if n.name in cache_nodes
                                  for o in n.outputs if o})
    share = [sum(counts[:k + 1]) for k in range(stages)]  # the layers before each cut
    bounds = [0]
    for k in range(stages - 1):
        before, after = layers[share[k] - 1], layers[share[k]]
        lo, hi = max(at[before]) + 1, min(at[after])
        if lo > hi:
            raise GenaiError(f"layers {before} and {after} interleave in the graph: no cut "
                             "between them")
        bounds.append(_best_cut(graph, lo, hi, produced, last_read, constant, caches))
    bounds.append(len(graph.nodes))
    cuts = []  # per stage: (its nodes, what they make, the inputs and carried values it reads)
    for k in range(stages):
        lo, hi = bounds[k], bounds[k + 1]
        mine = graph.nodes[lo:hi]
        own = {o for n in mine for o in n.outputs if o}
        reads = [r for n in mine for r in node_reads(n) if r]
        # values from weights alone that an earlier stage made: computed here again; cheap
        # ones from the feeds alone (the expanded mask, shapes): carried when small, else
        # made again by the stage's prelude (``remade``)
        earlier = [r for r in dict.fromkeys(reads) if r not in own and r in produced]
        again = [r for r in earlier if r in constant]
        remade = [r for r in earlier if r not in constant and r not in tainted
                  and _cheap(graph, _constant_closure(graph, [r]))]
        nodes = _constant_closure(graph, again) + list(mine)
        made = {o for n in nodes for o in n.outputs if o}
        inputs = _inputs(graph, nodes)
        cuts.append((nodes, made, inputs, [r for r in inputs if r in produced], remade))
    owner = {}  # a carried value -> the stage whose own nodes make it
    for k in range(stages):
        for n in graph.nodes[bounds[k]:bounds[k + 1]]:
            owner.update({o: k for o in n.outputs if o})
    parts = []
    for k in range(stages):
        lo, hi = bounds[k], bounds[k + 1]
        nodes, made, inputs, carried_in, remade = cuts[k]
        wanted = dict.fromkeys(v for *_, later, _ in cuts[k + 1:] for v in later)
        optional = {v for *_, later_remade in cuts[k + 1:] for v in later_remade}
        carried_out = [v for v in wanted if owner.get(v) == k]
        passed = [v for v in wanted if owner.get(v, k) < k]
        bad = [v for v in carried_out if v in caches]
        if bad:
            raise GenaiError(f"a cut after node {hi} carries the cache {bad[0]!r}")
        output = layout.logits if k == stages - 1 else None
        if k == stages - 1 and layout.logits not in made:
            raise GenaiError(f"the last stage does not compute {layout.logits!r}")
        from actors.stage_model import stage_model

        proto, _ = stage_model(graph, f"{graph.name}_stage{k}", nodes, inputs,
                               carried_out + ([output] if output else []))
        held = [e for e in layout.entries if position[e.node] in range(lo, hi)]
        prelude = b""
        if remade:
            closure = _constant_closure(graph, remade)
            prelude = stage_model(graph, f"{graph.name}_stage{k}_prelude", closure,
                                  _inputs(graph, closure), remade)[0].SerializeToString()
        parts.append(StagePart(k, proto.SerializeToString(), tuple(sorted({e.layer for e in held})),
                               tuple(e.past for e in held), tuple(inputs), tuple(carried_in),
                               tuple(carried_out), output, tuple(passed), tuple(remade), prelude,
                               tuple(v for v in carried_out + passed if v in optional)))
    return parts


#: a value a later stage can make again is sent when at most this many bytes, or at most
#: as many as the step's other carried values (so it at most doubles a message)
SEND_AGAIN_BYTES = 1 << 16


def send_again(nbytes: int, others: int) -> bool:
    """Whether to send a value of ``nbytes`` that the next stage can make again, beside
    ``others`` bytes of values it cannot."""
    return nbytes <= max(SEND_AGAIN_BYTES, others)


def _inputs(graph: Graph, nodes: list) -> list[str]:
    """What ``nodes`` read that none of them makes and no weight is, in reading order."""
    made = {o for n in nodes for o in n.outputs if o}
    return list(dict.fromkeys(r for n in nodes for r in node_reads(n)
                              if r and r not in made and r not in graph.initializers))


def _weights_only(graph: Graph) -> set[str]:
    """Values computed from initializers and constants alone."""
    out = set(graph.initializers)
    for n in graph.nodes:
        reads = [r for r in node_reads(n) if r]
        if not n.subgraphs and all(r in out for r in reads):
            out.update(o for o in n.outputs if o)
    return out


#: feed-only values a later stage computes again when their nodes read at most these
#: weight bytes and are at most this many (a rotary table's inverse frequencies, yes; an
#: embedding table, no)
AGAIN_WEIGHT_BYTES, AGAIN_NODES = 1 << 16, 256


def _downstream(graph: Graph, seeds: set[str]) -> set[str]:
    """Values computed from any of ``seeds`` (a cache's: activations of the layers)."""
    out = set(seeds)
    for n in graph.nodes:
        if any(r in out for r in node_reads(n)):
            out.update(o for o in n.outputs if o)
    return out


def _cheap(graph: Graph, nodes: list) -> bool:
    weights = {r for n in nodes for r in node_reads(n) if r in graph.initializers}
    return (len(nodes) <= AGAIN_NODES and not any(n.op_type in ("MatMul", "Gemm") for n in nodes)
            and sum(int(graph.initializers[w].nbytes) for w in weights) <= AGAIN_WEIGHT_BYTES)


def _lifetimes(graph: Graph) -> tuple[dict[str, int], dict[str, int]]:
    produced: dict[str, int] = {}
    last_read: dict[str, int] = {}
    for i, n in enumerate(graph.nodes):
        for r in node_reads(n):
            if r in produced:
                last_read[r] = i
        for o in n.outputs:
            if o:
                produced[o] = i
    return produced, last_read


def _best_cut(graph: Graph, lo: int, hi: int, produced: dict[str, int],
              last_read: dict[str, int], constant: set[str], caches: set[str]) -> int:
    """The position in [lo, hi] whose crossing values weigh least (the latest of equals:
    the cut closest to the next layer); never one that carries a cache."""
    best: tuple[float, int] | None = None
    for c in range(lo, hi + 1):
        crossing = [v for v, p in produced.items()
                    if p < c and last_read.get(v, -1) >= c and v not in constant]
        if any(v in caches for v in crossing):
            continue
        cost = sum(_elements(graph, v) for v in crossing)
        if best is None or cost <= best[0]:
            best = (cost, c)
    if best is None:
        raise GenaiError(f"every cut between nodes {lo} and {hi} carries a cache")
    return best[1]


def _elements(graph: Graph, name: str) -> float:
    value = graph.value(name)
    shape = getattr(value, "shape", None)
    if shape is None:
        return 4096.0  # unknown rank: as if large, so a known small cut wins
    total = 1.0
    for d in shape:
        total *= d if isinstance(d, int) else SYMBOL_GUESS
    return total


def _constant_closure(graph: Graph, names: Sequence[str]) -> list:
    """The nodes (in graph order) that compute ``names`` from weights alone."""
    maker = {o: n for n in graph.nodes for o in n.outputs if o}
    want: dict[int, object] = {}
    todo = list(names)
    while todo:
        v = todo.pop()
        n = maker.get(v)
        if n is None or id(n) in want:
            continue
        want[id(n)] = n
        todo.extend(r for r in node_reads(n) if r)
    order = {id(n): i for i, n in enumerate(graph.nodes)}
    return sorted(want.values(), key=lambda n: order[id(n)])
