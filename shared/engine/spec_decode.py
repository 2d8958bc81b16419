"""Speculative decoding: draft k tokens, verify them in one forward, keep what the
target model would have produced.

    end of a step:   proposer.propose(running requests) -> request.spec_token_ids
    next step:       the scheduler gives each drafted request 1 + d tokens (its last
                     token and d drafts) and their KV blocks; the runner returns the
                     logits of those 1 + d positions
    verify:          greedy: the drafts that match the target's argmax, then the
                     target's token; sampled: standard speculative sampling (a draft x
                     is kept with probability min(1, p(x) / q(x)), a rejected one is
                     replaced by a draw from norm(max(p - q, 0)); all kept: one more
                     draw from p), so the output has the target's distribution exactly
    update:          the kept tokens are appended, the rejected positions' KV is
                     dropped (num_computed_tokens stops after the last kept one; blocks
                     past the request's tokens go back)

A proposer only proposes: ``propose(requests, k)`` returns each request's drafts (maybe
fewer than k, maybe none) and, for the verifier, each draft's proposal distribution q
(None: a point mass on the draft, as n-gram lookup has). Adding a proposer (EAGLE, MTP
heads) needs no engine change.

Which requests are drafted for: those whose sampling the verifier reproduces exactly -
greedy or temperature / top-k / top-p / min-p sampling, seeded or not, with a logit bias
or a grammar or neither - once they are past ``min_tokens``. A grammar masks each of the
1 + d positions as it would mask that token sampled alone (its matcher taken through the
drafts and back), so a draft it refuses is never kept. A request with penalties, bad
words or logprobs decodes one token a step.
"""

from __future__ import annotations

import difflib
import logging
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pdmesh.shared.engine.request import Request

if TYPE_CHECKING:  # (torch is imported where it is used: config readers import this)
    import torch

log = logging.getLogger(__name__)

# vLLM's method names; "[ngram]" is its older spelling
NGRAM_METHODS = ("ngram", "[ngram]")
# the checkpoint's own multi-token-prediction layers (DeepSeek's num_nextn_predict_layers)
MTP_METHODS = ("mtp", "deepseek_mtp")
RUN_METHODS = NGRAM_METHODS + MTP_METHODS
# methods pdmesh knows of but does not run yet (listed as without effect)
NOT_YET = ("eagle", "eagle3", "medusa", "mlp_speculator", "draft_model", "suffix", "dflash",
           "dspark")
MAX_SPECULATIVE_TOKENS = 16
# vLLM's speculative_config keys pdmesh reads, and the others it knows (accepted and
# reported as without effect; any other key is refused as unknown)
TAKEN_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
              "disable_by_batch_size", "adaptive_drafts")
INACTIVE_KEYS = ("model", "draft_tensor_parallel_size", "quantization", "max_model_len",
                 "revision", "code_revision", "enforce_eager", "disable_padded_drafter_batch",
                 "speculative_token_tree", "disable_logprobs", "disable_log_stats",
                 "acceptance_method", "posterior_threshold", "posterior_alpha",
                 "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
                 "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob",
                 "parallel_drafting", "draft_model", "hf_overrides")


@dataclass(frozen=True)
class DynamicBudget:
    """vLLM-Ascend's ``dynamic_spec_config`` with method "dflash" (headless: a draft's
    confidence is the max softmax of the draft head's logits): its method_params.
    ("dspark", which reads a confidence head, is refused where the drafts have none.)"""

    method: str = "dflash"
    initial_verify_budget_per_req: int = 5
    budget_update_interval: int = 16  # decode steps with drafts between recomputations
    budget_threshold: float = 0.3
    min_verify_tokens: int = 1


