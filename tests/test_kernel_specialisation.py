"""No Triton kernel of deltaserve specialises on a per-step integer (read from the source, so the check
holds under the CPU interpreter too). Triton compiles a variant per class of an integer argument (1, a
multiple of 16, other) unless the argument is in `do_not_specialize`: a batch size met for the first
time while serving would stall every running request for a compile."""

from __future__ import annotations

import ast
from pathlib import Path

import deltaserve.ops.triton as kernels

# Arguments whose values change from step to step (batch composition), wherever a kernel takes them.
PER_STEP = {"num_tokens", "num_seqs", "num_decodes", "num_splits", "search_steps", "first_row", "first_seq"}


def _jit_kernels(path: Path) -> list[tuple[str, set[str], set[str]]]:
    """(name, argument names, do_not_specialize) of each @triton.jit function of a module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.FunctionDef):
            continue
        for deco in node.decorator_list:
            target = deco.func if isinstance(deco, ast.Call) else deco
            if ast.unparse(target) != "triton.jit":
                continue
            kept: set[str] = set()
            for kw in deco.keywords if isinstance(deco, ast.Call) else []:
                if kw.arg == "do_not_specialize":
                    kept = {ast.literal_eval(e) for e in kw.value.elts}
            found.append((node.name, {a.arg for a in node.args.args}, kept))
    return found


def test_kernels_taking_per_step_integers_never_specialise_on_them():
    checked = 0
    for path in sorted(Path(kernels.__file__).parent.glob("*.py")):
        for name, args, kept in _jit_kernels(path):
            taken = args & PER_STEP
            # Helpers called from a kernel get tensors, not launch arguments: only launched kernels count,
            # and those are the ones named *_kernel.
            if taken and name.endswith("_kernel"):
                checked += 1
                assert taken <= kept, f"{path.name}:{name} specialises on {sorted(taken - kept)}"
    assert checked >= 4  # the varlen conv1d, attention and GDN verify kernels at least
