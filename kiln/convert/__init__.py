"""HF model dir -> TensorRT-LLM unified checkpoint dir (`convert_checkpoint`).

hf: reading HF config and safetensors; layout: the linears' shapes and TP splits; shard: TensorRT-LLM
names and TP/PP splits of the tensors;
writer: staging and writing the checkpoint dir; cli: the command and `convert_checkpoint()`;
quantize: --qformat/--kv_cache_dtype (round-to-nearest, ModelOpt, GPTQ) and the accuracy report.
"""

__all__ = ["convert_checkpoint", "CheckpointError"]


def __getattr__(name):
    # Lazy, so that importing the package (e.g. for the CLI's --help) does not pull in torch.
    if name == "convert_checkpoint":
        from kiln.convert.cli import convert_checkpoint
        return convert_checkpoint
    if name == "CheckpointError":
        from kiln.convert.hf import CheckpointError
        return CheckpointError
    raise AttributeError(name)
