"""The hf engine's sampler on temperatures the client accepts (in [0, 2]) but that overflow float
arithmetic: 1e-40 made logits / temperature inf, softmax NaN, and a valid request an EngineError."""

from __future__ import annotations

import pytest
import torch

from epdq.engines.base import SamplingSpec
from epdq.engines.hf_pd import _sample

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 5e-324, 9.99e-6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_tiny_temperature_samples_greedily_as_vllm_does(temperature, dtype):
    logits = (torch.randn(2048, generator=torch.Generator().manual_seed(0)) * 5).to(dtype)
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        assert _sample(logits, SamplingSpec(4, temperature, 1.0, seed), g) == int(torch.argmax(logits))
        assert _sample(logits, SamplingSpec(4, temperature, 0.5, seed), g) == int(torch.argmax(logits))


def test_float16_logits_over_a_small_temperature_do_not_overflow():
    # 10 / 1e-4 = 1e5 is past float16's largest value (65504): the division was inf - inf = NaN
    logits = torch.full((64,), -10.0, dtype=torch.float16)
    logits[7] = 10.0
    g = torch.Generator().manual_seed(1)
    assert _sample(logits, SamplingSpec(4, 1e-4, 1.0, 1), g) == 7


def test_an_ordinary_temperature_still_samples():
    logits = torch.zeros(16)
    g = torch.Generator().manual_seed(3)
    picks = {_sample(logits, SamplingSpec(4, 1.0, 1.0, 3), g) for _ in range(50)}
    assert len(picks) > 1
