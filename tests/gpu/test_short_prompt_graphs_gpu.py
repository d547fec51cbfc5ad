"""One-token prompts run in the decode graphs (their TTFT is a decode step, not an eager prefill).

The graph path must clear the state slot first (eager starts a prompt from zeros whatever the slot
holds): the same one-token prompt gives bit-identical outputs whichever longer request used its slot
before. Against eager, every prompt gives the same tokens. The log-probs of a one-token prompt compare
the decode kernels (fp32 dots) with fla's chunked kernel (its dots round through tf32, a 10-bit
mantissa), and a random model carries that difference through its 12 steps: measured on an H200 with
the embedded checkpoint, 2.0e-3 and 3.8e-3 on the prompt's forward and up to 4.3e-2 on later steps,
hence bounds of 1e-2 and 1e-1. Longer prompts take fla in both runs: measured within 6.4e-5, bound
1e-3."""

from __future__ import annotations

import pytest
import torch

from deltaserve.engine.llm import LLM
from deltaserve.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# One slot (max_num_seqs=1), reused by every prompt in turn; [7] follows different histories.
PROMPTS = ([7], [5] * 40, [7], list(range(30, 60)), [7], [11])


def outputs(enforce_eager: bool) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    engine = {"dtype": "float32", "max_num_seqs": 1, "max_model_len": 256, "enforce_eager": enforce_eager}
    with LLM(None, **engine) as llm:
        out = []
        for prompt in PROMPTS:
            (result,) = llm.generate([{"prompt_token_ids": prompt}], params)
            c = result.outputs[0]
            out.append((list(c.token_ids), [lp.logprob for lp in c.logprobs]))
        return out


def test_one_token_prompts_in_the_decode_graphs_equal_eager():
    graph, eager = outputs(False), outputs(True)
    assert graph[0] == graph[2] == graph[4], "a one-token prompt's output depends on its slot's history"
    for prompt, (g_tokens, g_lp), (e_tokens, e_lp) in zip(PROMPTS, graph, eager, strict=True):
        first, later = (1e-2, 1e-1) if len(prompt) == 1 else (1e-3, 1e-3)
        assert g_tokens == e_tokens, prompt
        assert g_lp[0] == pytest.approx(e_lp[0], abs=first), (prompt, g_lp, e_lp)
        assert g_lp == pytest.approx(e_lp, abs=later), (prompt, g_lp, e_lp)
