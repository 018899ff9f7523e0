"""Names shared by the capture's parts. A leaf module (it imports nothing of tl_dist), so any part can use it
without an import cycle."""

from __future__ import annotations

import os

import torch

# Attribute set on every op output during a capture: (capture token, op index, output position).
TAG = "_tl_src"
TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
OWN_DIR = os.path.dirname(__file__) + os.sep
# Default tolerances of validate() for floating-point outputs (integer and bool outputs must match exactly).
VALIDATE_ATOL = 1e-6
VALIDATE_RTOL = 1e-5
