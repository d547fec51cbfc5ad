"""Test-wide set-up. Without CUDA, Triton kernels run in Triton's CPU interpreter, so kernel logic is
tested in CI too; this must happen before any kernel module is imported (decoration time)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Imported whole here, on the main thread: an EngineCore imports xgrammar (and through it transformers)
# on a background thread, and a test that imports transformers while that import is half done gets
# the half-initialised package (`from transformers import Qwen3_5ForCausalLM` then fails).
import transformers  # noqa: E402, F401


def _interpreter_accepts_tensor_loop_bounds() -> None:
    """Triton 3.6's interpreter turns a tensor loop bound into int(ndarray of shape (1,)), which numpy >= 2.4
    rejects (triton-lang/triton#9171). Applies the upstream fix to this process; compiled kernels are
    unaffected."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch_tensor = interpreter._patch_lang_tensor
    if getattr(patch_tensor, "accepts_tensor_loop_bounds", False):
        return

    def patched(tensor: type, scope: object) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.accepts_tensor_loop_bounds = True
    interpreter._patch_lang_tensor = patched


_interpreter_accepts_tensor_loop_bounds()
