"""Which engine failures are the request's input: only what the input processors refuse."""

from __future__ import annotations

from epdq.engines.vllm_engine import _raised_in_input_processing, _root_cause


def test_a_processor_refusal_is_the_inputs_fault_any_other_value_error_is_ours():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    try:
        smart_resize(1, 4000)
    except ValueError as e:
        assert "aspect ratio" in str(e) and _raised_in_input_processing(e)
    try:
        raise ValueError("an embedding/placeholder mismatch of our own making")
    except ValueError as e:
        assert not _raised_in_input_processing(e)


def test_root_cause_follows_the_chain_and_stops_on_a_cycle():
    a, b, c = ValueError("a"), RuntimeError("b"), RuntimeError("c")
    c.__cause__, b.__cause__ = b, a
    assert _root_cause(c) is a
    a.__cause__ = c  # a cycle must not loop for ever
    assert _root_cause(c) in (a, b, c)
