"""Perplexity through the engine: prompt log-probabilities of text, in windows the engine accepts."""
import math
from dataclasses import dataclass

from kiln.runtime.sampling_params import SamplingParams


@dataclass
class PerplexityResult:
    perplexity: float
    nll: float  # mean negative log-likelihood per predicted token
    num_tokens: int  # tokens predicted (each window's first token has no context, so is not)
    num_windows: int


def windows(token_ids: list[int], max_len: int) -> list[list[int]]:
    """Consecutive, non-overlapping windows of at most max_len tokens (a last window of one
    token predicts nothing and is dropped)."""
    return [token_ids[i:i + max_len] for i in range(0, len(token_ids), max_len)
            if len(token_ids[i:i + max_len]) > 1]


def max_window(build) -> int:
    """The longest window an engine scores: a prompt of max_input_len at most, plus the one token
    generated with it within max_seq_len."""
    return min(build.max_input_len, build.max_seq_len - 1)


def perplexity(llm, texts: list[str], max_len: int) -> PerplexityResult:
    """Each text is tokenized on its own (no BOS) and scored in windows of max_len tokens."""
    limit = max_window(llm.llm_engine.build_config)
    if not 2 <= max_len <= limit:
        raise ValueError(f"max_len must be in [2, {limit}] (the engine's max_input_len, and max_seq_len - 1 "
                         f"for the token generated with each window), got {max_len}")
    tokenizer = llm.get_tokenizer()
    if tokenizer is None:
        raise ValueError("perplexity needs the engine's tokenizer (this LLM was loaded with skip_tokenizer_init)")
    chunks = [w for text in texts for w in windows(tokenizer.encode(text, add_special_tokens=False), max_len)]
    if not chunks:
        raise ValueError("no text to score: every file is empty or a single token")
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": c} for c in chunks], params)
    total, count = 0.0, 0
    for chunk, out in zip(chunks, outputs):
        for token, logprobs in zip(chunk[1:], out.prompt_logprobs[1:]):
            total -= logprobs[token]
            count += 1
    nll = total / count
    return PerplexityResult(math.exp(nll), nll, count, len(chunks))
