"""Which OpInfo samples aotkit is known to fail, and why; shared by ``test_opinfo.py`` and
``scripts/opinfo_sweep.py``.

- EXPECTED_FAILURES: PyTorch's own ``aot_function`` fails on the same samples (the sweep checks).
- AOTKIT_BUGS: PyTorch's ``aot_function`` passes them; aotkit must be fixed, then the entry removed.
- FIRST_SAMPLE_RAISES: for listed ops whose *first* sample fails (the one ``test_opinfo.py``
  runs, as a strict xfail), the error aotkit must raise. Listed ops missing here fail only on
  later samples, which only the sweep runs.
- SKIP: ops that cannot be compared at all (none so far).
- COMPILED_AUTOGRAD_NOT_BIT_EXACT: ops whose gradients under aotkit's compiled autograd are close
  to eager's but not bit for bit (``tests/compiled_autograd/test_opinfo.py`` says why).
"""

from __future__ import annotations

import torch

from aotkit.errors import TraceError, UnsupportedError

_DATA_DEPENDENT = "data-dependent: "

EXPECTED_FAILURES: dict[str, str] = {
    # Output shapes or Python values that depend on tensor data: no static graph exists.
    "masked_select": _DATA_DEPENDENT + "output size is the number of True elements",
    "combinations": _DATA_DEPENDENT + "implemented with masked_select",
    "linalg.lstsq": _DATA_DEPENDENT + "the CPU driver's residuals have a data-dependent size",
    "linalg.lstsq.grad_oriented": _DATA_DEPENDENT + "the CPU driver's residuals have a "
                                  "data-dependent size",
    "nn.functional.ctc_loss": _DATA_DEPENDENT + "aten._ctc_loss output size depends on the "
                              "target lengths' values",
    "corrcoef": _DATA_DEPENDENT + "cov checks its weights with aten.equal (a Python bool)",
    "cov": _DATA_DEPENDENT + "checks its weights with aten.equal (a Python bool)",
    "nn.functional.gaussian_nll_loss": _DATA_DEPENDENT + "checks var >= 0 with a Python branch "
                                       "on tensor values",
    "tensor_split": _DATA_DEPENDENT + "split points passed as a tensor are read as Python ints",
    "narrow": _DATA_DEPENDENT + "a 0-dim tensor start is read as a Python int (later samples)",
    "index_fill": _DATA_DEPENDENT + "a 1-element tensor index is checked for duplicates with "
                  "aten._unique (later samples)",
    "repeat_interleave": _DATA_DEPENDENT + "repeats given as a tensor set the output size "
                         "(later samples)",
    "__getitem__": _DATA_DEPENDENT + "boolean-mask indexing calls nonzero (later samples)",
    "index_put": _DATA_DEPENDENT + "boolean-mask indices call nonzero (later samples)",
    # Sparse layouts: fake tensors and functionalization do not handle them.
    "sparse.sampled_addmm": "sparse CSR inputs are refused with UnsupportedError",
    "sparse.mm.reduce": "sparse CSR inputs are refused with UnsupportedError",
}

# Releases before 2.13 implement quantile's q check with aten.equal (a Python bool).
if torch.__version__ < "2.13":
    for _name in ("quantile", "nanquantile"):
        EXPECTED_FAILURES[_name] = _DATA_DEPENDENT + "torch < 2.13 checks q with aten.equal"

AOTKIT_BUGS: dict[str, str] = {}

FIRST_SAMPLE_RAISES: dict[str, type[BaseException]] = {
    "masked_select": TraceError,
    "combinations": TraceError,
    "linalg.lstsq": TraceError,
    "linalg.lstsq.grad_oriented": TraceError,
    "nn.functional.ctc_loss": TraceError,
    "corrcoef": TraceError,
    "cov": TraceError,
    "nn.functional.gaussian_nll_loss": TraceError,
    "tensor_split": TraceError,
    "sparse.sampled_addmm": UnsupportedError,
    "sparse.mm.reduce": UnsupportedError,
    **{name: TraceError for name in ("quantile", "nanquantile") if name in EXPECTED_FAILURES},
}

SKIP: dict[str, str] = {}

COMPILED_AUTOGRAD_NOT_BIT_EXACT = frozenset({"gradient"})
