"""Weight-only draft quantization: both int4 paths (packed kernel, dequantize) agree and stay close to bf16."""

import torch
from torch import nn

from specdec.runtime.quant import Int4Linear, Int8Linear, quantize_


def test_int4_kernel_and_dequantized_paths_agree():
    torch.manual_seed(0)
    lin = nn.Linear(256, 96, bias=True).to(torch.bfloat16)
    q = Int4Linear(lin)
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    one = q(x)  # packed int4 kernel
    many = q(x.expand(8, 256))[:1]  # dequantize + matmul
    ref = lin(x).float()
    assert torch.allclose(one.float(), many.float(), atol=0.02, rtol=0.02)
    assert (one.float() - ref).norm() / ref.norm() < 0.15


def test_quantize_picks_int4_where_possible():
    m = nn.Sequential(nn.Linear(128, 64), nn.Linear(100, 8)).to(torch.bfloat16)
    quantize_(m, "int4")
    assert isinstance(m[0], Int4Linear) and isinstance(m[1], Int8Linear)
