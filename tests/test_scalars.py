"""`dsv4.scalars.as_int`: the one rule for integer arguments (the trunk's, the draft module's,
the engines'), name first."""

import numpy as np
import pytest
import torch

from dsv4.scalars import as_int


@pytest.mark.parametrize("value", [20, np.int64(20), np.uint8(20), torch.tensor(20), torch.tensor([20]),
                                   np.array(20), np.array([20], dtype=np.int32)])
def test_integers_in_any_of_their_forms_are_ints(value):
    got = as_int("position", value)
    assert got == 20 and type(got) is int


@pytest.mark.parametrize("value, message", [
    (True, "position=True (bool): must be an integer"),
    (12.0, "position=12.0 (float): must be an integer"),
    ("12", "position='12' (str): must be an integer"),
    (None, "position=None (NoneType): must be an integer"),
    (torch.tensor(12.0), "position=tensor(12.) (torch.float32, shape ()): must be an integer scalar"),
    (torch.tensor([1, 2]), "position=tensor([1, 2]) (torch.int64, shape (2,)): must be an integer scalar"),
    (torch.tensor(True), "position=tensor(True) (torch.bool, shape ()): must be an integer scalar"),
])
def test_anything_else_is_refused_naming_the_argument_value_and_type(value, message):
    with pytest.raises(ValueError) as err:
        as_int("position", value)
    assert str(err.value).startswith(message)


def test_swapped_arguments_are_a_type_error_not_a_misnamed_value():
    with pytest.raises(TypeError, match=r"takes the name first, got name=20"):
        as_int(20, "position")
