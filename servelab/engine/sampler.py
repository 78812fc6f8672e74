"""Next-token sampling for a batch: penalties, greedy, temperature, top-k, top-p, min-p, seeds, logprobs.

The sampler runs every step for every running sequence (up to a few hundred rows of a ~50k-150k
vocabulary), so everything is batched over rows; only a request with its own seed gets a row of
random numbers drawn on its own, from a generator seeded by (seed, output tokens so far). That
makes a seeded request's output independent of what else shares the batch, and reproducible
across preemption (recompute keeps the output tokens, hence the step index).

Sampling inverts the CDF with one uniform per row (a cumulative sum and a binary search): a
draw needs one random number, not one per vocabulary entry as the exponential race
(torch.multinomial) does, which is several times slower on CPU at a 50k vocabulary.
"""

from __future__ import annotations

import torch

from servelab.core.plan import TokenLogprobs
from servelab.core.sequence import Sequence
from servelab.runtime import native
from servelab.engine.logits_processors import LogitsProcessors

# Temperatures below this are treated as greedy: dividing by ~0 overflows and means argmax anyway.
_GREEDY_TEMPERATURE = 1e-5
_MASK = float("-inf")
NON_FINITE_LOGITS = "the model produced non-finite logits (NaN or inf)"
_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio increment (splitmix64) to decorrelate per-step seeds
_U64 = (1 << 64) - 1


