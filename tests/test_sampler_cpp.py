"""The kiln_cpp sampler (kiln/plugins/csrc/sampler.cpp) held to the torch reference (the spec) at real
vocabulary sizes: exactly where the math is deterministic (penalized logits, greedy tokens, logprob
dicts and ranks; seeded draws without top-p, which use the same uniforms), in distribution where it
is not (top-p by rejection sampling). The behavioural tests of test_sampler.py run on both samplers.

The library is built on first use into the cache (kiln/plugins/cpp.py); the first test pays for it."""
from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys

import pytest
import torch

from kiln.runtime.core.sample.rows import SampleRow, make_generator
from kiln.runtime.core.sample.sampler import Sampler
from kiln.runtime.sampling_params import SamplingParams as SP
from test_sampler import ALPHA, chi2_pvalue, reference_filter, row

VOCABS = [384, 8192, 49152, 151936]


@pytest.fixture(scope="module")
def cpp():
    return Sampler("cpp")


@pytest.fixture(scope="module")
def ref():
    return Sampler("torch")


def logits_for(vocab: int, rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 3
    x[:, ::97] = float("-inf")  # masked tokens (a padded vocabulary, a grammar)
    return x


def history(i: int, vocab: int) -> tuple[list[int], list[int]]:
    """128 prompt + 64 output tokens, with repeats, as a decode step sees them."""
    return [(37 * j + i) % vocab for j in range(128)], [(11 * j * j + i) % vocab for j in range(64)]


def penalized_rows(vocab: int) -> list[SampleRow]:
    kinds = [SP(temperature=0), SP(temperature=0, repetition_penalty=1.3),
             SP(temperature=0, frequency_penalty=0.7, presence_penalty=-0.4, logprobs=20),
             SP(temperature=0, repetition_penalty=0.8, frequency_penalty=-1.1, presence_penalty=1.5, logprobs=0),
             SP(temperature=0, min_tokens=100, max_tokens=None, stop_token_ids=[5, 9, vocab + 3], logprobs=3),
             SP(temperature=0.7, top_k=1, repetition_penalty=1.1, min_tokens=65, max_tokens=None, ignore_eos=True),
             SP(temperature=0, min_tokens=2)]  # reached: nothing banned
    return [SampleRow(p, *history(i, vocab), None, (2, 7)) for i, p in enumerate(kinds)]


@pytest.mark.parametrize("vocab", VOCABS)
def test_processed_logits_greedy_tokens_and_logprobs_equal_the_reference(cpp, ref, vocab):
    rows = penalized_rows(vocab)
    x = logits_for(vocab, len(rows), vocab)
    x[4, 2] = 1e4  # the EOS min_tokens bans is the argmax
    assert torch.equal(cpp.process_logits(x, rows), ref.process_logits(x, rows))
    a, b = cpp(x, rows), ref(x, rows)
    assert a.token_ids == b.token_ids and a.token_ids[4] != 2
    assert a.ranks == b.ranks
    for da, db in zip(a.logprobs, b.logprobs):
        assert (da is None) == (db is None)
        if da is not None:
            assert list(da) == list(db)  # the chosen token first, then the top-n best first
            assert list(da.values()) == pytest.approx(list(db.values()), abs=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_greedy_batches_take_the_first_max_as_packed_rows_do(cpp, ref, dtype):
    """A batch of greedy rows that nothing masks or penalizes skips packing: the same tokens, ties and
    NaN rows included, as the same rows sampled beside one that needs packing (a logprobs row)."""
    x = logits_for(8192, 5, 3).to(dtype)
    x[1, [7, 9]] = 50.0  # a tie: the first wins
    x[2, 11] = float("nan")  # NaN is the max, as torch.argmax has it
    x[3] = float("-inf")
    x[3, 8000] = 0.0
    plain = [SampleRow(SP(temperature=0), *history(i, 8192)) for i in range(5)]
    packed = plain + [SampleRow(SP(temperature=0, logprobs=1), *history(5, 8192))]
    got = cpp(x, plain).token_ids
    assert got == cpp(torch.cat([x, x[:1]]), packed).token_ids[:5] == ref(x, plain).token_ids
    assert got[1:4] == [7, 11, 8000] and cpp(x, plain).logprobs == [None] * 5


@pytest.mark.parametrize("vocab", VOCABS)
def test_seeded_draws_without_top_p_equal_the_reference(cpp, ref, vocab):
    """Without top-p both samplers invert the same uniform over the same tokens in token order."""
    kinds = [dict(temperature=0.8), dict(temperature=0.8, top_k=50), dict(temperature=1.3, min_p=0.05),
             dict(temperature=0.6, top_k=2000, min_p=0.01, frequency_penalty=0.5), dict(temperature=1.0, top_k=vocab)]
    rows = [SampleRow(SP(**kinds[i % len(kinds)], repetition_penalty=1.1, seed=i), *history(i, vocab),
                      make_generator(i, i % 3), (2,)) for i in range(40)]
    x = logits_for(vocab, len(rows), vocab + 1)
    assert cpp(x, rows).token_ids == ref(x, rows).token_ids


def test_draws_do_not_depend_on_threads_or_dtype(cpp):
    rows = [SampleRow(SP(temperature=0.9, top_p=0.9, top_k=40 * (i % 3), min_p=0.02 * (i % 2), seed=i),
                      *history(i, 8192), make_generator(i), (2,)) for i in range(24)]
    x = logits_for(8192, len(rows), 5).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpp(x, rows).token_ids
    finally:
        torch.set_num_threads(threads)
    assert cpp(x.float(), rows).token_ids == one
    assert cpp(torch.cat([x.float()] * 2, dim=1)[:, :8192], rows).token_ids == one  # rows apart in memory


def test_unseeded_draws_follow_torch_manual_seed(cpp, ref):
    x = logits_for(384, 64, 6)
    rows = [row(SP(temperature=1.2, top_k=20)) for _ in range(64)]
    torch.manual_seed(3)
    first = cpp(x, rows).token_ids
    torch.manual_seed(3)
    assert cpp(x, rows).token_ids == first
    torch.manual_seed(3)
    assert ref(x, rows).token_ids == first  # one key per call from torch's generator, the same hash
    assert cpp(x, rows).token_ids != first


def test_samples_of_one_request_are_independent(cpp):
    """Samples 0 and 1 of one seed agree about as often as two independent draws do (sum p^2);
    (seed 7, sample 1) is not (seed 8, sample 0); a sample's draws do not depend on its batch."""
    logits = torch.tensor([1.0, 0.5, -0.3, 2.0, 0.0, -1.0, 1.2, 0.7])
    def run(gen, position=0, others=0, steps=3000):
        toks = []
        x = logits.expand(others + 1, -1)
        for _ in range(steps):
            rows = [row(SP(temperature=0.9)) for _ in range(others + 1)]
            rows[position] = row(SP(), output=toks, generator=gen)
            toks.append(cpp(x, rows).token_ids[position])
        return toks

    steps = 3000
    a, b, c = run(make_generator(7, 0)), run(make_generator(7, 1)), run(make_generator(8, 0))
    p2 = float((logits.softmax(-1) ** 2).sum())
    for other in (b, c):
        agree = sum(u == v for u, v in zip(a, other)) / steps
        assert abs(agree - p2) < 4 * (p2 * (1 - p2) / steps) ** 0.5
    assert run(make_generator(7, 1), position=2, others=3, steps=50) == b[:50]


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_ties_at_the_kth_value_are_kept(backend):
    V = 384
    x = torch.full((V,), -5.0)
    x[[10, 200, 300]] = 2.0
    x[[3, 150, 151, 383]] = 1.5  # the 5th value: all four are kept with top_k=5
    n = 8000
    torch.manual_seed(0)
    out = Sampler(backend)(x.expand(n, -1), [row(SP(top_k=5)) for _ in range(n)])
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=V)
    ref = reference_filter(x, top_k=5)
    assert set(counts.nonzero().flatten().tolist()) == set(ref.nonzero().flatten().tolist())
    assert chi2_pvalue(counts, ref) > ALPHA


def test_parameter_edges(cpp):
    """top_k >= vocab, top_p = 1 and min_p = 0 are no-ops; min_p = 1 keeps the argmax (ties too);
    -inf tokens are never drawn; a row with one finite logit always gives it."""
    V = 8192
    x = logits_for(V, 16, 7)
    hist = [history(i, V) for i in range(16)]

    def draws(**kw):
        rows = [SampleRow(SP(temperature=1.5, seed=i, **kw), *hist[i], make_generator(i)) for i in range(16)]
        return cpp(x, rows).token_ids

    plain = draws()
    assert draws(top_k=V) == draws(top_k=V + 5) == draws(top_p=1.0) == draws(min_p=0.0) == plain
    assert all(torch.isfinite(x[i, t]) for i, t in enumerate(plain))
    x[:, 0] = x[:, 1] = 50.0
    assert set(draws(min_p=1.0)) <= {0, 1} and len(set(draws(min_p=1.0, top_k=3))) == 2
    x.fill_(float("-inf"))
    x[:, 4321] = -1e30
    assert draws(top_p=0.3) == draws(top_k=7) == [4321] * 16


def binned(counts: torch.Tensor, probs: torch.Tensor, bins: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts and probabilities summed over bins of about equal mass, tokens in probability order."""
    order = probs.argsort(descending=True)
    edges = (probs[order].cumsum(0) * bins / probs.sum()).long().clamp(max=bins - 1)
    return (torch.zeros(bins, dtype=torch.float64).index_add_(0, edges, counts[order].double()),
            torch.zeros(bins, dtype=torch.float64).index_add_(0, edges, probs[order].double()))


@pytest.mark.parametrize("backend", ["torch", "cpp"])
@pytest.mark.parametrize("vocab,kw", [
    (8192, dict(top_p=0.9)),  # a flat row: the nucleus is most of the vocabulary
    (8192, dict(temperature=0.7, top_p=0.6, min_p=0.01)),
    (49152, dict(temperature=0.8, top_k=300, top_p=0.7, repetition_penalty=1.3)),
])
def test_large_vocab_truncation_matches_the_reference_set(backend, vocab, kw):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(vocab, generator=g) * (0.5 if "top_k" not in kw else 2.0)
    prompt = list(range(0, vocab, 7))[:128]
    pen = logits.clone()
    if "repetition_penalty" in kw:
        r = kw["repetition_penalty"]
        pen[prompt] = torch.where(pen[prompt] > 0, pen[prompt] / r, pen[prompt] * r)
    ref = reference_filter(pen, kw.get("temperature", 1.0), kw.get("top_k", 0), kw.get("top_p", 1.0),
                           kw.get("min_p", 0.0))
    params = SP(**kw)
    counts = torch.zeros(vocab, dtype=torch.long)
    torch.manual_seed(1)
    sampler = Sampler(backend)
    for _ in range(8):  # 2000 draws, 250 rows a call: the torch sampler's [rows, vocab] float64 CDF stays small
        out = sampler(logits.expand(250, -1), [row(params, prompt) for _ in range(250)])
        counts += torch.bincount(torch.tensor(out.token_ids), minlength=vocab)
    outside = counts[ref == 0].sum()
    assert outside <= 2, f"{outside} draws outside the allowed set"  # rounding at the nucleus' edge
    c, p = binned(counts, ref)
    assert chi2_pvalue(c, p) > ALPHA


def test_bad_rows_are_clear_errors(cpp):
    x = torch.zeros(2, 10)
    with pytest.raises(RuntimeError, match=r"token 12 is outside the vocabulary \[0, 10\)"):
        cpp(x, [row(), row(SP(repetition_penalty=1.2), output=[3, 12])])
    with pytest.raises(ValueError, match=r"logits must be \[len\(rows\)=1, vocab\]"):
        cpp(x, [row()])
    with pytest.raises(TypeError, match="SeedGenerator"):
        cpp(x, [row(), row(generator=torch.Generator())])
    with pytest.raises(ValueError, match="sampler backend must be one of auto, cpp, torch, got 'fast'"):
        Sampler("fast")


def test_auto_uses_cpp_and_falls_back_to_torch_when_the_library_cannot_build(tmp_path):
    x = torch.zeros(1, 10)
    assert Sampler()._use_cpp(x) and not Sampler("torch")._use_cpp(x)
    script = ("import warnings, torch\n"
              "from kiln.runtime.core.sample.rows import SampleRow\nfrom kiln.runtime.core.sample.sampler import Sampler\n"
              "from kiln.runtime.sampling_params import SamplingParams\n"
              "with warnings.catch_warnings(record=True) as w:\n"
              "    warnings.simplefilter('always')\n"
              "    greedy = SampleRow(SamplingParams(temperature=0), [], [])\n"
              "    out = Sampler()(torch.tensor([[0.0, 9.0, 1.0]]), [greedy])\n"
              "print(out.token_ids, [str(m.message) for m in w])\n")
    env = {**os.environ, "KILN_CACHE_DIR": str(tmp_path), "CXX": "no-such-c++-compiler"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("[1] ") and "sampling with torch ops instead" in proc.stdout
    assert "'no-such-c++-compiler' is not on PATH" in proc.stdout


_EVERY_PATH = """
import torch
from kiln.runtime.core.sample.rows import SampleRow, make_generator
from kiln.runtime.core.sample.sampler import Sampler
from kiln.runtime.sampling_params import SamplingParams as SP
g = torch.Generator().manual_seed(0)
x = torch.randn(24, 8192, generator=g) * 3
x[3, ::5] = float("nan")
kinds = [SP(temperature=0, repetition_penalty=1.2, logprobs=5), SP(temperature=0.8, top_p=0.9),
         SP(temperature=0.7, top_k=50, top_p=0.95, repetition_penalty=1.1), SP(temperature=1.1, min_p=0.05, logprobs=2)]
rows = [SampleRow(kinds[i % 4], list(range(i, 300, 3)), list(range(i, 90, 2)), make_generator(i, 1), (2,))
        for i in range(24)]
out = Sampler("cpp")(x, rows)
print(out.token_ids, out.ranks, [sorted(d) if d else d for d in out.logprobs])
print(torch.ops.kiln_cpp.kernel_capability())  # what sampler.cpp picks too
"""


@pytest.mark.parametrize("capability", ["default", "avx2"])
def test_every_kernel_build_samples_alike(capability):
    """The DEFAULT and AVX2 builds of the kernel (ATEN_CPU_CAPABILITY picks them, as ATen's own)
    give the tokens, ranks and top logprobs this CPU's build gives."""
    here = io.StringIO()
    with contextlib.redirect_stdout(here):
        exec(_EVERY_PATH, {})
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    there = subprocess.run([sys.executable, "-c", _EVERY_PATH], env=env, capture_output=True, text=True, timeout=300)
    assert there.returncode == 0, there.stderr[-2000:]
    samples, kernel = there.stdout.splitlines()
    assert kernel == capability.upper() and samples == here.getvalue().splitlines()[0]
