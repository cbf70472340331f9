"""Kiln: an ahead-of-time LLM engine compiler and runtime."""
from kiln.version import __version__

__all__ = ["__version__", "LLM", "AsyncLLM", "SamplingParams", "LoRARequest"]


def __getattr__(name):
    # The runtime pulls in torch and transformers; keep `import kiln` (and CLI --help) light.
    if name in ("LLM", "AsyncLLM", "SamplingParams", "LoRARequest"):
        from kiln import api
        from kiln.runtime import lora_request, sampling_params
        return {"LLM": api.LLM, "AsyncLLM": api.AsyncLLM, "SamplingParams": sampling_params.SamplingParams,
                "LoRARequest": lora_request.LoRARequest}[name]
    raise AttributeError(name)
