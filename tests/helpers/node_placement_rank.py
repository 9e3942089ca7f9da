"""One rank of tests/reliability/test_node_placement.py's launch: 4 processes as two "nodes" of 2 on this host, environment as
torchrun sets it (GROUP_RANK, LOCAL_WORLD_SIZE) beside the deepspeed launcher's (CROSS_RANK, LOCAL_SIZE). Tries the
setup under each launcher's variables and prints one JSON line of outcomes. A helper script, not a test file."""
from __future__ import annotations

import json
import os

from ds_tsp.core.config import parse_tsp_config
from ds_tsp.core.errors import TSPConfigError
from ds_tsp.core.parallel.launch import init_from_env
from ds_tsp.core.parallel.runtime import build_runtime


def attempt(block: dict):
    try:
        runtime = build_runtime(parse_tsp_config(block))
    except TSPConfigError as err:
        return ["error", str(err)]
    return ["ok", runtime.layout.tsp, runtime.layout.data]


def main() -> None:
    init_from_env(timeout_s=60)
    out = {}
    # torchrun: GROUP_RANK names the node
    out["torchrun size 4"] = attempt({"size": 4})
    out["torchrun size 2"] = attempt({"size": 2})
    out["torchrun size 4 allowed"] = attempt({"size": 4, "allow_cross_node": True})
    # the deepspeed launcher: CROSS_RANK names the node
    for key in ("GROUP_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(key)
    out["deepspeed size 4"] = attempt({"size": 4})
    out["deepspeed size 2"] = attempt({"size": 2})
    # neither (mp.spawn, a hand-rolled launcher): hostnames, one host here
    os.environ.pop("CROSS_RANK")
    out["hostname size 4"] = attempt({"size": 4})
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
