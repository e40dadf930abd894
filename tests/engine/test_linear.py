"""engine.models.linear: prepacked oneDNN weights give F.linear's results, and a row's output does
not depend on how many rows share the call (oneDNN's one-row kernel sums differently; the Linear
runs a lone row as a pair)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models.linear import Linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(768, 2048), (256, 4096), (1280, 768)])  # in > 1024: where M=1 differed
def test_a_row_alone_equals_the_same_row_in_a_batch(dtype, shape):
    out_features, in_features = shape
    generator = torch.Generator().manual_seed(out_features)
    linear = Linear((torch.randn(shape, generator=generator) * 0.05).to(dtype))
    x = torch.randn(64, in_features, generator=generator).to(dtype)
    batch = linear(x)
    alone = torch.cat([linear(x[i:i + 1]) for i in range(64)])
    assert torch.equal(alone, batch)
    assert torch.equal(linear(x[0]), batch[0])  # a 1-d input keeps its shape
    for rows in (2, 3, 17):
        assert torch.equal(linear(x[:rows]), batch[:rows])
    tolerance = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(batch.float(), F.linear(x.float(), linear_weight(shape, dtype)), **tolerance)


def linear_weight(shape, dtype):
    generator = torch.Generator().manual_seed(shape[0])
    return (torch.randn(shape, generator=generator) * 0.05).to(dtype).float()
