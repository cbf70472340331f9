"""Post-training quantization for `convert_checkpoint --qformat/--kv_cache_dtype`.

formats: the qformats and what each writes; calib: calibration and evaluation text;
rtn: round-to-nearest weight-only quantization and the int4 packing; modelopt: the calibrated
formats through NVIDIA ModelOpt; gptq: ModelOpt's GPTQ settings; report: the accuracy report;
pipeline: from a HF model dir to the quantized tensors of a checkpoint.
"""
