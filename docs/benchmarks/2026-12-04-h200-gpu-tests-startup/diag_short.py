"""Per-prompt deltas of tests/gpu/test_short_prompt_graphs_gpu.py: decode graphs against eager.

python3 docs/benchmarks/2026-12-04-h200-gpu-tests-startup/diag_short.py
"""

import sys

sys.path.insert(0, "tests/gpu")
from test_short_prompt_graphs_gpu import PROMPTS, outputs  # noqa: E402

graph, eager = outputs(False), outputs(True)
print("history-independent:", graph[0] == graph[2] == graph[4])
for prompt, (gt, gl), (et, el) in zip(PROMPTS, graph, eager, strict=True):
    d = [abs(a - b) for a, b in zip(gl, el, strict=True)]
    print(
        f"prompt len {len(prompt)}: tokens equal {gt == et}; first lp {gl[0]:.6f} vs {el[0]:.6f} "
        f"(d {d[0]:.2e}); max d later {max(d[1:]):.2e}"
    )
