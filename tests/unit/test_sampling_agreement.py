"""The hf and vLLM PD engines give one request the same sampling.

- seed -1: vLLM's SamplingParams turns it into "no seed" (random each time) while the hf engine
  seeded its generator with it. It is refused wherever a request is checked (the client, the
  broker, the engines' SamplingSpec); every other seed means the same to both engines.
- tiny temperatures: vLLM raises any temperature in (0, 0.01) to 0.01 before its greedy check
  (so 1e-6 sampled at 0.01), while the hf engine took everything below 1e-5 as greedy. Now both:
  below 1e-5 greedy (0.0 is what reaches vLLM), from 1e-5 to 0.01 sampled at 0.01.
Checked without starting vLLM: its SamplingParams is what the engine hands it."""

from __future__ import annotations

import pytest
import torch

from epdq import protocol as P
from epdq.client_input import make_sampling
from epdq.engines.base import SamplingSpec
from epdq.engines.hf_pd import _sample
from epdq.errors import InvalidInputError, ProtocolError

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def vllm_engine():
    from epdq.engines.vllm_engine import VllmEngine
    from epdq.models.tiny import default_model_dir

    return VllmEngine(default_model_dir(), mode="pd", max_model_len=256)


# -- seed -1 ---------------------------------------------------------------------------------------


def test_the_broker_refuses_seed_minus_one_saying_what_to_do_instead():
    with pytest.raises(ProtocolError, match="leave seed unset for random sampling"):
        P.validate_sampling(P.Sampling(seed=-1))


def test_the_client_refuses_seed_minus_one_before_it_sends():
    with pytest.raises(InvalidInputError, match="leave seed unset for random sampling"):
        make_sampling(16, 1.0, 1.0, -1, None, False)


def test_an_engine_is_not_handed_seed_minus_one():
    with pytest.raises(ValueError, match="leave seed unset"):
        SamplingSpec(seed=-1)


@pytest.mark.parametrize("seed", [None, 0, 1, -2, P.SEED_MIN, P.SEED_MAX])
def test_other_seeds_reach_vllm_as_given(vllm_engine, seed):
    P.validate_sampling(P.Sampling(seed=seed))
    assert make_sampling(16, 1.0, 1.0, seed, None, False).seed == seed
    assert vllm_engine._sampling_params(SamplingSpec(temperature=1.0, seed=seed)).seed == seed


# -- tiny temperatures -----------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [5e-324, 1e-40, 1e-6, 9.99e-6])
def test_below_1e_5_vllm_samples_greedily_as_the_hf_engine_does(vllm_engine, temperature):
    from vllm.sampling_params import SamplingType

    params = vllm_engine._sampling_params(SamplingSpec(temperature=temperature, seed=3))
    assert params.temperature == 0.0 and params.sampling_type == SamplingType.GREEDY
    logits = torch.randn(64, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(3)
    assert _sample(logits, SamplingSpec(temperature=temperature, seed=3), g) == int(torch.argmax(logits))


@pytest.mark.parametrize("temperature", [1e-5, 1e-4, 0.005, 0.00999])
def test_from_1e_5_to_0_01_both_engines_sample_at_0_01(vllm_engine, temperature):
    from vllm.sampling_params import SamplingType

    params = vllm_engine._sampling_params(SamplingSpec(temperature=temperature, seed=3))
    assert params.temperature == 0.01 and params.sampling_type == SamplingType.RANDOM_SEED
    # two near-equal logits: at 0.01 the second is drawn about one time in eight, at 0.005 one
    # time in fifty; the same generator state must draw the same token as at 0.01
    logits = torch.full((16,), -5.0)
    logits[3], logits[9] = 1.0, 0.98
    for seed in range(300):
        at = _sample(logits, SamplingSpec(temperature=temperature, seed=seed), torch.Generator().manual_seed(seed))
        at_001 = _sample(logits, SamplingSpec(temperature=0.01, seed=seed), torch.Generator().manual_seed(seed))
        assert at == at_001, seed


@pytest.mark.parametrize("temperature", [0.0, 0.01, 0.5, 1.0, 2.0])
def test_ordinary_temperatures_are_unchanged(vllm_engine, temperature):
    from epdq.engines.base import engine_temperature

    assert engine_temperature(temperature) == temperature
    assert vllm_engine._sampling_params(SamplingSpec(temperature=temperature)).temperature == temperature
