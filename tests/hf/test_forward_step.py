"""The steps a forward pass carries under ``hf.FORWARD_STEP`` declare ``hf.ForwardStep`` and take
its ``attend`` exactly as declared (the attention function calls it with those arguments)."""

import inspect

import pytest

from kvcache.engine.step import PagedStep
from kvcache.hf import ForwardStep
from kvcache.train.replay import ChunkStep


@pytest.mark.parametrize("step", [PagedStep, ChunkStep])
def test_every_forward_step_declares_the_protocol_and_its_attend(step):
    assert ForwardStep in step.__mro__
    declared = list(inspect.signature(ForwardStep.attend).parameters)
    assert list(inspect.signature(step.attend).parameters) == declared
