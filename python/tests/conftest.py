"""The Python suite runs against the package assembled in the build tree
(PYTHONPATH=build/python, set by `make test-python`), never against python/spillway itself,
which lacks the extension module: python/ is dropped from sys.path when pytest runs there."""

from __future__ import annotations

import os
import sys
import warnings

_SOURCE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _SOURCE]

# torch warns once that NumPy-less paths exist, transformers about optional backends: noise.
warnings.filterwarnings("ignore", category=UserWarning, module="torch")
