"""The one mapping from an activation (a fused op's ``activation`` attribute and its
parameters) to the C kernels' arguments: `activation_args`.

Every C kernel that ends in an activation takes it as ``(code, p0, p1)``: a code of
kernels.h's ``ACT_*`` enum and two parameters (Clip's bounds, HardSigmoid's alpha and
beta). The packed products' store (gemm.c, conv.c, depthwise.c) applies only none, Relu
and Clip as it writes a tile (``store_only``); act.c applies every one here, in a pass
of its own. The library checks these codes against kernels.h's when it loads
(library._codes_differ).
"""

from __future__ import annotations

from typing import Any, NamedTuple

#: kernels.h's ACT_* codes, one per activation of kernels/fused.py; in float32, erf GELU
#: runs on a rational erf, and tanh GELU, SiLU, Sigmoid and Tanh on a rational tanh (act.c)
ACT_CODES = {"": 0, "Relu": 1, "Clip": 2, "HardSigmoid": 3, "HardSwish": 4, "Gelu": 8,
             "GeluTanh": 9, "SiLU": 10, "Sigmoid": 11, "Tanh": 12}
#: (min, max) / (alpha, beta) when an activation comes without its parameters
ACT_DEFAULTS = {"Clip": (float("-inf"), float("inf")), "HardSigmoid": (0.2, 0.5),
                "HardSwish": (1.0 / 6.0, 0.5)}
#: the activations the packed products' store applies as it writes a tile
STORE_ACTIVATIONS = frozenset({"", "Relu", "Clip"})


class ActivationArgs(NamedTuple):
    """An activation as the C kernels take it."""
    code: int
    p0: float
    p1: float


#: no activation
NO_ACTIVATION = ActivationArgs(0, 0.0, 0.0)


def activation_args(activation: Any, params=None, *,
                    store_only: bool = False) -> ActivationArgs | None:
    """``activation`` as the C kernels' (code, p0, p1), or None when they lack it (or,
    with ``store_only``, when the packed store cannot apply it). ``activation`` is a name
    ("", "Relu", "Gelu", ...) with ``params`` (or the defaults), or fused.py's
    epilogue_activation callable, which carries both.

    >>> activation_args("Clip", (0.0, 6.0))
    ActivationArgs(code=2, p0=0.0, p1=6.0)
    >>> activation_args("Gelu", store_only=True) is None, activation_args("Gelu").code
    (True, 8)
    """
    if not isinstance(activation, str):
        name = getattr(activation, "activation", None)
        if name is None:
            return None
        activation, params = name, activation.params
    code = ACT_CODES.get(activation)
    if code is None or (store_only and activation not in STORE_ACTIVATIONS):
        return None
    p0, p1 = params if params else ACT_DEFAULTS.get(activation, (0.0, 0.0))
    return ActivationArgs(code, float(p0), float(p1))
