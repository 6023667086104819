"""Stands in for `glm5 worker` in an Ascend worker pod run by the test pod runner (there is no NPU here): waits
for the replica's HCCL rank table exactly as the worker does (its own prepare_rank_table, reading RANK_TABLE_FILE
from the pod's environment and the pod's mounted ConfigMap), prints what it found as one JSON line with the node rank
and rank 0's address its `glm5 worker` arguments give, then idles like a serving worker."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from glm5_worker.parallel.replica import prepare_rank_table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--node-rank", type=int, default=0)
    ap.add_argument("--master-addr")
    args, _ = ap.parse_known_args(sys.argv[2:])  # after `worker`
    named = os.environ.get("RANK_TABLE_FILE")
    table = prepare_rank_table(600.0)
    print(json.dumps({"rank_table_file": named, "table": table, "node_rank": args.node_rank,
                      "master_addr": args.master_addr}), flush=True)  # fmt: skip
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
