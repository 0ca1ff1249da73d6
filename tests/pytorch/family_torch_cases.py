"""The shared cases of test_family_torch.py (gradients, float32 against
plain PyTorch, modules, loaders, training), test_family_torch_inputs.py
(errors, memory and modes) and test_family_torch_section5.py (attn_mask,
causal, bias, dropout, return_weights), the tests of the attention family
in attention_c.torch: the sizes of attention_c.testing's torch family
problems (``B, TQ, T, H, HQ, A, HV``), the score kinds (``KINDS``), the
adapter's function of a kind (``ours``) and the names of the arguments
that require grad (``differentiable``).
"""

import pytest

torch = pytest.importorskip("torch")

import attention_c.torch as act  # noqa: E402
from attention_c.testing import TORCH_FAMILY_SIZES  # noqa: E402

B, TQ, T, H, HQ, A, HV = TORCH_FAMILY_SIZES
KINDS = ["additive", "dot", "general"]


def ours(kind, **args):
    return getattr(act, f"{kind}_attention")(**args)


def differentiable(args):
    """Names of the arguments that require grad."""
    return [n for n, x in args.items()
            if isinstance(x, torch.Tensor) and x.requires_grad]
