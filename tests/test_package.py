"""Package-level promises: a light import, the typed marker, the public names."""

import subprocess
import sys
from pathlib import Path

import aotkit


def test_import_does_not_load_dynamo_or_inductor() -> None:
    code = ("import sys, aotkit; "
            "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_py_typed_is_shipped() -> None:
    assert (Path(aotkit.__file__).parent / "py.typed").is_file()


def test_public_names_resolve() -> None:
    for name in aotkit.__all__:
        assert getattr(aotkit, name) is not None, name
