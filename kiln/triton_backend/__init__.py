"""The Triton Inference Server backend: a model repository with tensorrtllm_backend's models and
tensor names (`kiln triton-repo`), Python-backend models that serve a Kiln engine in-process, and a
launcher (`kiln triton-serve`). Not named `triton`: that would shadow the `triton` package torch
imports."""