class VerifyBudget:
    """How many of its drafts each request verifies, dflash's way.

    A cell (request r, draft j) survives with s_rj = c_r1 * ... * c_rj (c the drafts'
    confidences). A step verifies ``budget`` cells per request on average: each request
    gets its first ``min_verify_tokens``, the rest of the step's ``budget * requests``
    go to the surviving-most cells (a request's cells in order, as survival only falls
    along its drafts). Every ``budget_update_interval`` steps the budget becomes the
    mean number of cells per request whose survival reached ``budget_threshold`` over
    those steps, rounded up (and to the next odd number below k), within
    [min_verify_tokens, k]."""

    def __init__(self, config: DynamicBudget, k: int):
        self.config = config
        self.k = k
        self.budget = self._clamp(config.initial_verify_budget_per_req)
        self._steps = self._surviving = self._requests = 0

    def _clamp(self, b: int) -> int:
        return max(self.config.min_verify_tokens, min(self.k, b))

    def apply(self, drafts: list[Drafts]) -> list[Drafts]:
        """Each request's drafts cut to what it verifies this step."""
        cfg = self.config
        cells = []  # (-survival, position, request)
        for i, d in enumerate(drafts):
            survival = 1.0
            for j, c in enumerate(d.confidence or [1.0] * len(d.tokens)):
                survival *= c
                cells.append((-survival, j, i))
                self._surviving += survival >= cfg.budget_threshold
        self._requests += len(drafts)
        self._steps += 1
        counts = [min(cfg.min_verify_tokens, len(d.tokens)) for d in drafts]
        left = self.budget * len(drafts) - sum(counts)
        for _, j, i in sorted(cells):
            if left <= 0:
                break
            if j == counts[i]:  # the next of that request's drafts
                counts[i] += 1
                left -= 1
        if self._steps >= cfg.budget_update_interval:
            b = -(-self._surviving // max(1, self._requests))
            if b % 2 == 0 and b < self.k:
                b += 1
            self.budget = self._clamp(b)
            self._steps = self._surviving = self._requests = 0
        return [d.cut(n) for d, n in zip(drafts, counts, strict=True)]


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``--speculative-config`` (the keys pdmesh acts on)."""

    method: str  # "ngram" or "mtp"
    num_speculative_tokens: int | None  # None (MTP only): the checkpoint's MTP layers
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    # no drafts in a step while more requests than this run or wait (None: always draft)
    disable_by_batch_size: int | None = None
    # pdmesh's: each step verifies as many drafts (up to num_speculative_tokens) as the
    # measured step times and acceptance say pay for themselves (draft_length.py);
    # False: always num_speculative_tokens
    adaptive: bool = True
    # vLLM-Ascend's rejection_sampler_config (--additional-config): lossy, off by default
    enable_block_verify: bool = False
    enable_entropy_verify: bool = False
    posterior_threshold: float = 0.95
    posterior_alpha: float = 0.4
    # vLLM-Ascend's dynamic_spec_config (--additional-config): per-request verify budgets
    dynamic: DynamicBudget | None = None

    @property
    def is_mtp(self) -> bool:
        return self.method == "mtp"

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SpeculativeConfig:
        """ValueError naming the key for a value pdmesh cannot run. The defaults of the
        n-gram window are vLLM's: both 5 when neither is given, else the one given."""
        if not isinstance(raw, dict):
            raise ValueError(f"speculative_config: must be a JSON object, got {raw!r}")
        unknown = sorted(set(raw) - set(TAKEN_KEYS) - set(INACTIVE_KEYS))
        if unknown:
            near = difflib.get_close_matches(unknown[0], TAKEN_KEYS + INACTIVE_KEYS, 1)
            raise ValueError(f"speculative_config.{unknown[0]}: unknown key" + (
                f"; did you mean {near[0]!r}?" if near else
                f" (known: {', '.join(TAKEN_KEYS + INACTIVE_KEYS)})"))
        method = raw.get("method")
        if method not in RUN_METHODS:
            raise ValueError(f"speculative_config.method: pdmesh runs {', '.join(RUN_METHODS)}"
                             f", got {method!r}")
        k = raw.get("num_speculative_tokens")
        if k is None and method in MTP_METHODS:
            pass  # vLLM's default: as many as the checkpoint has MTP layers
        elif isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens: must be an integer "
                             f"in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        lo, hi = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = 5
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config.{name}: must be an integer >= 1, got "
                                 f"{value!r}")
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min: {lo} is more than "
                             f"prompt_lookup_max ({hi})")
        batch = raw.get("disable_by_batch_size")
        if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int)
                                  or batch < 1):
            raise ValueError(f"speculative_config.disable_by_batch_size: must be an integer "
                             f">= 1, got {batch!r}")
        adaptive = raw.get("adaptive_drafts", True)
        if not isinstance(adaptive, bool):
            raise ValueError(f"speculative_config.adaptive_drafts: must be true or false, got "
                             f"{adaptive!r}")
        return cls("mtp" if method in MTP_METHODS else "ngram", k, lo, hi, batch, adaptive)

    @staticmethod
    def inactive_keys(raw: dict[str, Any]) -> list[str]:
        """The keys of ``raw`` pdmesh accepts without acting on them."""
        return sorted(k for k in raw if k in INACTIVE_KEYS)


