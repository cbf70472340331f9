"""Plugins: ops a graph compiler cannot be trusted to generate well.

Each op has a plain-torch reference (`reference`, the spec), a fast CPU path (`cpu`) and a
`torch.library` registration (`ops`). Elementwise ops may instead be traced inline from the CPU path so
that the graph compiler fuses them; the build's `plugin_config` chooses, as TensorRT-LLM's does.
`cpp` (imported on demand: it builds a C++ library on first use) holds the C++ paged attention,
`torch.ops.kiln_cpp.paged_attention`.
"""
from kiln.plugins import cpu, ops, reference

__all__ = ["cpu", "ops", "reference"]
