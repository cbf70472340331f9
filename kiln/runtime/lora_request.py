"""A request's LoRA adapter, as vLLM names it: `LLM.generate(..., lora_request=LoRARequest(...))`."""
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int  # > 0; requests with the same id share the adapter (and its cached KV blocks)
    lora_path: str  # a Hugging Face PEFT adapter dir

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