@dataclass
class Drafts:
    """What a proposer proposes for one request: the draft tokens and, per draft, the
    probabilities it drew them from ([d, V]); None: each draft was certain.
    ``confidence``: per draft, the proposer's estimate that it is accepted (the max
    softmax of a draft head's logits), for dynamic verify budgets."""

    tokens: list[int]
    probs: torch.Tensor | None = None
    confidence: list[float] | None = None

    def cut(self, n: int) -> Drafts:
        """The first ``n`` drafts."""
        return Drafts(self.tokens[:n], None if self.probs is None else self.probs[:n],
                      None if self.confidence is None else self.confidence[:n])


class Proposer(Protocol):
    """Proposes drafts at the end of a step. One that continues from the target's hidden
    states (MTP, EAGLE) sets ``needs_hidden``: the engine then keeps each step's rows
    and hidden states and hands them to ``absorb`` (after the step's tokens are
    appended, before ``propose``)."""

    needs_hidden: bool

    def absorb(self, rows: Any, keep: set[int]) -> None:
        """The step just run (``StepRows``); ``keep``: ids of finished requests whose
        blocks are still read (a prompt being put into the pool)."""
        ...

    def skip(self, rows: Any) -> None:
        """The step just run, not absorbed (no drafts follow it): what the proposer kept
        of its requests misses those positions."""
        ...

    def can_draft(self, request: Request) -> bool:
        """Whether ``propose`` may give this request drafts (False: its state has a
        gap)."""
        ...

    def propose(self, requests: list[Request], k: int) -> list[Drafts]:
        """Drafts (at most ``k`` tokens) for each request, in order."""
        ...


class NgramProposer:
    """Prompt lookup: the longest suffix of the request's tokens (between ``min_n`` and
    ``max_n`` tokens) that occurred before in them; the tokens that followed its latest
    earlier occurrence are the drafts.

    Each request's n-grams are indexed as its tokens grow (a request's tokens only ever
    grow), so a step's lookup costs the new tokens, not the whole sequence."""

    needs_hidden = False

    def __init__(self, min_n: int, max_n: int):
        self.min_n = min_n
        self.max_n = max_n
        # request -> (n -> {n-gram: its latest start}, tokens indexed so far)
        self._index: weakref.WeakKeyDictionary[Request, tuple[dict[int, dict], list[int]]] \
            = weakref.WeakKeyDictionary()

    def absorb(self, rows: Any, keep: set[int]) -> None:
        pass

    def skip(self, rows: Any) -> None:
        pass  # (the index reads the tokens, whenever asked)

    def can_draft(self, request: Request) -> bool:
        return True

    def propose(self, requests: list[Request], k: int) -> list[Drafts]:
        out = []
        for r in requests:
            index = self._index.get(r)
            if index is None:
                index = self._index[r] = ({n: {} for n in range(self.min_n, self.max_n + 1)},
                                          [0])
            out.append(Drafts(self._lookup(r.token_ids, k, *index)))
        return out

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """The drafts for ``tokens`` alone (no index kept)."""
        return self._lookup(tokens, k, {n: {} for n in range(self.min_n, self.max_n + 1)},
                            [0])

    def _lookup(self, tokens: list[int], k: int, grams: dict[int, dict],
                done: list[int]) -> list[int]:
        total = len(tokens)
        # index every n-gram ending before the last token (an earlier occurrence of the
        # suffix can end there at the latest); later starts overwrite earlier ones
        for end in range(done[0], total - 1):
            for n, seen in grams.items():
                start = end - n + 1
                if start >= 0:
                    seen[tuple(tokens[start:end + 1])] = start
        done[0] = max(done[0], total - 1)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            start = grams[n].get(tuple(tokens[total - n:]))
            if start is not None:
                return tokens[start + n:start + n + k]
        return []


def make_ngram_proposer(config: SpeculativeConfig) -> Proposer:
    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)


def drafts_allowed(req: Request) -> bool:
    """Whether the verifier reproduces this request's sampling exactly. (A grammar
    masks each verified position, a logit bias shifts each: both do; a bad word's ban
    depends on the tokens before each position, penalties on their counts: not yet.)"""
    sp = req.sampling_params
    return (not sp.has_penalties and sp.logprobs is None and not sp.bad_words_token_ids
            and req.num_output_tokens >= sp.min_tokens)


