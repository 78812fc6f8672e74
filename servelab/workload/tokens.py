"""Synthetic prompt token ids for a RequestSpec: reproducible, and identical over the shared
prefix of every request in the same prefix group, so the prefix cache hits as it would on real
traffic with a common system prompt."""

from __future__ import annotations

import numpy as np

from servelab.workload.spec import RequestSpec

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_GOLDEN = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


def _stream(key: int, n: int, vocab_size: int) -> list[int]:
    # splitmix64's finaliser: a counter in, well-spread bits out; position i does not depend on
    # how many tokens are drawn, so a longer prefix of the same group extends a shorter one.
    # In place on one array: the simulator draws a 1,024-token prompt per request, and at that
    # size numpy's per-call overhead and temporaries, not the arithmetic, are the cost.
    # (Array integer arithmetic wraps modulo 2**64 without a warning; only scalars warn.)
    if n <= 0:
        return []  # most requests have no shared prefix: skip the ~10 numpy calls
    x = np.arange(n, dtype=np.uint64)
    x += np.uint64((key * _GOLDEN) & _MASK)
    x ^= x >> _S30
    x *= _M1
    x ^= x >> _S27
    x *= _M2
    x ^= x >> _S31
    x %= np.uint64(vocab_size)
    return x.tolist()  # values < vocab_size: plain Python ints, as the int64 copy gave


def token_ids_for(spec: RequestSpec, vocab_size: int, seed: int = 0) -> list[int]:
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    # Distinct key spaces for group prefixes and per-request suffixes.
    suffix = _stream((seed << 40) ^ spec.index, spec.prompt_tokens - spec.prefix_tokens, vocab_size)
    if not spec.prefix_tokens:
        return suffix
    prefix = _stream((seed << 40) ^ (1 << 39) ^ spec.prefix_group, spec.prefix_tokens, vocab_size)
    return prefix + suffix


def has_own_tokens(spec: RequestSpec) -> bool:
    """Whether simulated_prompt gives the request tokens of its own: then, its index being unique
    in the run, no other request's blocks hash like its blocks from there on."""
    return spec.prompt_tokens > spec.prefix_tokens


def simulated_prompt(spec: RequestSpec, block_size: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """The simulator's prompt: stand-in token ids and the hash of every full block, for the prefix
    cache, without drawing a token per position.

    Only the prefix cache reads a simulated prompt, and only to tell blocks apart, so the
    simulator needs each full block's identity, not its tokens: block i is the group's block i
    when it lies wholly inside the shared prefix, and the request's own otherwise, exactly the
    blocks that equal (up to a 64-bit collision) when the prompts are `token_ids_for`'s. The token
    ids are one negative tag per group prefix and per request: no real id, and the partly filled
    last block, which the engine hashes from its tokens when decoding fills it, still tells a
    request's own tokens from another's. Drawing 1,024 ids and hashing them per request was
    about a sixth of a simulator run.
    """
    num_prefix = min(spec.prefix_tokens, spec.prompt_tokens)
    num_own = spec.prompt_tokens - num_prefix
    prefix_tag = -2 - 2 * spec.prefix_group
    own_tag = -3 - 2 * spec.index
    token_ids = [prefix_tag] * num_prefix + [own_tag] * num_own
    shared_blocks = num_prefix // block_size
    # Block i of a group or request is its base + i: a random 64-bit base (Python's hash of a
    # tuple of ints is the same in every process; only str hashes are salted) keeps two ranges
    # apart barring a 64-bit coincidence, and range() builds the list in C.
    group_base = hash((seed, 0, spec.prefix_group))
    own_base = hash((seed, 1, spec.index))
    hashes = list(range(group_base, group_base + shared_blocks))
    hashes += range(own_base + shared_blocks, own_base + spec.prompt_tokens // block_size)
    return token_ids, hashes
