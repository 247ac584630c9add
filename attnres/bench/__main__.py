"""One process of ``attnres bench NAME --processes N`` (``attnres.bench.spread.launch``):
``python -m attnres.bench NAME CONFIG_JSON OUT_JSON THREADS`` runs the bench at that config and writes
its result to OUT_JSON."""

from __future__ import annotations

import json
import sys

import torch

from attnres.bench import BENCHES
from attnres.files import atomic_write_text


def main(argv: list[str]) -> int:
    name, config, out, threads = argv
    torch.set_num_threads(int(threads))
    bench = BENCHES[name]
    result = bench.run(bench.config(**json.loads(config)))
    atomic_write_text(out, json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