def _step_seed(seed: int, step: int) -> int:
    """A well-mixed 63-bit seed for request seed `seed` at output token index `step` (splitmix64)."""
    z = (seed * _SEED_MIX + (step + 1) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


class Sampler:
    """Chooses one token per row of `logits`; row i belongs to `seqs[i]`."""

    def __init__(self, seed: int = 0, logits_processors: LogitsProcessors | None = None):
        # Unseeded requests share this generator: reproducible run to run, but their draws do
        # depend on batch composition (as in vLLM).
        self._generator = torch.Generator().manual_seed(seed)
        self.logits_processors = logits_processors
        self.row_errors: dict[int, str] = {}  # the last sample()'s rows that got None, and why

    @staticmethod
    def plain_greedy(seqs: list[Sequence]) -> bool:
        """Whether every row's token is its logits' argmax as the model made them: greedy, with
        no penalty, min_tokens, logit edit or logprobs."""
        for s in seqs:
            p = s.params
            if p.temperature >= _GREEDY_TEMPERATURE or p.presence_penalty or p.frequency_penalty or p.min_tokens:
                return False
            if p.repetition_penalty != 1.0:
                return False
            if p.logprobs is not None or p.edits_logits:
                return False
        return True

    def sample(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        argmax: list[int] | None = None,
        drafts: list[int] | None = None,
    ) -> tuple[list[int | None], list[TokenLogprobs | None] | None]:
        """Token ids, and per row its logprobs (None where the request did not ask), or None
        when no request in the batch asked for logprobs.

        `drafts`: per row, a proposed token to verify (-1: none; speculative decoding). A greedy
        row's token is its argmax, which accepts the draft when they agree. A random row keeps
        the draft with probability p(draft), else draws from p without it, renormalised: exact
        rejection sampling for a deterministic proposal, so the row's token is distributed as p
        either way, and equals the draft exactly when the draft is accepted.

        `argmax`: each row's argmax (-1 for a non-finite row) where the forward read it with the
        logits (model.greedy_tokens); taken as the tokens when every row is `plain_greedy`.

        A row whose logits are not all finite (the model overflowed: NaN or inf) gets None, not
        a token: the scheduler then ends that request with finish reason "error", and the rest
        of the batch goes on (a NaN row would otherwise sample an id past the vocabulary). So
        does a row whose logits processors fail (its grammar rejects its output).

        The rows of requests with logit edits (logit_bias, a grammar ...) are edited in `logits`
        itself: the executor does not read them afterwards, and copying a whole batch's logits
        for a few constrained rows would slow every row."""
        n, vocab = logits.shape
        if n != len(seqs):
            raise ValueError(f"logits has {n} rows but {len(seqs)} sequences were given")
        if argmax is not None and len(argmax) == n and self.plain_greedy(seqs):
            self.row_errors = {i: NON_FINITE_LOGITS for i, t in enumerate(argmax) if t < 0}
            return [t if t >= 0 else None for t in argmax], None
        if logits.dtype != torch.float32:
            logits = logits.float()
        bad_rows = _nonfinite_rows(logits)
        self.row_errors = dict.fromkeys(bad_rows, NON_FINITE_LOGITS)
        if bad_rows:
            logits = logits.clone()
            logits[bad_rows] = 0.0  # sampled like any row, then discarded
        params = [s.params for s in seqs]

        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        # Logprobs are reported for the model's distribution, before penalties and temperature
        # (vLLM's default "raw_logprobs").
        raw_logprobs = torch.log_softmax(logits[logprob_rows], dim=-1) if logprob_rows else None

        logits = self._apply_repetition_penalty(logits, seqs)
        logits = self._apply_penalties(logits, seqs)
        logits = self._apply_min_tokens(logits, seqs)
        if self.logits_processors is not None:  # logit_bias, allowed_token_ids, bad_words, grammars
            failed = self.logits_processors.apply(logits, seqs)  # in place: see sample()'s docstring
            if failed:
                self.row_errors.update(failed)
                bad_rows = sorted(set(bad_rows) | set(failed))

        greedy_rows = [i for i, p in enumerate(params) if p.temperature < _GREEDY_TEMPERATURE]
        if len(greedy_rows) == n:
            sampled = _argmax(logits)
        else:
            token_ids = torch.empty(n, dtype=torch.long)
            if greedy_rows:
                token_ids[greedy_rows] = torch.tensor(_argmax(logits[greedy_rows]), dtype=torch.long)
            random_rows = [i for i, p in enumerate(params) if p.temperature >= _GREEDY_TEMPERATURE]
            token_ids[random_rows] = self._sample_random(logits, seqs, random_rows, drafts)
            sampled = token_ids.tolist()
        logprobs = None if raw_logprobs is None else self._logprobs(raw_logprobs, logprob_rows, sampled, params, n)
        tokens: list[int | None] = list(sampled)
        for i in bad_rows:
            tokens[i] = None
            if logprobs is not None:
                logprobs[i] = None
        return tokens, logprobs

    # ------------------------------------------------------------------ logits transforms

    @staticmethod
    def _apply_repetition_penalty(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """vLLM's (HF's) semantics, before the OpenAI penalties as in vLLM: the logit of every token
        seen in the prompt or the output so far is divided by the penalty where positive and
        multiplied by it where not, so a penalty above 1 always makes a seen token less likely."""
        rows = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1.0]
        if not rows:
            return logits
        seen = torch.zeros(len(rows), logits.shape[1], dtype=torch.bool)
        for j, i in enumerate(rows):
            ids = torch.tensor(seqs[i].token_ids, dtype=torch.long)
            seen[j, ids[ids < logits.shape[1]]] = True
        penalty = torch.tensor([seqs[i].params.repetition_penalty for i in rows]).unsqueeze(1)
        x = logits if len(rows) == logits.shape[0] else logits[rows]
        penalised = torch.where(x > 0, x / penalty, x * penalty)
        x = torch.where(seen, penalised, x)
        if len(rows) == logits.shape[0]:
            return x
        logits = logits.clone()
        logits[rows] = x
        return logits

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """OpenAI semantics over the output tokens so far: logit -= frequency * count + presence * (count > 0)."""
        rows = [
            i
            for i, s in enumerate(seqs)
            if (s.params.presence_penalty or s.params.frequency_penalty) and s.num_output_tokens
        ]
        if not rows:
            return logits
        outputs = [seqs[i].output_token_ids for i in rows]
        width = max(len(o) for o in outputs)
        index = torch.tensor([o + [0] * (width - len(o)) for o in outputs], dtype=torch.long)
        weight = torch.tensor([[1.0] * len(o) + [0.0] * (width - len(o)) for o in outputs])
        counts = torch.zeros(len(rows), logits.shape[1]).scatter_add_(1, index, weight)
        frequency = torch.tensor([seqs[i].params.frequency_penalty for i in rows]).unsqueeze(1)
        presence = torch.tensor([seqs[i].params.presence_penalty for i in rows]).unsqueeze(1)
        penalty = frequency * counts + presence * (counts > 0).float()
        if len(rows) == logits.shape[0]:
            return logits - penalty
        logits = logits.clone()
        logits[rows] -= penalty
        return logits

    @staticmethod
    def _apply_min_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Until a request has min_tokens outputs, its EOS and stop token ids cannot be sampled."""
        cloned = False
        for i, s in enumerate(seqs):
            p = s.params
            if p.min_tokens and s.num_output_tokens < p.min_tokens:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(s.eos_token_ids))
                banned = [t for t in banned if 0 <= t < logits.shape[1]]
                if banned:
                    if not cloned:
                        logits, cloned = logits.clone(), True
                    logits[i, banned] = _MASK
        return logits

    def _sample_random(
        self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int], drafts: list[int] | None = None
    ) -> torch.Tensor:
        params = [seqs[i].params for i in rows]
        vocab = logits.shape[1]
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32).unsqueeze(1)
        x = (logits if len(rows) == logits.shape[0] else logits[rows]) / temperature

        topk_rows = [j for j, p in enumerate(params) if 0 < p.top_k < vocab]
        if topk_rows:
            x = _apply_to_rows(x, topk_rows, _top_k_mask, [params[j].top_k for j in topk_rows])
        topp_rows = [j for j, p in enumerate(params) if p.top_p < 1.0]
        if topp_rows:
            x = _apply_to_rows(x, topp_rows, _top_p_mask, [params[j].top_p for j in topp_rows])

        probs = torch.softmax(x, dim=-1)
        minp_rows = [j for j, p in enumerate(params) if p.min_p > 0.0]
        if minp_rows:
            probs = _apply_to_rows(probs, minp_rows, _min_p_mask, [params[j].min_p for j in minp_rows])

        # One uniform per row; a seeded row draws it from its own generator, so its token depends
        # only on its own logits and (seed, step).
        uniform = torch.empty(len(rows))
        unseeded = [j for j, p in enumerate(params) if p.seed is None]
        if len(unseeded) == len(rows):
            uniform.uniform_(generator=self._generator)
        else:
            if unseeded:
                uniform[unseeded] = torch.rand(len(unseeded), generator=self._generator)
            for j, p in enumerate(params):
                if p.seed is not None:
                    g = torch.Generator().manual_seed(_step_seed(p.seed, seqs[rows[j]].num_output_tokens))
                    uniform[j] = torch.rand(1, generator=g)
        row_drafts = [-1] * len(rows) if drafts is None else [drafts[i] for i in rows]
        if max(row_drafts) >= 0:
            return _sample_draft_first(probs, uniform, row_drafts)
        return _inverse_cdf_sample(probs, uniform)

    # ------------------------------------------------------------------ logprobs

    @staticmethod
    def _logprobs(
        raw_logprobs: torch.Tensor, rows: list[int], tokens: list[int], params: list, n: int
    ) -> list[TokenLogprobs | None]:
        out: list[TokenLogprobs | None] = [None] * n
        chosen = raw_logprobs.gather(1, torch.tensor([[tokens[i]] for i in rows])).squeeze(1).tolist()
        top_n = max(params[i].logprobs for i in rows)
        top_values: list[list[float]] = [[] for _ in rows]
        top_ids: list[list[int]] = [[] for _ in rows]
        if top_n > 0:
            values, ids = torch.topk(raw_logprobs, min(top_n, raw_logprobs.shape[1]), dim=-1)
            top_values, top_ids = values.tolist(), ids.tolist()
        for j, i in enumerate(rows):
            k = params[i].logprobs
            out[i] = TokenLogprobs(tokens[i], chosen[j], list(zip(top_ids[j][:k], top_values[j][:k])))
        return out


def _nonfinite_rows(logits: torch.Tensor) -> list[int]:
    """The rows holding a NaN or an inf: the native check on CPU fp32; elsewhere a row's sum,
    which any of them makes non-finite (so would logits beyond ~1e33, which are no better), far
    cheaper than isfinite(logits).all(-1)."""
    kernels = native.native_kernels() if logits.device.type == "cpu" else None
    if kernels is not None and logits.is_contiguous():
        return native.nonfinite_rows(kernels, logits)
    return (~torch.isfinite(logits.sum(dim=-1))).nonzero().flatten().tolist()


def _argmax(logits: torch.Tensor) -> list[int]:
    """Each row's argmax (the first index of its largest value); the native kernel on CPU fp32,
    torch's own elsewhere. The rows hold no NaN (sample() sets non-finite rows aside first)."""
    kernels = native.native_kernels() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    if kernels is None or not logits.is_contiguous():
        return logits.argmax(dim=-1).tolist()
    return native.argmax_rows(kernels, logits)


def _apply_to_rows(x: torch.Tensor, rows: list[int], transform, row_params: list) -> torch.Tensor:
    """transform(x[rows], row_params) written back; without the gather/scatter copies when every row takes part."""
    if len(rows) == x.shape[0]:
        return transform(x, row_params)
    x[rows] = transform(x[rows], row_params)
    return x


def _inverse_cdf_sample(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Row i: the first token whose cumulative probability exceeds uniform[i] x the row's total.
    Masked tokens (probability 0) add nothing to the CDF, so they can never be the first to exceed."""
    cdf = torch.cumsum(probs, dim=-1)
    total = cdf[:, -1:]
    tokens = torch.searchsorted(cdf, uniform.unsqueeze(1) * total, right=True).squeeze(1)
    overflow = tokens >= probs.shape[1]  # u x total rounded up to total: take the last token with mass
    if overflow.any():
        tokens[overflow] = torch.searchsorted(cdf[overflow], total[overflow], right=False).squeeze(1)
    return tokens


def _sample_draft_first(probs: torch.Tensor, uniform: torch.Tensor, drafts: list[int]) -> torch.Tensor:
    """Inverse-CDF sampling with each row's draft (-1: none) first in the CDF's order: the draft
    when u x total < p(draft) (probability p(draft)), else the rest's inverse CDF at the leftover
    u, which is uniform over it. One uniform per row, as without drafts, so seeds still decide."""
    rows = [j for j, d in enumerate(drafts) if d >= 0]
    idx = torch.tensor(rows, dtype=torch.long)
    draft = torch.tensor([drafts[j] for j in rows], dtype=torch.long)
    total = probs[idx].sum(dim=-1)
    p_draft = probs[idx, draft]
    rest = total - p_draft
    target = uniform[idx] * total
    # A draft that holds all the mass (top_k 1, a sure token) is kept even where u x total rounds up.
    keep = (target < p_draft) | (rest <= 0)
    probs = probs.clone()
    probs[idx, draft] = 0.0
    uniform = uniform.clone()
    uniform[idx] = torch.where(keep, 0.0, ((target - p_draft) / rest.clamp(min=1e-38)).clamp(0.0, 1.0))
    tokens = _inverse_cdf_sample(probs, uniform)
    tokens[idx[keep]] = draft[keep]
    return tokens


def _top_k_mask(x: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """Keep each row's k largest logits (ties with the k-th are kept too); no full sort."""
    k = torch.tensor(ks, dtype=torch.long).unsqueeze(1)
    top = torch.topk(x, max(ks), dim=-1).values
    threshold = top.gather(1, k - 1)
    return x.masked_fill(x < threshold, _MASK)


# Nucleus candidates looked at before falling back to a full sort of the vocabulary.
_TOP_P_CANDIDATES = 256


def _top_p_mask(x: torch.Tensor, ps: list[float]) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches p (nucleus).

    A language model's nucleus is usually a few dozen tokens, so look for it among the top
    candidates first (topk is far cheaper than sorting 50k+ logits); only rows whose nucleus is
    wider pay for the full sort.
    """
    p = torch.tensor(ps, dtype=torch.float32).unsqueeze(1)
    if x.shape[1] > 2 * _TOP_P_CANDIDATES:
        probs = torch.softmax(x, dim=-1)
        top_probs, _ = torch.topk(probs, _TOP_P_CANDIDATES, dim=-1)
        mass_before = torch.cumsum(top_probs, dim=-1) - top_probs
        found = mass_before[:, -1:].squeeze(1) >= p.squeeze(1)  # the nucleus ends inside the candidates
        if found.any():
            # nucleus size; at least the top token even where p rounds to 0 in float32 (< 1e-45)
            keep = (mass_before < p).sum(dim=-1, keepdim=True).clamp_(min=1)
            threshold = top_probs.gather(1, keep - 1)
            out = x.masked_fill(probs < threshold, _MASK)
            if not found.all():
                rest = (~found).nonzero().squeeze(1)
                out[rest] = _top_p_mask_sorted(x[rest], p[rest])
            return out
    return _top_p_mask_sorted(x, p)


def _top_p_mask_sorted(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    sorted_x, order = torch.sort(x, dim=-1, descending=True)
    sorted_probs = torch.softmax(sorted_x, dim=-1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop = mass_before >= p
    drop[:, 0] = False  # the most likely token always stays
    sorted_x = sorted_x.masked_fill(drop, _MASK)
    return torch.empty_like(x).scatter_(1, order, sorted_x)


def _min_p_mask(probs: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    """Drop tokens less likely than min_p times the most likely one."""
    threshold = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_ps, dtype=torch.float32).unsqueeze(1)
    return probs.masked_fill(probs < threshold, 0.0)
