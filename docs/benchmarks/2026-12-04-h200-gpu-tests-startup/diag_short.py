import sys
sys.path.insert(0, "tests/gpu")
from test_short_prompt_graphs_gpu import PROMPTS, outputs

graph, eager = outputs(False), outputs(True)
print("history-independent:", graph[0] == graph[2] == graph[4])
for prompt, (gt, gl), (et, el) in zip(PROMPTS, graph, eager):
    d = [abs(a - b) for a, b in zip(gl, el)]
    print(f"prompt len {len(prompt)}: tokens equal {gt == et}; first lp {gl[0]:.6f} vs {el[0]:.6f} "
          f"(d {d[0]:.2e}); max d later {max(d[1:]):.2e}")
