# Written by `kiln triton-repo`: the model itself lives in the kiln package (kiln.triton_backend.llmapi).
import os
import sys

# The Python-backend stub may run its interpreter in isolated mode, which ignores PYTHONPATH: put
# its entries (where kiln and its dependencies are installed) first, before any other import.
sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]

from kiln.triton_backend.llmapi import TritonPythonModel  # noqa: E402,F401
