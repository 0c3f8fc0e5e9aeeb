"""One row of `supermem bench frag` in this process (no worker), for `supermem trace` to record:

    SUPERMEM=1 SUPERMEM_CONF=pool:cost_aware,budget:10GiB,expandable_segments:true \
        supermem trace -o gpt.smtrace -- tools/diag/frag_step.py gpt 6 [chunked]
    python3 tools/diag/alloc_replay.py gpt.smtrace
"""

import json
import sys

from supermem.bench.frag import _spec, measure

workload, steps, loss = sys.argv[1], int(sys.argv[2]), (sys.argv[3:] or ["plain"])[0]
row = measure(dict(_spec(workload, steps, False), allocator="supermem", loss=loss))
print(json.dumps({k: v for k, v in row.items() if not isinstance(v, dict)}))
