"""Imports one module of a package without the package's initialisers and without torch's compiler.

fla's chunked gated delta rule is the one fla function the engine calls, but `from
fla.ops.gated_delta_rule import chunk_gated_delta_rule` first runs `fla/__init__.py` (every fla layer
and model) and `fla/ops/__init__.py` (every fla op), and fla decorates hundreds of functions with
`torch.compiler.disable` and `torch.compile`, which import torch's compiler (dynamo, inductor, sympy)
on their first use. That is 2.5 s of CPU against 0.6 s for the kernel's own modules (one CPU core,
fla-core 0.6.0, torch 2.13), paid by the first prefill forward of every start-up.

`import_narrowly(module, packages)` imports `module` with each of `packages` (its enclosing packages,
outermost first) standing as a plain package over its own directory, with the real package's spec and
version, whose `__init__.py` does not run; its submodules import as usual, and its initialiser runs
the first time a name it would have defined is asked for (`from fla.ops import chunk_gla` elsewhere in
the process gets what the ordinary import gives). While it imports,
`torch.compile` and `torch.compiler.disable` return the function they decorate: the engine never
compiles, and outside a compilation a disabled function runs as itself.

Where a package is already imported (by the caller's own import of fla, say), or the narrow import
fails (another layout of the package), the module is imported the ordinary way, after the package's
modules of the narrow attempt leave `sys.modules`.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import logging
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)


def import_narrowly(
    module: str, packages: Sequence[str], distribution: str | None = None
) -> types.ModuleType:
    """`module`, imported with `packages` standing as plain packages (module docstring); `distribution`:
    the installed distribution whose version the outermost package reports as `__version__`."""
    if module in sys.modules or any(p in sys.modules for p in packages):
        return importlib.import_module(module)
    top = packages[0]
    try:
        with _compiler_decorators_as_identity():
            for name in packages:
                sys.modules[name] = _plain_package(name, distribution if name == top else None)
            return importlib.import_module(module)
    except Exception:
        # The package's modules go (their packages were the plain ones); what else the attempt
        # imported stays, as an ordinary import would have left it.
        for name in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
            del sys.modules[name]
        logger.warning("importing %s narrowly failed; importing it with its packages", module, exc_info=True)
        return importlib.import_module(module)


def _plain_package(name: str, distribution: str | None) -> types.ModuleType:
    """A package over `name`'s own directory and spec, whose __init__ has not run."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"{name} is not an installed package")
    package = types.ModuleType(name)
    package.__spec__ = spec
    package.__path__ = list(spec.submodule_search_locations)
    package.__file__ = spec.origin
    package.__package__ = name
    if distribution is not None:
        package.__version__ = importlib.metadata.version(distribution)

    def initialise_on_demand(attribute: str) -> Any:
        """PEP 562: a name the package lacks runs its initialiser (once) into it, then is looked up."""
        if attribute.startswith("__") or spec.loader is None:
            raise AttributeError(f"module {name!r} has no attribute {attribute!r}")
        del package.__getattr__
        spec.loader.exec_module(package)
        return getattr(package, attribute)

    package.__getattr__ = initialise_on_demand
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, package)
    return package


def _identity(fn: Callable[..., Any] | None = None, *args: Any, **kwargs: Any) -> Any:
    """A compiler decorator that does nothing: `@decorator` and `@decorator(...)` both give `fn` back."""
    return fn if callable(fn) else lambda f: f


@contextlib.contextmanager
def _compiler_decorators_as_identity() -> Iterator[None]:
    compile_, disable = torch.compile, torch.compiler.disable
    torch.compile, torch.compiler.disable = _identity, _identity
    try:
        yield
    finally:
        torch.compile, torch.compiler.disable = compile_, disable
