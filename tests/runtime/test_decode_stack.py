"""A decode-only step's layers in one native call (runtime/decode_stack.py, csrc/decode_stack.c):
the same bits as the per-op path, at every ISA level (an AVX-512 level this CPU lacks on SIMDe,
tests/runtime/isa_levels.py), for packed, int8 and deterministic-mode linears, over batches of
decodes at different contexts in a scrambled pool; greedy decodes at each level give the portable
build's tokens; and it stays out of the way where it cannot run."""

from __future__ import annotations

import pytest
import torch

from servelab.runtime import block_quant, native
from servelab.runtime.kv_cache import PagedKVCache
from servelab.runtime.loader import load_model
from servelab.runtime.model import AttentionMetadata
from servelab.runtime.ops import OPS_NAMES, TorchOps
from tests.runtime.isa_levels import make_ops_at
from tests.tiny_models import max_rel_diff, write_tiny_llama

from .test_weights import _write_gguf

CPU = torch.device("cpu")
NATIVE_OPS = [name for name in OPS_NAMES if name != "torch"]
BLOCK = 4  # small blocks: contexts span several, scattered through the pool


@pytest.fixture(scope="module")
def gguf_models(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("decode-stack")
    return {fmt: _write_gguf(tiny_llama, out / f"tiny-{fmt}.gguf", fmt) for fmt in ("Q4_1", "Q8_0")}


@pytest.fixture(scope="module")
def odd_gguf(tmp_path_factory):
    """A Q4_1 model whose sizes are not multiples of 64: head_dim 48 (16-lane score tiles, one
    32-dim P V tile and a 16-dim tail), 3 and 9 blocks of 32 inputs, int8 groups padded to 64."""
    out = tmp_path_factory.mktemp("decode-stack-odd")
    hf = write_tiny_llama(out / "hf", hidden=96, heads=2, kv_heads=1, intermediate=288, seed=3)
    return _write_gguf(hf, out / "odd-Q4_1.gguf", "Q4_1")


class _Pool:
    """Sequences in a paged cache with scrambled block tables, stepped by model.forward."""

    def __init__(self, model, prompts: list[list[int]], kv_dtype: torch.dtype, max_len: int = 40):
        per_seq = -(-max_len // BLOCK)
        blocks = per_seq * len(prompts) + 1
        self.kv = PagedKVCache(model.config, blocks, BLOCK, dtype=kv_dtype)
        for t in self.kv.k_layers + self.kv.v_layers:  # unwritten slots compare equal too
            t.zero_()
        order = (
            torch.randperm(blocks - 1, generator=torch.Generator().manual_seed(len(prompts)))[: per_seq * len(prompts)]
            + 1
        )
        self.tables = order.view(len(prompts), per_seq)
        self.model = model
        self.tokens = [list(p) for p in prompts]

    def slot(self, seq: int, pos: int) -> int:
        return int(self.tables[seq, pos // BLOCK]) * BLOCK + pos % BLOCK

    def prefill(self) -> list[torch.Tensor]:
        """Each prompt's last logits."""
        last = []
        for i, toks in enumerate(self.tokens):
            n = len(toks)
            meta = AttentionMetadata(
                positions=torch.arange(n),
                slots=torch.tensor([self.slot(i, p) for p in range(n)]),
                num_decodes=0,
                block_size=BLOCK,
                decode_block_table=None,
                decode_ctx_lens=None,
                decode_max_ctx=0,
                decode_ctx_slots=None,
                decode_mask=None,
                prefills=[(0, n, 0, None)],
                logits_indices=torch.tensor([n - 1]),
            )
            last.append(self.model.forward(torch.tensor(toks), meta, self.kv.k_layers, self.kv.v_layers)[-1])
        return last

    def decode_meta(self, every_row: bool = False, argmax: bool = False) -> AttentionMetadata:
        pos = torch.tensor([len(t) - 1 for t in self.tokens])
        ctx = pos + 1
        max_ctx = int(ctx.max())
        slots = torch.tensor([self.slot(i, int(p)) for i, p in enumerate(pos)])
        return AttentionMetadata(
            positions=pos,
            slots=slots,
            num_decodes=len(self.tokens),
            block_size=BLOCK,
            decode_block_table=self.tables.contiguous(),
            decode_ctx_lens=ctx,
            decode_max_ctx=max_ctx,
            decode_ctx_slots=None,
            decode_mask=None,
            prefills=[],
            logits_indices=None if every_row else torch.arange(len(self.tokens)),  # None: the stack runs the head
            argmax=argmax,
        )

    def step(self, next_tokens: list[int], every_row: bool = False, argmax: bool = False) -> torch.Tensor:
        for toks, t in zip(self.tokens, next_tokens):
            toks.append(t)
        ids = torch.tensor([t[-1] for t in self.tokens])
        return self.model.forward(ids, self.decode_meta(every_row, argmax), self.kv.k_layers, self.kv.v_layers)


def _stack_against_per_op(model, kv_dtype=torch.float32, steps: int = 6, head: bool = True) -> None:
    """Decodes of three sequences at different contexts, run with the stack and op by op from the
    same cache: the same logits and the same cache, bit for bit. The stack's steps alternate
    between ending in the LM head (every row samples) and leaving the head to the model (logits
    of chosen rows); the per-op steps take the model's own tail, gathering the rows. Where the
    head runs in the call, every other such step also reads each row's argmax there: the
    sampler's argmax of the logits."""
    stack = model.decode_stack
    assert stack is not None
    assert stack.has_head == head
    calls = []
    stack.logits = lambda *a: calls.append(1) or type(stack).logits(stack, *a)  # the instance's: counted
    prompts = [[5, 9, 17], [3] * 11 + [44, 7], [100, 200, 300, 7, 8, 9, 10, 11]]
    pools = [_Pool(model, prompts, kv_dtype) for _ in range(2)]
    model.decode_stack = None
    for pool in pools:
        pool.prefill()
    next_tokens = [1, 2, 3]
    for i in range(steps):
        model.decode_stack = stack
        fused = pools[0].step(next_tokens, every_row=i % 2 == 0, argmax=i % 4 == 0)
        greedy = model.greedy_tokens(fused)
        assert greedy == (native.argmax_rows(stack.kernels, fused) if head and i % 4 == 0 else None)
        assert model.greedy_tokens(fused) is None  # read once
        model.decode_stack = None
        per_op = pools[1].step(next_tokens)
        assert model.greedy_tokens(per_op) is None
        assert torch.equal(fused, per_op)
        for a, b in zip(pools[0].kv.k_layers + pools[0].kv.v_layers, pools[1].kv.k_layers + pools[1].kv.v_layers):
            assert torch.equal(a, b)
        next_tokens = fused.argmax(-1).tolist()
    assert stack._arena.numel() > 0  # the stack did run
    assert len(calls) == (steps + 1) // 2 if head else not calls  # and ended in the head where asked
    del stack.logits
    model.decode_stack = stack


@pytest.mark.parametrize("name", NATIVE_OPS)
@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
def test_stack_gives_the_per_op_bits_on_packed_weights(gguf_models, name, fmt, monkeypatch):
    model = load_model(gguf_models[fmt], dtype=torch.float32).model
    model.use_ops(make_ops_at(name, monkeypatch))
    _stack_against_per_op(model)


@pytest.mark.parametrize("name", NATIVE_OPS)
@pytest.mark.parametrize("odd", [False, True], ids=["hd16", "hd48"])
@pytest.mark.parametrize("kind", ["int8", "bf16"])
def test_stack_gives_the_per_op_bits_quantized_and_with_a_16_bit_cache(
    gguf_models, odd_gguf, name, odd, kind, monkeypatch
):
    model = load_model(odd_gguf if odd else gguf_models["Q4_1"], dtype=torch.float32).model
    model.use_ops(make_ops_at(name, monkeypatch))
    model.quantize(kind)
    _stack_against_per_op(model, kv_dtype=torch.float16)


@pytest.mark.parametrize("name", NATIVE_OPS)
def test_stack_gives_the_per_op_bits_at_odd_sizes(odd_gguf, name, monkeypatch):
    model = load_model(odd_gguf, dtype=torch.float32).model
    model.use_ops(make_ops_at(name, monkeypatch))
    _stack_against_per_op(model, kv_dtype=torch.bfloat16)


@pytest.mark.parametrize("name", [n for n in NATIVE_OPS if n.startswith("invariant")])
def test_deterministic_mode_runs_dense_models_on_the_stack_too(tiny_llama, name, monkeypatch):
    model = load_model(tiny_llama, dtype=torch.float32).model  # dense fp32: the panel kernel's F32 segments
    model.use_ops(make_ops_at(name, monkeypatch))
    assert model.decode_stack is not None and model.decode_stack.invariant
    _stack_against_per_op(model, kv_dtype=torch.bfloat16)


def _greedy(model, kv_dtype: torch.dtype, steps: int = 5) -> tuple[list[list[int]], torch.Tensor]:
    """Three prompts prefilled op by op, then `steps` greedy decodes of them together through the
    stack: every step's tokens and all the logits."""
    assert model.decode_stack is not None
    pool = _Pool(model, [[5, 9, 17], [3] * 11 + [44, 7], [100, 200, 300, 7, 8, 9, 10, 11]], kv_dtype)
    logits = [torch.stack(pool.prefill())]
    tokens = [logits[0].argmax(-1).tolist()]
    for _ in range(steps):
        logits.append(pool.step(tokens[-1]))
        tokens.append(logits[-1].argmax(-1).tolist())
    return tokens, torch.cat(logits)


@pytest.mark.parametrize("level", [lv.name for lv in native.ISA_LEVELS if lv.name != "portable"])
@pytest.mark.parametrize("kind", ["native", "invariant"])
@pytest.mark.parametrize("quant", [None, "int8", "bf16"], ids=["q4_1", "int8", "bf16"])
@pytest.mark.parametrize("odd", [False, True], ids=["hd16", "hd48"])
def test_greedy_decode_at_every_level_gives_the_portable_builds_tokens(
    gguf_models, odd_gguf, level, kind, quant, odd, monkeypatch
):
    """Prefill and greedy decode through the stack at each ISA level (AVX-512 on SIMDe where the
    CPU lacks it) against the portable build, on the tiny model and on one with odd sizes: the
    same tokens, logits equal up to fp32 order."""
    runs = []
    for name in (f"{kind}-portable", f"{kind}-{level}"):
        model = load_model(odd_gguf if odd else gguf_models["Q4_1"], dtype=torch.float32).model
        model.use_ops(make_ops_at(name, monkeypatch))
        if quant:
            model.quantize(quant)
        runs.append(_greedy(model, torch.float16 if quant == "int8" else torch.float32))
    (want_tokens, want), (got_tokens, got) = runs
    assert got_tokens == want_tokens
    assert max_rel_diff(got, want) <= 1e-5


def test_stack_is_built_only_where_it_can_run(tiny_llama, gguf_models):
    dense = load_model(tiny_llama, dtype=torch.float32).model
    assert dense.decode_stack is None or dense.ops.batch_invariant  # MKL serves dense fp32 linears
    packed = load_model(gguf_models["Q4_1"], dtype=torch.float32).model
    if packed.ops.name == "torch":
        pytest.skip("no native kernels here")
    assert packed.decode_stack is not None
    packed.use_ops(TorchOps())
    assert packed.decode_stack is None


def _q4_1_stack(gguf_models):
    """The tiny Q4_1 model with its decode stack (the test skips where there is none)."""
    model = load_model(gguf_models["Q4_1"], dtype=torch.float32).model
    if model.decode_stack is None:
        pytest.skip("no native kernels here")
    return model, model.decode_stack


def test_stack_leaves_prefills_and_big_batches_to_the_per_op_path(gguf_models):
    model, stack = _q4_1_stack(gguf_models)
    pool = _Pool(model, [[1, 2, 3]], torch.float32)
    meta = pool.decode_meta()
    assert stack.accepts(meta, 1)
    assert not stack.accepts(meta, 2)  # the rows are not all decodes
    # past these rows the per-op path sums in another order: MKL's GEMM (up to AVX2) or the
    # k-major panel (AVX-512), each faster there
    limit = block_quant.same_order_max_rows(stack.kernels)
    assert stack.max_rows == limit
    meta.num_decodes = limit
    assert stack.accepts(meta, limit)
    meta.num_decodes = limit + 1
    assert not stack.accepts(meta, limit + 1)
    meta.num_decodes, meta.prefills = 1, [(1, 3, 0, None)]
    assert not stack.accepts(meta, 1)


def test_stack_at_its_row_limit_gives_the_per_op_bits(gguf_models):
    """As many decodes as the stack takes: the per-op path still sums them in the stack's order
    (one more row and it would take MKL or the k-major panel)."""
    model, stack = _q4_1_stack(gguf_models)
    n = block_quant.same_order_max_rows(stack.kernels)
    prompts = [[5 + i % 50, 9, 17][: 1 + i % 3] for i in range(n)]
    pools = [_Pool(model, prompts, torch.float32) for _ in range(2)]
    model.decode_stack = None
    for pool in pools:
        pool.prefill()
    try:
        for every_row in (True, False):
            model.decode_stack = stack
            fused = pools[0].step([1] * n, every_row=every_row)
            model.decode_stack = None
            assert torch.equal(fused, pools[1].step([1] * n))
    finally:
        model.decode_stack = stack


def test_arena_is_reused_as_the_context_grows_and_keeps_the_bits(gguf_models):
    model, stack = _q4_1_stack(gguf_models)
    pools = [_Pool(model, [[7] * 30], torch.float32, max_len=48) for _ in range(2)]
    for pool in pools:
        pool.prefill()
    got, arenas = [], set()
    for t in range(10, 18):
        got.append(pools[0].step([t]))
        arenas.add(stack._arena.data_ptr())
    assert len(arenas) <= 2  # sized by the first step, grown (doubled) at most once
    model.decode_stack = None
    want = [pools[1].step([t]) for t in range(10, 18)]
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_the_argmax_read_in_the_call_marks_a_non_finite_row(gguf_models):
    """A row whose logits hold a NaN gets -1 (the sampler ends that request with an error); the
    rows beside it keep their argmax."""
    model, stack = _q4_1_stack(gguf_models)
    pool = _Pool(model, [[1, 2, 3], [4, 5], [6]], torch.float32)
    pool.prefill()
    model.embed[9] = float("nan")  # the stack embeds from this very tensor
    logits = pool.step([8, 9, 10], every_row=True, argmax=True)
    greedy = model.greedy_tokens(logits)
    assert logits[1].isnan().all() and greedy[1] == -1
    assert [greedy[0], greedy[2]] == native.argmax_rows(stack.kernels, logits[[0, 2]].contiguous())


def test_a_token_id_outside_the_vocabulary_raises_on_both_paths(gguf_models):
    model, stack = _q4_1_stack(gguf_models)
    pool = _Pool(model, [[1, 2, 3]], torch.float32)
    pool.prefill()
    vocab = model.embed.shape[0]
    for s in (stack, None):
        model.decode_stack = s
        for bad in (vocab, -1):
            with pytest.raises(IndexError):
                pool.model.forward(
                    torch.tensor([bad]), pool.decode_meta(every_row=True), pool.kv.k_layers, pool.kv.v_layers
                )
    model.decode_stack = stack


@pytest.mark.parametrize("name", [n for n in NATIVE_OPS if n.startswith("native")])
@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
def test_stack_gives_the_per_op_bits_on_the_int8_dot_products(gguf_models, name, fmt, monkeypatch):
    """The default's int8 dot products over the blocks from block_quant.Q8_MIN_ROWS rows: the
    three-row decodes run them in the stack as the per-op path does, and the stack takes any
    number of decodes (both paths sum a row the same way at every row count past the threshold)."""
    model = load_model(gguf_models[fmt], dtype=torch.float32).model
    model.use_ops(make_ops_at(name, monkeypatch))
    model.use_q8(2)
    assert model.q8_linears() == len(model.layers) * 4 + 1
    assert model.decode_stack.max_rows is None and model.decode_stack.head_max_rows is None
    _stack_against_per_op(model)
