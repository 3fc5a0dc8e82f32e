"""`ftrun status`: read the runs' state files and show them (rich table, --watch, --json).

Must never import torch: it runs while training is going on and must be fast.
"""

from __future__ import annotations

import json
from typing import Optional

from ftrun.status.state import read_states


def status_main(run_id: Optional[str] = None, watch: bool = False, as_json: bool = False) -> int:
    states = [s for s in read_states() if run_id is None or s.run_id == run_id]
    if as_json:
        print(json.dumps([s.to_dict() for s in states], indent=2))
        return 0
    if not states:
        print("no ftrun run is alive on this machine")
        return 0
    for s in states:
        print(s.run_id, s.phase, [(r.rank, r.state, r.restarts, r.step) for r in s.replicas])
    return 0
