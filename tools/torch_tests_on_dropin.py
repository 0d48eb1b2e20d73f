"""Run PyTorch's own ``torch.nn.MultiheadAttention`` tests on multihead's drop-in.

    python tools/torch_tests_on_dropin.py <pytorch checkout>/test/nn/test_multihead_attention.py [pytest args]
    python tools/torch_tests_on_dropin.py <the module tests of test/test_transformers.py> [pytest args]

The test file comes from a PyTorch checkout (it is not in the torch wheel, and not copied here);
it needs ``expecttest`` (``pip install expecttest``). Before pytest imports it, this script puts
:class:`multihead.TorchMultiheadAttention` where torch.nn's class is looked up
(``torch.nn.MultiheadAttention`` and the name ``nn.TransformerEncoderLayer`` builds its attention
with), so every module the tests build is the drop-in; calls of ``F.multi_head_attention_forward``
stay torch's. Expected to fail: the tests that mock torch's fused fast paths
(``torch._native_multi_head_attention``, ``torch._transformer_encoder_layer_fwd``) and assert they were
entered — the drop-in never enters them. ``test/test_transformers.py`` also holds the
``scaled_dot_product_attention`` tests and imports a test-suite module of its own; its class
``TestTransformers`` (the module tests) runs once those are left out.
"""

from __future__ import annotations

import sys

import pytest
import torch.nn
import torch.nn.modules.transformer as transformer

from multihead.layer.dropin import TorchMultiheadAttention


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    torch.nn.MultiheadAttention = TorchMultiheadAttention
    transformer.MultiheadAttention = TorchMultiheadAttention
    return pytest.main([*argv, "-p", "no:cacheprovider", "-q", "-rfEs"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
