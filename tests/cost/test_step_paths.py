"""The profile's decode-only/prefill split follows the engine: on the bundled model, a step runs
the one-call decode stack exactly when `has_prefill` says it holds no prompt tokens."""

from __future__ import annotations

import pytest

from servelab.cost.profile import has_prefill
from servelab.cost.roofline import Roofline

pytestmark = pytest.mark.slow


def bundled_engine(max_model_len: int, max_num_batched_tokens: int):
    """The bundled model in fp32 without the prefix cache, and its decode stack (skips where
    either is missing)."""
    from servelab.engine.bundled import bundled_model_path
    from servelab.engine.llm_engine import EngineArgs, LLMEngine

    try:
        path = bundled_model_path()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"bundled model unavailable: {e}")
    engine = LLMEngine.from_args(
        EngineArgs.from_kwargs(
            model=str(path),
            dtype="float32",
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=False,
        )
    )
    stack = engine.executor.model.decode_stack
    if stack is None:
        engine.close()
        pytest.skip("no native decode stack on this host")
    return engine, stack


def test_the_engine_takes_the_one_call_path_exactly_on_decode_only_steps():
    from servelab.core.sequence import SamplingParams

    engine, stack = bundled_engine(max_model_len=256, max_num_batched_tokens=32)
    try:
        took: list[bool] = []
        accepts = stack.accepts
        stack.accepts = lambda meta, rows: took.append(accepts(meta, rows)) or took[-1]
        priced: list[bool] = []
        execute = engine.executor.execute

        def recorded(plan):  # noqa: ANN001, ANN202
            if not plan.is_empty:
                priced.append(not has_prefill(*Roofline.totals(plan.shape())[:2]))
            return execute(plan)

        engine.executor.execute = recorded
        params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
        engine.add_request("a", list(range(10, 50)), params)  # 40 tokens: two chunks of the 32-token budget
        steps = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
            if steps == 3:  # joins while "a" decodes: mixed steps, then decodes of two
                engine.add_request("b", list(range(60, 80)), params)
    finally:
        engine.close()
    assert took == priced
    assert True in took and False in took  # both paths ran


def test_a_decode_batch_past_the_packed_rows_takes_the_path_it_is_priced_on():
    # the decode stack takes up to block_quant.same_order_max_rows rows (MAX_ROWS up to AVX2, then
    # MKL; KMAJOR_MIN_ROWS - 1 at AVX-512, then the k-major panel), and past that the profile
    # (with the engine's kernel_rows) prices the per-op path, as the engine runs it
    from servelab.commands.calibrate import kernel_rows_of
    from servelab.core.sequence import SamplingParams
    from servelab.cost.profile import KernelRows, per_op_path
    from servelab.runtime import block_quant

    engine, stack = bundled_engine(max_model_len=64, max_num_batched_tokens=1024)
    try:
        found = kernel_rows_of(engine)
        rows = KernelRows.from_dict(found)
        assert rows.max_rows == stack.max_rows
        n, on_stack = (rows.max_rows or block_quant.MAX_ROWS) + 2, rows.max_rows is None
        took: list[tuple[int, bool]] = []
        accepts = stack.accepts
        stack.accepts = lambda meta, k: took.append((k, accepts(meta, k))) or took[-1][1]
        params = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0)
        for i in range(n):  # one prefill step of 2-token prompts, then one decode step of all
            engine.add_request(f"r{i}", [10 + i % 50, 11], params)
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.close()
    decodes = [stack_took for k, stack_took in took if k == n]
    assert decodes and all(stack_took == on_stack for stack_took in decodes)
    assert per_op_path(n, n, rows) == (not on_stack) and not per_op_path(n - 2, n - 2, rows)
