"""hetero-exec: run | plan | demo | serve.

    hetero-exec run model.onnx --input x=x.npy --providers sim-gpu,cpu --hetero
    hetero-exec run model.onnx --random-inputs --dim N=4
    hetero-exec plan model.onnx --providers sim-gpu:0,sim-gpu:1,cpu --hetero --json p.json --dot p.dot
    hetero-exec demo [--executor local|ray]
    hetero-exec serve model.onnx --providers sim-gpu,cpu --hetero --port 8000
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from typing import Any, Sequence

import numpy as np

from hetero_exec.errors import HeteroExecError

log = logging.getLogger("hetero_exec.cli")


def _providers(text: str | None) -> list[str] | None:
    return [p.strip() for p in text.split(",") if p.strip()] if text else ["cpu"]


def _dims(items: Sequence[str]) -> dict[str, int]:
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        if not value.isdigit():
            raise SystemExit(f"--dim expects NAME=INT, got {item!r}")
        out[name] = int(value)
    return out


def _session_options(args: argparse.Namespace) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    if getattr(args, "hetero", False):
        opts["hetero"] = True
    if getattr(args, "require_gpu", False):
        opts["require_gpu"] = True
    if getattr(args, "strategy", None):
        opts["strategy"] = args.strategy
    if getattr(args, "dim", None):
        opts["dim_bounds"] = _dims(args.dim)
    if getattr(args, "executor", None):
        opts["executor"] = args.executor
    if getattr(args, "stages", None) is not None:
        opts["stages"] = args.stages
    if getattr(args, "stage_layers", None):
        opts["stage_layers"] = args.stage_layers
    if getattr(args, "stage_spin_ms", None) is not None:
        opts["stage_spin_ms"] = args.stage_spin_ms
    if getattr(args, "stage_cores", None):
        opts["stage_cores"] = args.stage_cores
    return opts


def _token_ids(text: str) -> list[int]:
    """``--prompt-ids "5 6 7"``: the prompt's token ids."""
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects token ids such as \"5 6 7\", got {text!r}") \
            from None


