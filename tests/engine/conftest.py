"""The engine tests' model: the tiny Llama of ``helpers.model_for`` (shared, never changed)."""

import pytest

from helpers import model_for


@pytest.fixture(scope="module")
def model():
    return model_for("llama")
