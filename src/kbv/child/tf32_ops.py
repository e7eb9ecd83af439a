"""Which operators of a trusted reference's forward the TF32 flags could change.

``torch.backends.cuda.matmul.allow_tf32`` and ``torch.backends.cudnn.allow_tf32`` change cuBLAS
GEMMs and cuDNN convolutions and RNNs, nothing else. A problem whose forward runs none of them
computes exactly the same under ``eager_fp32`` and ``eager_tf32``, so timing both baselines times
the same code twice (about 1.3 s a ``verified`` evaluation on the H200). The reference worker
records the operators of one forward (a ``TorchDispatchMode``, so what is seen is what the
dispatcher ran after decomposition) and the parent skips ``eager_tf32`` only when none of them is
TF32-sensitive.

The rule errs one way only: a name that might reach cuBLAS or cuDNN counts as sensitive (a wrong
"sensitive" costs one baseline's time, a wrong "insensitive" would hide TF32's speed from the
speedup). An operator from outside ``aten``/``prims`` (a custom op) is sensitive, since what it
runs is unknown. An operator seen here may call GEMMs internally without the mode seeing them
(``_cdist_forward``, ``_trilinear``, fused attention and transformer kernels), which is why such
names are listed by their own parts.
"""

from __future__ import annotations

import re
from typing import Any

#: Parts of a name (anywhere in it) that mark an operator as reaching a GEMM or cuDNN convolution/RNN.
SENSITIVE_SUBSTRINGS = (
    "mm",  # mm, bmm, addmm, baddbmm, _scaled_mm, _int_mm, _sparse_mm ...
    "conv",
    "cudnn",
    "miopen",
    "mkldnn",
    "rnn",
    "lstm",
    "gru",
    "attention",
    "multi_head",
    "transformer",
    "linalg",
    "matmul",
    "linear",
    "einsum",
    "bilinear",
    "trilinear",
    "tensordot",
    "cdist",
    "cublas",
    "gemm",
    "gemv",
    "solve",
    "cholesky",
    "inverse",
    "pinv",
)
#: Whole tokens of a name (split at ``_`` and ``.``) with the same meaning, too short to match as parts.
SENSITIVE_TOKENS = frozenset(
    {"mv", "addmv", "dot", "vdot", "addr", "det", "svd", "qr", "lu", "eig", "geqrf", "orgqr", "ormqr"}
)
#: Names that match a part above but run no GEMM and no cuDNN convolution/RNN.
INSENSITIVE = frozenset(
    {
        "aten::linalg_vector_norm",
        "aten::cudnn_batch_norm",
        "aten::cudnn_grid_sampler",
        "aten::upsample_bilinear2d",  # interpolation, not a bilinear form
        "aten::_upsample_bilinear2d_aa",
    }
)
_TRUSTED_NAMESPACES = ("aten", "prims")


def tf32_sensitive(name: str) -> bool:
    """Whether the operator ``namespace::name`` could compute differently with TF32 allowed."""
    if name in INSENSITIVE:
        return False
    namespace, _, op = name.partition("::")
    if namespace not in _TRUSTED_NAMESPACES or not op:
        return True
    if any(part in op.replace("convert", "") for part in SENSITIVE_SUBSTRINGS):  # "conv" in convert_*
        return True
    return any(token in SENSITIVE_TOKENS for token in re.split(r"[_.]+", op))


def recorder() -> Any:
    """A dispatch mode that records the schema name of every operator run under it (``.names``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _OperatorNames(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.names.add(str(func._schema.name))
            return func(*args, **(kwargs or {}))

    return _OperatorNames()


def summary(names: set[str]) -> dict[str, Any]:
    """What the reference worker reports: the sensitive operators it ran, and how many it ran."""
    return {"sensitive": sorted(n for n in names if tf32_sensitive(n)), "operators": len(names)}
