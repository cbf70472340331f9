"""TensorRT-LLM's sampling semantics on the `tensorrt_llm` / `ensemble` interface, mapped onto Kiln's
SamplingParams (which follow vLLM's). Its clients rely on them: they send `temperature` 1.0 by
default and expect greedy search unless they ask for top-k or top-p (tensorrtllm_backend #528:
"the default behavior is greedy searching"; TensorRT-LLM #646)."""
from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    top_k: str  # runtime_top_k (the ensemble's top_k) as sent
    top_p: str  # runtime_top_p (top_p)
    temperature: str
    kiln: str  # the SamplingParams it becomes
    example: dict  # inputs of one request this row covers (the tests walk them)
    expect: dict | None  # SamplingParams fields they give; None: an error naming the input


# The table README.md shows (tests/test_triton.py checks that it is the same and walks every row).
SEMANTICS = [
    Rule("absent or 0", "absent or 0", "any (ignored)", "greedy: temperature=0",
         dict(temperature=1.0), dict(temperature=0.0, top_k=0, top_p=1.0)),
    Rule("1", "any", "any (ignored)", "greedy: temperature=0",
         dict(top_k=1, top_p=0.9, temperature=0.7), dict(temperature=0.0, top_k=0, top_p=1.0)),
    Rule("k > 1", "absent or 0", "t (absent: 1.0)", "top-k: top_k=k, top_p=1, temperature=t",
         dict(top_k=40, top_p=0.0, temperature=0.7), dict(temperature=0.7, top_k=40, top_p=1.0)),
    Rule("absent or 0", "0 < p <= 1", "t (absent: 1.0)", "top-p: top_k=0, top_p=p, temperature=t",
         dict(top_p=0.9), dict(temperature=1.0, top_k=0, top_p=0.9)),
    Rule("k > 1", "0 < p <= 1", "t (absent: 1.0)", "top-k then top-p: top_k=k, top_p=p, temperature=t",
         dict(top_k=40, top_p=0.9, temperature=1.3), dict(temperature=1.3, top_k=40, top_p=0.9)),
    Rule("any", "any", "0", "greedy: temperature=0",
         dict(top_k=40, temperature=0.0), dict(temperature=0.0, top_k=0, top_p=1.0)),
    Rule("< 0", "< 0 or > 1", "< 0", "any of these: an error naming the input", dict(top_p=1.5), None),
]


def markdown_table() -> str:
    lines = ["| `runtime_top_k` (`top_k`) | `runtime_top_p` (`top_p`) | `temperature` | Kiln's SamplingParams |",
             "|---|---|---|---|"]
    lines += [f"| {r.top_k} | {r.top_p} | {r.temperature} | {r.kiln} |" for r in SEMANTICS]
    return "\n".join(lines)


def sampling_fields(top_k=None, top_p=None, temperature=None) -> dict:
    """temperature/top_k/top_p for SamplingParams from TensorRT-LLM's inputs (None: not sent)."""
    k = 0 if top_k is None else int(top_k)
    p = 0.0 if top_p is None else float(top_p)
    t = 1.0 if temperature is None else float(temperature)
    if k < 0:
        raise ValueError(f"runtime_top_k (top_k) must be >= 0, got {k}")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"runtime_top_p (top_p) must be in [0, 1], got {p:g}")
    if not t >= 0.0:  # also NaN
        raise ValueError(f"temperature must be >= 0, got {t:g}")
    if (k == 0 and p == 0.0) or k == 1 or t == 0.0:
        return dict(temperature=0.0, top_k=0, top_p=1.0)
    return dict(temperature=t, top_k=k if k > 1 else 0, top_p=p if p > 0.0 else 1.0)