@dataclass
class SpecStats:
    """Counters as vLLM names them (vllm:spec_decode_num_*), since start."""

    num_drafts: int = 0  # verifications of one request's drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    draft_length: int = 0  # the drafts per request last chosen (a gauge)

    def record(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < drafted:
            self.accepted_per_position += [0] * (drafted - len(self.accepted_per_position))
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens \
            else 0.0


def verify(probs: torch.Tensor | None, argmax: torch.Tensor, drafts: Drafts,
           greedy: bool, generator_for: Any, thresholds: list[float] | None = None,
           block: bool = False) -> list[int]:
    """The tokens one request keeps from a step that verified ``drafts``: the accepted
    drafts, then the target's own token (a correction, or the bonus after all of them).

    ``probs``: the target's sampling distribution at the 1 + d positions, [1 + d, V]
    (None for a greedy request); ``argmax``: the target's argmax there, [1 + d].
    ``generator_for(j)``: the torch.Generator for the draws at the j-th position (None:
    the global one).

    Sampled requests: draft j (drawn from q_j; an n-gram draft is a point mass) passes
    when p_j(x) / q_j(x) >= tau_j * u_j, u_j uniform - standard speculative sampling with
    tau_j = 1, which keeps the target's distribution. vLLM-Ascend's lossy options:
    ``thresholds`` (entropy verify) give each position tau_j = min(exp(-alpha * H_j),
    posterior_threshold), H_j the entropy of the raw target distribution, so uncertain
    positions accept more; ``block`` (block verify) passes position k when
    pi_k >= tau_k * U_k, pi_k = min(pi_(k-1) * p_k(x) / q_k(x), 1) and U_k the product of
    the draws so far, and keeps every draft up to the last position that passes. A
    rejected position's token is drawn from norm(max(p - q, 0)); all kept: one more draw
    from p. Greedy requests keep the drafts that match the argmax, whatever the options."""
    if greedy:
        return _verify_greedy(drafts.tokens, argmax.tolist())
    assert probs is not None
    draws = _Draws(probs, drafts, generator_for)
    tau = thresholds or [1.0] * len(drafts.tokens)
    return draws.block(tau) if block else draws.one_by_one(tau)


def _verify_greedy(drafts: list[int], best: list[int]) -> list[int]:
    """The drafts that match the argmax, then the argmax after them."""
    kept = []
    for j, x in enumerate(drafts):
        if x != best[j]:
            return [*kept, best[j]]
        kept.append(x)
    return [*kept, best[len(drafts)]]


class _Draws:
    """A sampled request's verification draws, position by position."""

    def __init__(self, probs: torch.Tensor, drafts: Drafts, generator_for: Any):
        self.probs = probs  # [1 + d, V]
        self.drafts = drafts
        self.generator_for = generator_for

    def ratio(self, j: int) -> float:
        """p_j(x) / q_j(x); -1: q_j(x) = 0, never accepted."""
        x = self.drafts.tokens[j]
        q_x = 1.0 if self.drafts.probs is None else float(self.drafts.probs[j, x])
        return float(self.probs[j, x]) / q_x if q_x > 0 else -1.0

    def draw(self, j: int) -> tuple[float, Any]:
        import torch

        gen = self.generator_for(j)
        return float(torch.rand(1, generator=gen)), gen

    def bonus(self) -> int:
        """All drafts kept: one more draw from p, after them."""
        import torch

        d = len(self.drafts.tokens)
        return int(torch.multinomial(self.probs[d], 1, generator=self.generator_for(d)))

    def one_by_one(self, tau: list[float]) -> list[int]:
        kept = []
        for j, x in enumerate(self.drafts.tokens):
            r = self.ratio(j)
            u, gen = self.draw(j)
            if r >= 0 and r >= tau[j] * u:
                kept.append(x)
                continue
            return [*kept, _correction(self.probs, self.drafts, j, gen)]
        return [*kept, self.bonus()]

    def block(self, tau: list[float]) -> list[int]:
        d = len(self.drafts.tokens)
        passed, pi, big_u = 0, 1.0, 1.0
        for j in range(d):
            r = self.ratio(j)
            u, _ = self.draw(j)
            big_u *= u
            pi = 0.0 if r < 0 else min(pi * r, 1.0)
            if r >= 0 and pi >= tau[j] * big_u:
                passed = j + 1
        kept = list(self.drafts.tokens[:passed])
        if passed == d:
            return [*kept, self.bonus()]
        _, gen = self.draw(passed)  # (the position's draw again, then its correction)
        return [*kept, _correction(self.probs, self.drafts, passed, gen)]


def _correction(probs: torch.Tensor, drafts: Drafts, j: int, gen: Any) -> int:
    """A draw from norm(max(p_j - q_j, 0)) (p_j itself when that is all zero)."""
    import torch

    x = drafts.tokens[j]
    if drafts.probs is None:  # q a point mass on x: p without x
        residual = probs[j].clone()
        residual[x] = 0.0
    else:
        residual = (probs[j] - drafts.probs[j].to(probs.dtype)).clamp_min(0.0)
    if float(residual.sum()) <= 0.0:
        residual = probs[j]
    return int(torch.multinomial(residual, 1, generator=gen))
