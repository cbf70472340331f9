"""LoRA adapters outside the compiled step, one room for the converter, the builder, the runtime and
the Triton backend: reading and checking an adapter (adapter.py: a Hugging Face PEFT dir or
TensorRT-LLM's format), each rank's share of it (shard.py), and which adapter each of an engine's
slots holds (slots.py). The update inside the step is kiln/models/lora.py. It sits below
kiln/convert, kiln/build and kiln/runtime and imports none of them."""
