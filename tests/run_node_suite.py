"""Run (a filtered part of) the ONNX backend node suite and print pass/fail with reasons.

    python tests/run_node_suite.py -k test_conv -v
    python tests/run_node_suite.py --providers sim-gpu --require-gpu
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.backend_cases import known_failures, node_cases, run_case  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-k", action="append", default=[], help="substring of case names (repeatable)")
    ap.add_argument("-v", action="store_true", help="print each failure's reason")
    ap.add_argument("--tb", action="store_true", help="print tracebacks")
    ap.add_argument("--providers", default="cpu")
    ap.add_argument("--require-gpu", action="store_true")
    ap.add_argument("--write-known", help="write failing case names to this file")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    cases = node_cases()
    names = sorted(n for n in cases if not args.k or any(k in n for k in args.k))
    passed, failed = [], {}
    t0 = time.time()
    opts = {"require_gpu": True} if args.require_gpu else {}
    for name in names:
        try:
            run_case(cases[name], providers=args.providers.split(","), **opts)
            passed.append(name)
        except Exception as e:  # noqa: BLE001 - report every kind of failure
            msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            failed[name] = msg[:300]
            if args.tb:
                traceback.print_exc()
    if args.v:
        for name, msg in sorted(failed.items()):
            print(f"FAIL {name}: {msg}")
    kinds = collections.Counter(m.split(":")[0] for m in failed.values())
    known = known_failures()
    print(f"{len(passed)} passed, {len(failed)} failed of {len(names)} in {time.time() - t0:.1f}s; "
          f"failure kinds: {dict(kinds)}")
    newly = [n for n in failed if n not in known]
    if known and newly:
        print(f"{len(newly)} failing cases not in the known-failure list")
    if args.write_known:
        with open(args.write_known, "w") as f:
            for name, msg in sorted(failed.items()):
                f.write(f"{name}  # {msg.replace(chr(10), ' ')[:160]}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
