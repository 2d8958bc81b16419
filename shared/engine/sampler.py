"""Turn one step's logits into tokens, batched across requests.

Order, as vLLM applies it: the structured-output grammar's mask -> raw logprobs (if
asked) -> bad_words -> min_tokens masking of stop tokens -> logit_bias -> repetition /
presence / frequency penalties -> greedy argmax, or temperature -> top-k / top-p (device
kernel) -> min-p -> sample (seeded rows from their own generator). Fast path: an
all-greedy batch without penalties, bias, bad words or logprobs is one argmax (after any
grammar's mask).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdmesh.shared.engine.request import Logprob, Request
from pdmesh.shared.engine.spec_decode import Drafts, SpeculativeConfig, verify
from pdmesh.shared.engine.structured import apply_bitmask, new_bitmask
from pdmesh.shared.kernels import KernelBackend


def position_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded request's ``position``-th output token: a
    function of the request's seed and the position only (splitmix64), so a request
    that moves - prefill to decode, a decode instance that died, a preemption - draws
    exactly what it would have drawn staying where it was."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xD1B54A32D192ED03) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


_MASK64 = (1 << 64) - 1


def _position_generator(req: Request):
    """``j`` -> the generator of the request's draws for its output position
    num_output_tokens + j (None: an unseeded request draws from the global one)."""
    def generator_for(j: int) -> torch.Generator | None:
        if req.generator is None:
            return None
        req.generator.manual_seed(position_seed(req.sampling_params.seed,
                                                req.num_output_tokens + j))
        return req.generator
    return generator_for


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # per row: {token: Logprob} for the sampled token and the top-n, or None
    logprobs: list[dict[int, Logprob] | None]


class Sampler:
    def __init__(self, backend: KernelBackend, vocab_size: int):
        self.backend = backend
        self.vocab_size = vocab_size

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> SamplerOutput:
        """logits [B, V] float32, one row per request in ``reqs``."""
        params = [r.sampling_params for r in reqs]
        if any(r.grammar is not None for r in reqs):
            logits = self._mask_by_grammar(logits, reqs)
        if all(p.is_plain_greedy for p in params):  # the common case: one argmax
            return SamplerOutput(self.backend.greedy(logits).tolist(), [None] * len(reqs))
        want_logprobs = any(p.logprobs is not None for p in params)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        if any(p.bad_words_token_ids for p in params):
            logits = self._ban_bad_words(logits, reqs)
        if any(p.min_tokens for p in params):
            logits = self._mask_early_stops(logits, reqs)
        if any(p.logit_bias for p in params):
            logits = self._apply_logit_bias(logits, params)
        if any(p.has_penalties for p in params):
            logits = self._apply_penalties(logits, reqs)
        greedy = [p.is_greedy for p in params]
        if all(greedy):
            tokens = self.backend.greedy(logits)
        else:
            tokens = self._sample(logits, reqs, greedy)
        token_list = tokens.tolist()
        lps: list[dict[int, Logprob] | None] = [None] * len(reqs)
        if raw_logprobs is not None:
            lps = ranked_logprobs(raw_logprobs, tokens, [p.logprobs for p in params])
        return SamplerOutput(token_list, lps)

    def verify(self, logits: torch.Tensor, reqs: list[Request], drafts: list[Drafts],
               lossy: SpeculativeConfig | None = None) -> list[list[int]]:
        """Speculative decoding's verification: ``logits`` [sum(1 + d_i), V] holds each
        request's 1 + d_i positions in order (its last token, then its d_i drafts).
        Returns each request's kept tokens (``spec_decode.verify``). Only requests that
        ``drafts_allowed`` come here: no penalties, logprobs, bad words or pending
        min_tokens; a grammar masks each position as it would mask that token sampled
        alone, and logit_bias shifts every row of its request.
        ``lossy``: the SpeculativeConfig whose vLLM-Ascend options (entropy verify, and
        block verify in steps where some request verifies 3 drafts or more) apply."""
        counts = [1 + len(d.tokens) for d in drafts]
        params = [r.sampling_params for r, n in zip(reqs, counts, strict=True)
                  for _ in range(n)]
        if any(r.grammar is not None for r in reqs):
            logits, drafts = self._mask_drafts_by_grammar(logits, reqs, drafts, counts)
        if any(p.logit_bias for p in params):
            logits = self._apply_logit_bias(logits, params)
        greedy = [p.is_greedy for p in params]
        argmax = self.backend.greedy(logits)
        probs = None if all(greedy) else self.probs(logits, params, greedy)
        tau = None
        if lossy is not None and lossy.enable_entropy_verify and probs is not None:
            raw = torch.softmax(logits, dim=-1)  # the raw target distribution
            entropy = -(raw * torch.log(raw + 1e-10)).sum(dim=-1)
            tau = torch.exp(-lossy.posterior_alpha * entropy).clamp_max(
                lossy.posterior_threshold).tolist()
        block = (lossy is not None and lossy.enable_block_verify
                 and max(counts) - 1 >= 3)
        out, row = [], 0
        for r, d, n in zip(reqs, drafts, counts, strict=True):
            is_greedy = r.sampling_params.is_greedy
            out.append(verify(None if is_greedy or probs is None else probs[row:row + n],
                              argmax[row:row + n], d, is_greedy, _position_generator(r),
                              None if tau is None else tau[row:row + n - 1], block))
            row += n
        return out

    def _mask_drafts_by_grammar(self, logits: torch.Tensor, reqs: list[Request],
                                drafts: list[Drafts], counts: list[int]
                                ) -> tuple[torch.Tensor, list[Drafts]]:
        """``logits`` [sum(counts), V] with -inf on what each grammar forbids at each of
        its request's positions (``Grammar.fill_drafts``), and each request's drafts cut
        before the first its grammar refuses (the masked target could not keep it)."""
        bitmask = new_bitmask(len(logits), self.vocab_size)
        rows: list[int] = []
        cut, at = [], 0
        for r, d, n in zip(reqs, drafts, counts, strict=True):
            if r.grammar is not None:
                r.grammar.sync(r.output_token_ids)
                d = d.cut(r.grammar.fill_drafts(bitmask, at, d.tokens))
                rows += range(at, at + n)
            cut.append(d)
            at += n
        return apply_bitmask(logits, rows, bitmask[rows]), cut

    def _mask_by_grammar(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """-inf on the tokens each grammar forbids next (its state caught up first on
        the outputs it has not seen: carried in, or sampled last step). A grammar whose
        reasoning is still open masks nothing: its row is left as it is."""
        for r in reqs:
            if r.grammar is not None:
                r.grammar.sync(r.output_token_ids)
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None and r.grammar.active]
        if not rows:
            return logits
        bitmask = new_bitmask(len(rows), self.vocab_size)
        for k, i in enumerate(rows):
            reqs[i].grammar.fill(bitmask, k)
        return apply_bitmask(logits, rows, bitmask)

    def _apply_logit_bias(self, logits: torch.Tensor, params: list) -> torch.Tensor:
        rows, cols, bias = [], [], []
        for i, p in enumerate(params):
            for token, b in p.logit_bias.items():
                if token < self.vocab_size:
                    rows.append(i)
                    cols.append(token)
                    bias.append(b)
        logits = logits.clone()
        dev = logits.device
        logits.index_put_((torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                          torch.tensor(bias, dtype=logits.dtype, device=dev), accumulate=True)
        return logits

    def _ban_bad_words(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """-inf on each bad word's last token where the output so far ends with the
        word's other tokens (vLLM's ``apply_bad_words``: the output only, not the
        prompt; a one-token word everywhere)."""
        rows, cols = [], []
        for i, r in enumerate(reqs):
            out = r.output_token_ids
            for word in r.sampling_params.bad_words_token_ids:
                *prefix, last = word
                if last < self.vocab_size and len(prefix) <= len(out) \
                        and out[len(out) - len(prefix):] == prefix:
                    rows.append(i)
                    cols.append(last)
        if not rows:
            return logits
        logits = logits.clone()
        logits[rows, cols] = float("-inf")
        return logits

    def _mask_early_stops(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        rows, cols = [], []
        for i, r in enumerate(reqs):
            sp = r.sampling_params
            if r.num_output_tokens < sp.min_tokens:
                stops = set(sp.stop_token_ids)
                if not sp.ignore_eos:
                    stops.update(r.eos_token_ids)
                stops = {t for t in stops if t < self.vocab_size}
                rows += [i] * len(stops)
                cols += list(stops)
        if not rows:
            return logits
        logits = logits.clone()
        logits[rows, cols] = float("-inf")
        return logits

    def _apply_penalties(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        b, v = logits.shape
        dev = logits.device
        out_counts = torch.zeros((b, v), dtype=torch.float32, device=dev)
        seen = torch.zeros((b, v), dtype=torch.bool, device=dev)  # prompt or output
        rep, pres, freq = [], [], []
        for i, r in enumerate(reqs):
            sp = r.sampling_params
            rep.append(sp.repetition_penalty)
            pres.append(sp.presence_penalty)
            freq.append(sp.frequency_penalty)
            out = r.output_token_ids
            if out:
                idx = torch.tensor(out, dtype=torch.long, device=dev)
                out_counts[i].index_add_(0, idx, torch.ones(len(out), device=dev))
            if sp.repetition_penalty != 1.0:
                seen[i, torch.tensor(r.token_ids, dtype=torch.long, device=dev)] = True
        rep_t = torch.tensor(rep, device=dev).unsqueeze(1)
        pres_t = torch.tensor(pres, device=dev).unsqueeze(1)
        freq_t = torch.tensor(freq, device=dev).unsqueeze(1)
        penalized = torch.where(logits > 0, logits / rep_t, logits * rep_t)
        logits = torch.where(seen, penalized, logits)
        logits = logits - freq_t * out_counts - pres_t * (out_counts > 0).float()
        return logits

    def _sample(self, logits: torch.Tensor, reqs: list[Request], greedy: list[bool]
                ) -> torch.Tensor:
        dev = logits.device
        params = [r.sampling_params for r in reqs]
        argmax = self.backend.greedy(logits)
        probs = self.probs(logits, params, greedy)
        generators = {}
        for i, r in enumerate(reqs):
            if r.generator is not None:  # its draw for this position, wherever it runs
                r.generator.manual_seed(position_seed(r.sampling_params.seed,
                                                      r.num_output_tokens))
                generators[i] = r.generator
        sampled = self.backend.random_sample(probs, generators)
        greedy_t = torch.tensor(greedy, device=dev)
        return torch.where(greedy_t, argmax, sampled)

    def probs(self, logits: torch.Tensor, params: list, greedy: list[bool]) -> torch.Tensor:
        """The distribution each row samples from: temperature (1 on greedy rows, which
        take the argmax instead), top-k / top-p, min-p; [B, V]."""
        dev = logits.device
        temps = torch.tensor([1.0 if g else p.temperature for g, p in zip(greedy, params,
                                                                          strict=True)],
                             dtype=torch.float32, device=dev)
        scaled = logits / temps.unsqueeze(1)
        top_k = top_p = None
        if any(p.top_k > 0 for p in params):
            top_k = torch.tensor([p.top_k if p.top_k > 0 else self.vocab_size for p in params],
                                 dtype=torch.long, device=dev)
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
        scaled = self.backend.top_k_top_p(scaled, top_k, top_p)
        probs = torch.softmax(scaled, dim=-1)
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev)
            floor = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
            probs = probs.masked_fill(probs < floor, 0.0)
        return probs


def ranked_logprobs(raw: torch.Tensor, tokens: torch.Tensor, counts: list[int | None]
                    ) -> list[dict[int, Logprob] | None]:
    """Row i's entry: ``{tokens[i]: its logprob and rank, then the top counts[i]}`` under
    the log-probabilities ``raw`` [B, V] (None where counts[i] is None): the sampled
    tokens' logprobs, and the prompt tokens' (prompt_logprobs)."""
    n_max = max(n or 0 for n in counts)
    chosen = raw.gather(1, tokens.unsqueeze(1)).squeeze(1)  # [B]
    ranks = (raw > chosen.unsqueeze(1)).sum(dim=-1) + 1  # [B]
    top_vals, top_ids = raw.topk(n_max, dim=-1) if n_max else (None, None)
    chosen_l, ranks_l, tokens_l = chosen.tolist(), ranks.tolist(), tokens.tolist()
    top_vals_l = top_vals.tolist() if top_vals is not None else None
    top_ids_l = top_ids.tolist() if top_ids is not None else None
    out: list[dict[int, Logprob] | None] = []
    for i, n in enumerate(counts):
        if n is None:
            out.append(None)
            continue
        d = {tokens_l[i]: Logprob(chosen_l[i], ranks_l[i])}
        for j in range(n):
            assert top_ids_l is not None and top_vals_l is not None
            tid = top_ids_l[i][j]
            if tid not in d:
                d[tid] = Logprob(top_vals_l[i][j], j + 1)
        out.append(d)
    return out
