"""Re-executing recorded ops: what ``validate`` and ``replay`` share (one module, below both).

A recorded op is kept as an argument skeleton (its args and kwargs with each tensor in place, see
``Recorder.on_op``) plus the tensors to run it on; :func:`fill_args` puts tensors back into the skeleton.

Example:
    >>> args, kwargs = fill_args((torch.empty(0), 2), {}, [x])   # -> (x, 2), {}
"""

from __future__ import annotations

from typing import Any

import torch


def fill_skeleton(value: Any, tensors: list, cursor: list[int]) -> Any:
    """Rebuild a recorded argument (an item of ``replay[op][1]`` or a value of ``replay[op][2]``) with its
    tensor slots -- the tensors in it, in the order ``Recorder.on_op`` gathered them: top level, then one list
    level, args before kwargs -- replaced by ``tensors[cursor[0]:]``."""
    if isinstance(value, torch.Tensor):
        cursor[0] += 1
        return tensors[cursor[0] - 1]
    if type(value) is list or type(value) is tuple:
        return type(value)(
            fill_skeleton(v, tensors, cursor) if isinstance(v, torch.Tensor) else v for v in value
        )
    return value


def fill_args(skeleton_args: tuple, skeleton_kwargs: dict, tensors: list) -> tuple[tuple, dict]:
    """A recorded op's args and kwargs with its tensor slots filled from ``tensors``, in order."""
    # One cursor across args then kwargs: the recorder numbered tensor slots in that order.
    cursor = [0]
    args = tuple([fill_skeleton(a, tensors, cursor) for a in skeleton_args])
    kwargs = {k: fill_skeleton(v, tensors, cursor) for k, v in skeleton_kwargs.items()}
    return args, kwargs
