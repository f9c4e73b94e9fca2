"""A worker that meets a user's mistake on every rank, as `polyshard.trainer.runtime.worker` reports it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from polyshard.trainer.runtime.worker import _first_to_report

if __name__ == "__main__":
    out = Path(sys.argv[1])
    if _first_to_report(out):
        print(f"DataError on rank {os.environ['RANK']}: the data is wrong; fix it", file=sys.stderr, flush=True)
    os._exit(2)
