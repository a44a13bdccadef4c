"""Generation over a 3-node ray.cluster_utils.Cluster, in its own process: a CPU head and
two workers with one logical GPU each, so the two stages of a decoder (sim-gpu:0 and
sim-gpu:1, each reserving a GPU) run on different nodes and the ring crosses between
them; then a deeper decoder over three stages on those two nodes. Tokens are compared
with the in-process generator. Prints one JSON line.

Run by tests/ray/test_genai_ray.py; also by hand: ``python -m tests.ray.genai_multinode_main``.
"""

from __future__ import annotations

import json
import os
import sys
import time

import ray
from ray.cluster_utils import Cluster

import hetero_exec.genai as og
from tests.genai._ref import model_path, prompts


def _generate(model: og.Model, rows: list, new: int = 8) -> list:
    params = og.GeneratorParams(model)
    params.set_search_options(batch_size=len(rows), max_length=max(map(len, rows)) + new)
    with og.Generator(model, params) as gen:
        gen.append_tokens(rows)
        while not gen.is_done():
            gen.generate_next_token()
        return [[int(t) for t in gen.get_sequence(i)[len(r):]] for i, r in enumerate(rows)]


def main() -> int:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    started = time.monotonic()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "num_gpus": 0, "include_dashboard": False,
        "object_store_memory": 256 << 20})
    for _ in range(2):
        cluster.add_node(num_cpus=1, num_gpus=1, object_store_memory=256 << 20)
    ray.init(address=cluster.address, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": root}})
    cluster.wait_for_nodes()
    report: dict = {"nodes": len([n for n in ray.nodes() if n["Alive"]])}
    try:
        model = og.Model(model_path("qwen2", "optimum"), executor="ray", stages=2,
                         providers=["sim-gpu:0", "sim-gpu:1"])
        try:
            info = ray.get([a.info.remote() for a in model.remote.actors])
            report["stage_nodes"] = len({i["node"] for i in info})
            head = ray.get_runtime_context().get_node_id()
            report["on_head"] = sum(i["node"] == head for i in info)
            local = og.Model(model_path("qwen2", "optimum"), providers=["sim-gpu"])
            rows = prompts(2, seed=4)
            report["match"] = _generate(model, rows) == _generate(local, rows)
            # continuous batching across nodes: joins by Ray calls, acks by the polls
            from actors.generation.batcher import ContinuousBatcher, wait_all

            reqs = [(r, n) for r, n in zip(prompts(4, seed=9), (4, 9, 5, 6))]
            with ContinuousBatcher(model, slots=2, max_length=40, groups_in_flight=1) as batcher:
                got = wait_all([batcher.submit(r, n) for r, n in reqs])
                report["batcher_joins"] = batcher.stats()["joins"]
            report["batcher_match"] = got == [_generate(local, [r], n)[0] for r, n in reqs]
            report["stats"] = model.remote.stats()
            report["sockets"] = model.remote.sockets  # the hops cross nodes: Ray calls
        finally:
            model.close()
        # a 4-layer decoder over 3 stages on the 2 GPU nodes: stages 0 and 2 share one
        # (a socket hop between them), the other hops cross nodes (Ray calls), and the
        # rotary tables go from stage 0 through stage 1 to stage 2
        deep = og.Model(model_path("llama4", "optimum"), executor="ray", stages=3,
                        providers=["sim-gpu:0", "sim-gpu:1"])
        try:
            info = ray.get([a.info.remote() for a in deep.remote.actors])
            report["deep_nodes"] = [i["node"] for i in info]
            rows = prompts(2, seed=6)
            local = og.Model(model_path("llama4", "optimum"), providers=["sim-gpu"])
            report["deep_match"] = _generate(deep, rows) == _generate(local, rows)
            report["deep_sockets"] = deep.remote.sockets
        finally:
            deep.close()
    finally:
        ray.shutdown()
        cluster.shutdown()
    report["seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