def _layer_counts(text: str) -> list[int]:
    """``--stage-layers 3,1``: each stage's layer count."""
    from hetero_exec.genai.config import parse_layer_counts

    try:
        return parse_layer_counts(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def random_feed(sess, dims: dict[str, int], seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs for every declared input; symbolic dims from ``dims`` (default 1)."""
    rng = np.random.default_rng(seed)
    feed = {}
    for arg in sess.get_inputs():
        v = sess.graph.value(arg.name)
        shape = tuple(d if isinstance(d, int) else dims.get(d, 1) if isinstance(d, str) else 1
                      for d in (v.shape or ()))
        dt = v.dtype or np.dtype(np.float32)
        if dt.kind == "f":
            feed[arg.name] = rng.standard_normal(shape).astype(dt)
        elif dt.kind in "iu":
            feed[arg.name] = rng.integers(0, 4, shape).astype(dt)
        elif dt.kind == "b":
            feed[arg.name] = rng.integers(0, 2, shape).astype(bool)
        else:
            raise SystemExit(f"--random-inputs cannot make input {arg.name!r} of dtype {dt}")
    return feed


def _summary(name: str, v: Any) -> str:
    if isinstance(v, np.ndarray):
        if v.size and v.dtype.kind in "fiub":
            return (f"{name}: {v.dtype}{list(v.shape)} min={v.min():.4g} max={v.max():.4g} "
                    f"mean={v.astype(np.float64).mean():.4g}")
        return f"{name}: {v.dtype}{list(v.shape)}"
    return f"{name}: {type(v).__name__}"


def cmd_run(args: argparse.Namespace) -> int:
    from hetero_exec import InferenceSession

    sess = InferenceSession(args.model, providers=_providers(args.providers), **_session_options(args))
    feed: dict[str, Any] = random_feed(sess, _dims(args.dim or [])) if args.random_inputs else {}
    for item in args.input or []:
        name, _, path = item.partition("=")
        feed[name] = np.load(path, allow_pickle=False)
    t = time.perf_counter()
    outs = sess.run_outputs(None, feed)
    dt = time.perf_counter() - t
    print(f"ran {args.model} on {', '.join(sess.get_providers())} in {dt * 1e3:.2f} ms")
    if sess.fallback_report is not None:
        print(f"fallback: {sess.fallback_report}")
    for out, value in zip(sess.graph.outputs, outs):
        print("  " + _summary(out, value))
        if args.save:
            np.save(f"{args.save}{out}.npy", value)
    sess.close()
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from hetero_exec import InferenceSession

    sess = InferenceSession(args.model, providers=_providers(args.providers), **_session_options(args))
    plan = sess.placement
    print(plan.report())
    if sess.fallback_report is not None:
        print(f"fallback: {sess.fallback_report}")
    if args.json:
        plan.to_json(args.json)
        print(f"wrote {args.json}")
    dot = plan.to_dot()
    if args.dot:
        with open(args.dot, "w") as f:
            f.write(dot)
        print(f"wrote {args.dot}")
    if args.svg:
        exe = shutil.which("dot")
        if exe is None:
            print("graphviz 'dot' is not installed: no SVG written (use --dot and render elsewhere)")
            return 1
        subprocess.run([exe, "-Tsvg", "-o", args.svg], input=dot.encode(), check=True)
        print(f"wrote {args.svg}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from hetero_exec import InferenceSession
    from hetero_exec.demo import demo_inputs, detector_model

    model = detector_model()
    feed = demo_inputs(batch=args.batch)
    print("hetero_exec demo: a tiny detector (conv backbone + NonMaxSuppression post-processing)")
    fallback = InferenceSession(model, providers=["sim-gpu", "cpu"])
    print(f"\n1) default: whole-session fallback\n   providers in use: {fallback.get_providers()}\n"
          f"   report: {fallback.fallback_report}")
    # the batch bound lets the plan count seam bytes for the symbolic batch dim
    opts: dict[str, Any] = {"hetero": True, "executor": args.executor, "dim_bounds": {"N": args.batch}}
    if args.executor == "ray":
        opts["enable_profiling"] = True
    print(f"\n2) hetero=True, executor={args.executor!r}")
    with InferenceSession(model, providers=["sim-gpu", "cpu"], **opts) as sess:
        print("   " + sess.placement.report().replace("\n", "\n   "))
        outs = sess.run(None, feed)
        t = time.perf_counter()
        for _ in range(args.runs):
            outs = sess.run(None, feed)
        per_run = (time.perf_counter() - t) / max(args.runs, 1)
        ref = fallback.run(None, feed)
        same = all(np.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(outs, ref))
        print(f"\n   {args.runs} runs, {per_run * 1e3:.2f} ms per run; matches the cpu session: {same}")
        timings = getattr(sess._executor, "segment_timings", None)
        if callable(timings):
            for line in timings():
                print(f"   {line}")
        for name, v in zip(sess.graph.outputs, outs):
            print("   " + _summary(name, v))
        trace = sess.end_profiling()
        if trace:
            print(f"   chrome trace: {trace}")
    return 0 if same else 1


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve over the Open Inference Protocol until SIGINT/SIGTERM (needs the serve extra)."""
    try:
        from actors.serve import serve_forever  # the Ray layer, imported only here
    except ImportError as e:
        print(f"error: hetero-exec serve needs Ray Serve (pip install 'hetero_exec[serve]'): {e}",
              file=sys.stderr)
        return 2
    opts = _session_options(args)
    kwargs: dict[str, Any] = {"providers": _providers(args.providers), "name": args.name,
                              "num_replicas": args.replicas, "max_batch_size": args.max_batch_size,
                              "batch_wait_timeout_s": args.batch_wait_timeout_s,
                              "batch_slots": args.batch_slots}
    return serve_forever(args.model, host=args.host, port=args.port, address=args.address,
                         **kwargs, **opts)


def cmd_generate(args: argparse.Namespace) -> int:
    import hetero_exec.genai as og

    opts = _session_options(args)
    providers = _providers(args.providers)
    config = og.Config(args.model)
    _check_text_options(args, config.folder)  # before the model (and any stage actor)
    model = og.Model(config, **({"providers": providers} if providers else {}), **opts)
    search = {"do_sample": args.do_sample, "top_k": args.top_k, "top_p": args.top_p,
              "temperature": args.temperature, "random_seed": args.seed}
    try:
        t = time.perf_counter()
        if args.prompt is None:
            ids = args.prompt_ids
            seq = og.generate(model, [ids], max_new_tokens=args.max_new_tokens, **search)[0]
            new = [int(x) for x in seq[len(ids):]]
            print(" ".join(map(str, new)))
        else:
            new = _stream_text(og, model, _chat(args), args.max_new_tokens, search)
        dt = time.perf_counter() - t
    finally:
        model.close()  # the stage actors, on executor="ray"
    where = ", ".join(model.providers)
    if model.remote is not None:
        where = f"{len(model.providers)} stage actors on {where}"
    print(f"{len(new)} tokens in {dt * 1e3:.1f} ms on {where}", file=sys.stderr)
    return 0


def _check_text_options(args: argparse.Namespace, folder: str) -> None:
    from hetero_exec.genai.chat_template import folder_template
    from hetero_exec.genai.errors import GenaiError

    if args.system is not None and not args.chat:
        raise GenaiError("--system is a turn of a chat: give --chat too")
    if args.chat and args.prompt is None:
        raise GenaiError("--chat makes a chat template's prompt from text: give --prompt")
    if args.prompt is not None and not os.path.exists(os.path.join(folder, "tokenizer.json")):
        raise GenaiError(f"--prompt needs a tokenizer.json beside the model ({folder} has "
                         "none): give --prompt-ids instead")
    if args.chat and folder_template(folder) is None:
        raise GenaiError(f"--chat needs the folder's chat template (tokenizer_config.json's "
                         f"chat_template, or chat_template.jinja); {folder} has none")


def _chat(args: argparse.Namespace) -> list[dict[str, str]] | str:
    """``--prompt``'s text, or with ``--chat`` the turns the chat template is applied to."""
    if not args.chat:
        return args.prompt
    turns = [] if args.system is None else [{"role": "system", "content": args.system}]
    return turns + [{"role": "user", "content": args.prompt}]


def _stream_text(og: Any, model: Any, prompt: str | list[dict[str, str]], max_new_tokens: int,
                 search: dict[str, Any]) -> list[int]:
    """``--prompt``: the text (or ``--chat``'s turns through the folder's chat template) by
    the folder's tokenizer, the new text written to stdout as each token comes
    (onnxruntime-genai's examples' loop); returns the new ids."""
    tokenizer = og.Tokenizer(model)
    stream = tokenizer.create_stream()
    if not isinstance(prompt, str):
        prompt = tokenizer.apply_chat_template(json.dumps(prompt), add_generation_prompt=True)
    ids = tokenizer.encode(prompt)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + max_new_tokens, **search)
    new: list[int] = []
    with og.Generator(model, params) as gen:
        gen.append_tokens(ids[None, :])
        while not gen.is_done():
            gen.generate_next_token()
            new.append(int(gen.get_next_tokens()[0]))
            sys.stdout.write(stream.decode(new[-1]))
            sys.stdout.flush()
    print()
    return new


def cmd_info(args: argparse.Namespace) -> int:
    from hetero_exec.runtime_info import show_runtime

    show_runtime()
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hetero-exec", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="cmd", required=True)

    def placement_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--providers", help="comma-separated, in preference order (default cpu)")
        p.add_argument("--hetero", action="store_true", help="opt in to mixed placement")
        p.add_argument("--require-gpu", action="store_true")
        p.add_argument("--strategy", choices=["greedy", "balanced", "memory"])
        p.add_argument("--dim", action="append", help="symbolic dim bound NAME=INT (repeatable)")
        p.add_argument("--executor", choices=["local", "ray"])
        p.add_argument("--stages", type=int,
                       help="pipeline stages (with --executor ray; a decoder generating or "
                            "served: its layers split over that many stage actors)")

    def stage_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--stage-layers", type=_layer_counts,
                       help="a decoder on stage actors: each stage's layer count, such as 3,1 "
                            "(default: even, the last stage taking no more than the others)")
        p.add_argument("--stage-spin-ms", type=float,
                       help="a decoder on stage actors: how long a stage may poll for its next "
                            "step before it sleeps (default: 5 where a node has a core "
                            "beyond its stages, else 0: off)")
        p.add_argument("--stage-cores", choices=["os", "auto"],
                       help="a decoder on stage actors: 'auto' pins each stage's process to "
                            "its own cores; 'os' leaves them to the OS, one group or several "
                            "(default: the OS, but one group's stages step on one core where "
                            "a node has no core beyond its stages)")

    r = sub.add_parser("run", help="run a model")
    r.add_argument("model")
    r.add_argument("--input", action="append", help="NAME=FILE.npy (repeatable)")
    r.add_argument("--random-inputs", action="store_true")
    r.add_argument("--save", help="prefix for writing outputs as .npy")
    placement_args(r)
    r.set_defaults(fn=cmd_run)

    p = sub.add_parser("plan", help="show (and save) a model's placement plan")
    p.add_argument("model")
    p.add_argument("--json")
    p.add_argument("--dot")
    p.add_argument("--svg")
    placement_args(p)
    p.set_defaults(fn=cmd_plan)

    d = sub.add_parser("demo", help="run the built-in demo model with sim-gpu + cpu placement")
    d.add_argument("--executor", choices=["local", "ray"], default="ray")
    d.add_argument("--batch", type=int, default=2)
    d.add_argument("--runs", type=int, default=20)
    d.set_defaults(fn=cmd_demo)

    g = sub.add_parser("generate", help="generate tokens with a decoder (.onnx or a genai folder)")
    g.add_argument("model")
    prompt = g.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt-ids", type=_token_ids,
                        help="token ids, space or comma separated; the new ids are printed")
    prompt.add_argument("--prompt", help="text, through the tokenizer.json beside the model; "
                                         "the new text is written as it is made")
    g.add_argument("--chat", action="store_true",
                   help="with --prompt: the text is a user's turn, made a prompt by the "
                        "folder's chat template (onnxruntime-genai's model-qa example)")
    g.add_argument("--system", help="with --chat: a system turn before the user's")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--do-sample", action="store_true")
    g.add_argument("--top-k", type=int, default=50)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=-1)
    placement_args(g)
    stage_args(g)
    g.set_defaults(fn=cmd_generate)

    s = sub.add_parser("serve", help="serve a model over the Open Inference Protocol (Ray Serve); "
                                     "a decoder through Triton's generate extension")
    s.add_argument("model", help="an .onnx, or a decoder: a genai folder or an .onnx with a "
                                 "key/value cache (served at /generate and /generate_stream)")
    s.add_argument("--name", help="the model's name in the protocol (default: the file's stem)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--replicas", type=int, default=1)
    s.add_argument("--max-batch-size", type=int, default=32, help="rows per batch (1: off)")
    s.add_argument("--batch-wait-timeout-s", type=float, default=0.0)
    s.add_argument("--address", help="a Ray cluster to join (default: start a local Ray)")
    s.add_argument("--batch-slots", type=int, default=4,
                   help="a decoder on stage actors (--executor ray --stages N): rows a running "
                        "group shares by continuous batching (0: a generator a request)")
    placement_args(s)
    stage_args(s)
    s.set_defaults(fn=cmd_serve)

    i = sub.add_parser("info", help="what a run will use: the C kernels' variant, the BLAS, "
                                    "the GPU")
    i.set_defaults(fn=cmd_info)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.fn(args)
    except HeteroExecError as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
