"""The engine tests' model: the tiny Llama of ``helpers.model_for`` with two decoder layers, not the
shared models' four (shared, never changed). A step costs about two thirds as much, and the
compiled steps compile in about two thirds of the time; two layers still pass one layer's output
to the next and give each layer its own blocks."""

import pytest

from helpers import model_for


@pytest.fixture(scope="module")
def model():
    return model_for("llama", num_hidden_layers=2)
