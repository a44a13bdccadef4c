"""``ray start`` for a node that listens on this host's loopback address only.

    python cluster/ray_node.py --head --block --node-ip-address=127.0.0.1 --port=6390 ...

Ray's CLI rewrites ``--node-ip-address=127.0.0.1`` into the host's routable address
(``resolve_ip_for_localhost``, so that other machines can reach the node), and every
server of the node (GCS, raylet, object manager, agents, workers) then listens on that
address. On one machine nobody else needs to reach it, so this wrapper keeps the
loopback address as given; the node's servers then bind 127.0.0.1. Its children
(and drivers that export what ``local_cluster.sh`` prints) resolve the loopback address
to itself too, through ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, which makes Ray's own
``get_node_ip_address`` answer 127.0.0.1 (it is read once, at import, so this process,
which may start a worker node, keeps the default).
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    from ray._private import services
    from ray.scripts.scripts import main as ray_main

    resolve = services.resolve_ip_for_localhost

    def keep_loopback(host: str) -> str:
        return host if host in ("127.0.0.1", "localhost") else resolve(host)

    services.resolve_ip_for_localhost = keep_loopback
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # for the node's children
    sys.argv = ["ray", "start", *sys.argv[1:]]
    ray_main()


if __name__ == "__main__":
    main()
