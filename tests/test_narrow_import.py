"""A module imported narrowly (deltaserve/ops/triton/narrow_import.py), on a package made for the test:
its packages' initialisers do not run, its compiler decorators are identities while it imports (torch's
compiler is never imported), and where the narrow import cannot be made the ordinary import is."""

from __future__ import annotations

import importlib
import importlib.metadata
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from deltaserve.ops.triton.narrow_import import import_narrowly

PACKAGE = "narrowpkg"
INITIALISER = "import narrowpkg_marker\nnarrowpkg_marker.ran.append(__name__)\n"
KERNEL = textwrap.dedent(
    """
    import torch
    from narrowpkg.ops.util import helper

    @torch.compiler.disable
    def disabled(x):
        return helper(x) + 1

    @torch.compile
    def compiled(x):
        return x * 2

    @torch.compile(fullgraph=True)
    def compiled_with_options(x):
        return x * 3
    """
)


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """narrowpkg/{__init__, ops/__init__ (initialisers that record they ran), ops/util, ops/kern/{__init__,
    impl}}; returns the record."""
    root = tmp_path / PACKAGE
    (root / "ops" / "kern").mkdir(parents=True)
    (root / "__init__.py").write_text(INITIALISER)
    (root / "ops" / "__init__.py").write_text(INITIALISER + "EXPORTED = 1\n")
    (root / "ops" / "util.py").write_text("def helper(x):\n    return x\n")
    (root / "ops" / "kern" / "__init__.py").write_text(
        "from .impl import compiled, compiled_with_options, disabled\n"
    )
    (root / "ops" / "kern" / "impl.py").write_text(KERNEL)
    (tmp_path / "narrowpkg_marker.py").write_text("ran = []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.split(".")[0] in (PACKAGE, "narrowpkg_marker")]:
        monkeypatch.delitem(sys.modules, name)
    yield importlib.import_module("narrowpkg_marker").ran
    for name in [m for m in sys.modules if m.split(".")[0] in (PACKAGE, "narrowpkg_marker")]:
        del sys.modules[name]


def test_the_module_imports_without_its_packages_initialisers_and_compiler_decorators(package):
    compile_, disable = torch.compile, torch.compiler.disable
    kern = import_narrowly("narrowpkg.ops.kern", ("narrowpkg", "narrowpkg.ops"), "torch")
    assert package == []  # neither initialiser ran
    assert torch.compile is compile_ and torch.compiler.disable is disable  # restored
    assert not hasattr(kern.disabled, "__wrapped__") and kern.disabled(1) == 2  # the function itself
    assert kern.compiled(2) == 4 and kern.compiled_with_options(2) == 6
    outer = sys.modules["narrowpkg"]
    assert outer.__version__ == importlib.metadata.version("torch")
    assert outer.ops is sys.modules["narrowpkg.ops"] and outer.__spec__.name == "narrowpkg"
    # Later imports of the same names find what the narrow import left.
    assert import_narrowly("narrowpkg.ops.kern", ("narrowpkg", "narrowpkg.ops")) is kern
    # A name only the initialiser defines runs it, once, into the same package.
    from narrowpkg.ops import EXPORTED

    assert EXPORTED == 1 and package == ["narrowpkg.ops"]
    assert sys.modules["narrowpkg.ops"].EXPORTED == 1 and package == ["narrowpkg.ops"]
    with pytest.raises(AttributeError):
        sys.modules["narrowpkg.ops"].NOT_DEFINED  # noqa: B018


def test_a_package_already_imported_takes_the_ordinary_import(package):
    importlib.import_module("narrowpkg")
    kern = import_narrowly("narrowpkg.ops.kern", ("narrowpkg", "narrowpkg.ops"))
    assert package == ["narrowpkg", "narrowpkg.ops"]
    assert hasattr(kern.disabled, "__wrapped__")  # torch's own decorator


def test_a_narrow_import_that_fails_leaves_nothing_behind_and_imports_the_ordinary_way(package):
    kern = import_narrowly("narrowpkg.ops.kern", ("narrowpkg", "narrowpkg.no_such_package"))
    assert package == ["narrowpkg", "narrowpkg.ops"]  # the ordinary import ran both initialisers
    assert "narrowpkg.no_such_package" not in sys.modules
    assert kern is sys.modules["narrowpkg.ops.kern"] and hasattr(kern.disabled, "__wrapped__")


def test_a_failed_attempt_removes_the_packages_modules_and_keeps_the_others_it_imported(package, tmp_path):
    (tmp_path / "narrowpkg_side.py").write_text(
        "import narrowpkg_marker\nnarrowpkg_marker.ran.append('side')\n"
    )
    (tmp_path / PACKAGE / "ops" / "broken.py").write_text(
        "import narrowpkg_side\nraise ImportError('boom')\n"
    )
    with pytest.raises(ImportError, match="boom"):  # narrowly, then the ordinary way
        import_narrowly("narrowpkg.ops.broken", ("narrowpkg", "narrowpkg.ops"))
    # The module outside the package ran once (the ordinary import found it imported); the ordinary
    # import ran the initialisers.
    assert package == ["side", "narrowpkg", "narrowpkg.ops"]
    del sys.modules["narrowpkg_side"]


def test_torch_compiler_is_not_imported(tmp_path):
    """In a fresh interpreter (torch's compiler is imported by other tests of this process)."""
    root = tmp_path / PACKAGE / "ops" / "kern"
    root.mkdir(parents=True)
    (tmp_path / PACKAGE / "__init__.py").write_text("")
    (tmp_path / PACKAGE / "ops" / "__init__.py").write_text("")
    (tmp_path / PACKAGE / "ops" / "util.py").write_text("def helper(x):\n    return x\n")
    (root / "__init__.py").write_text("from .impl import disabled\n")
    (root / "impl.py").write_text(KERNEL)
    code = (
        "import sys; from deltaserve.ops.triton.narrow_import import import_narrowly; "
        "import_narrowly('narrowpkg.ops.kern', ('narrowpkg', 'narrowpkg.ops')); "
        "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"
