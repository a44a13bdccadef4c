"""A/B of the two-stage generator in one driver: two pipelines of the same model, the
second's stage actors changed by attribute (``--set name=value``, set through Ray's
``__ray_call__`` after the build) or built with other model options (``--option
name=value``, e.g. the throughput settings), timed in alternating rounds: 4 groups in
flight (tokens/s, as bench_generate_ray's 4-groups figure) and batch-1 decode ms per
token.

On a shared 2-core host one round's tokens/s moves +-15%, so a change of a few percent
shows only as the median of paired ratios and how many rounds each side won; an A/A run
(an attribute no code reads) gives about 1.00 and half the rounds. An experiment gates
its change on a `GenerationStage` attribute and turns it on (or off) in B:

    python bench/ab_generate_ray.py --set unused=1 [--model gpt2_optimum] [--rounds 12]
    python bench/ab_generate_ray.py --option stage_cores="'auto'" --option yield_to_stages=True
    python bench/ab_generate_ray.py --set unused=1 --both stage_cores="'auto'" \
        --both yield_to_stages=True   # (an A/A run under the throughput settings)
"""

from __future__ import annotations

import argparse
import ast
import os
import statistics
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from bench_generate import MODELS, prompt_rows  # noqa: E402
from bench_generate_ray import DEVICES, _tokens_per_s, decode_ms  # noqa: E402

import hetero_exec.genai as hg  # noqa: E402


def _setter(stage: Any, name: str, value: Any) -> None:
    setattr(stage, name, value)


def _paired(runs: dict[str, list[float]]) -> float:
    """The median of the rounds' B/A ratios."""
    return statistics.median([b / a for a, b in zip(runs["A"], runs["B"])])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama_optimum")
    ap.add_argument("--set", metavar="NAME=VALUE",
                    help="a stage attribute of pipeline B (VALUE a Python literal)")
    ap.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                    help="a model option of pipeline B (VALUE a Python literal); repeatable")
    ap.add_argument("--both", action="append", default=[], metavar="NAME=VALUE",
                    help="a model option of both pipelines (e.g. the throughput settings); "
                         "repeatable")
    ap.add_argument("--new", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args()
    if not args.set and not args.option:
        ap.error("give --set or --option: what B changes")
    name, _, literal = (args.set or "").partition("=")
    value = ast.literal_eval(literal) if args.set else None
    options = {k: ast.literal_eval(v) for k, _, v in (o.partition("=") for o in args.option)}
    both = {k: ast.literal_eval(v) for k, _, v in (o.partition("=") for o in args.both)}

    import ray

    path = os.path.join(MODELS, f"{args.model}.onnx")

    def pipeline(**extra: Any) -> Any:
        return hg.Model(path, executor="ray", stages=2, providers=DEVICES,
                        intra_op_num_threads=1, **{**both, **extra})

    a, b = pipeline(), pipeline(**options)
    try:
        if args.set:
            ray.get([s.__ray_call__.remote(_setter, name, value) for s in b.remote.actors])
        prompts = [prompt_rows(1, 32) + i for i in range(4)]
        row = prompt_rows(1, 32)
        for m in (a, b):  # plans bound for every width of the run
            _tokens_per_s(m, prompts, args.new, True, True)
        tps: dict[str, list[float]] = {"A": [], "B": []}
        lat: dict[str, list[float]] = {"A": [], "B": []}
        for i in range(args.rounds):
            for key, m in ((("A", a), ("B", b)) if i % 2 == 0 else (("B", b), ("A", a))):
                tps[key].append(_tokens_per_s(m, prompts, args.new, True, True))
                lat[key].append(decode_ms(m, row, 32))
        won = sum(y > x for x, y in zip(tps["A"], tps["B"]))
        faster = sum(y < x for x, y in zip(lat["A"], lat["B"]))
        changed = ", ".join([f"{name}={value!r}"] * bool(args.set)
                            + [f"{k}={v!r}" for k, v in options.items()])
        common = f" (both: {', '.join(f'{k}={v!r}' for k, v in both.items())})" if both else ""
        print(f"{args.model}, B with {changed}{common}, {args.rounds} alternating rounds:")
        print(f"  4 groups in flight: A {statistics.median(tps['A']):.0f} tok/s, B "
              f"{statistics.median(tps['B']):.0f}; B/A {_paired(tps):.3f} "
              f"(B ahead in {won} rounds)")
        print(f"  batch-1 decode: A {statistics.median(lat['A']):.3f} ms a token, B "
              f"{statistics.median(lat['B']):.3f}; B/A {_paired(lat):.3f} "
              f"(B faster in {faster} rounds)")
    finally:
        a.close()
        b.close()
        if ray.is_initialized():
            ray.shutdown()


if __name__ == "__main__":
    main()
