"""Integer arguments of the model side: `as_int` and `short_repr`, shared by every argument
check in `dsv4` (the trunk's calls, the draft module's) and by the engines in `services/`.

Owns the one rule for what counts as an integer argument and the one error for what does not;
it holds no state and runs no model math.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np
import torch


def as_int(name: str, value: Any) -> int:
    """`value` as a Python int: an int, a numpy integer, or a one-element integer torch tensor
    / numpy array (e.g. `torch.tensor(20)`, `np.int64(20)`). Nothing is truncated.

    name: how the error names the argument (first, as every check in the project takes it).
    Raises:
        TypeError: `name` not a str (the arguments in the wrong order).
        ValueError: naming `name`, the value (repr, cut by `short_repr`) and its type, for a
            bool, a float (even 12.0), str, None, a multi-element or non-integer tensor, or
            anything else.
    """
    if not isinstance(name, str):  # the arguments swapped: say so rather than name the value "20"
        raise TypeError(f"as_int(name, value) takes the name first, got name={short_repr(name)}")
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if torch.is_tensor(value) or isinstance(value, np.ndarray):
        t = torch.as_tensor(value)
        if t.numel() == 1 and t.ndim <= 1 and t.dtype != torch.bool and not (t.is_floating_point() or t.is_complex()):
            return int(t.reshape(()).item())
        raise ValueError(f"{name}={short_repr(value)} ({t.dtype}, shape {tuple(t.shape)}): must be an integer "
                         "scalar")
    raise ValueError(f"{name}={short_repr(value)} ({type(value).__name__}): must be an integer (not bool or float)")


def short_repr(value: Any, limit: int = 60) -> str:
    """repr(value), cut to `limit` characters so an error message stays one readable line."""
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 3] + "..."
