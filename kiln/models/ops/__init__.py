"""The kernels a model's forward calls, as one op set chosen at engine build (op_set.py), and the
kernel families that implement it (base.py's Kernels: reference.py, cpp.py)."""
