"""Test helpers (not part of the package): a real, tiny Llama-family model written on the spot,
so tests of every package can run the engine end to end without downloading anything, and
`prefill_logits` / `max_rel_diff` to compare the model's logits with a reference.

`write_tiny_llama` writes an HF-format directory: `config.json`, `model.safetensors` (random
weights), `tokenizer.json` (a byte-level BPE trained in-process) and `tokenizer_config.json`
(with a ChatML chat template). Both servelab and HF `transformers` load it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS_TOKEN, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS = (
    "the a an of to in on at for with from by about into over after before under between "
    "model token cache block prefill decode batch queue server request latency throughput "
    "memory bandwidth compute kernel layer head attention weight matrix vector sequence "
    "paris france capital city river bread cheese wine music art history language "
    "one two three four five six seven eight nine ten hundred thousand "
    "is are was were be been being has have had do does did will would can could should "
    "quick brown fox jumps lazy dog hello world what where when why how who which "
    "fast slow big small long short new old first last good bad high low hot cold"
).split()


def _corpus(seed: int, n: int = 400) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 9999)))
        line = " ".join(words)
        lines.append(line.capitalize() + rng.choice([".", "?", "!", ","]))
    # A few non-ASCII lines so byte-level merges inside multi-byte characters get exercised.
    lines += ["café crème brûlée", "naïve façade", "日本語のテキスト", "emoji 🙂 and ✓ marks"] * 3
    return lines


def _write_tokenizer(path: Path, vocab_size: int, seed: int) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    tok.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(tok.token_to_id(t)): {
                "content": t,
                "special": True,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
            }
            for t in SPECIAL_TOKENS
        },
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return tok.get_vocab_size()


def write_tiny_llama(
    path: str | Path,
    *,
    vocab_size: int = 512,
    num_layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    seed: int = 0,
    tie_embeddings: bool = False,
    qkv_bias: bool = False,
    rope_theta: float = 10000.0,
    rope_scaling: dict | None = None,
    max_position_embeddings: int = 2048,
) -> Path:
    """Write a random Llama (or, with `qkv_bias`, a Qwen2) model in HF format and return its directory.

    Weights are scaled like a trained model's (activations of order one), so the logits have
    clear winners and greedy decoding does not hinge on rounding noise.
    """
    import torch
    from safetensors.torch import save_file

    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden={hidden} must divide by heads={heads}, and heads by kv_heads={kv_heads}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer_size = _write_tokenizer(path, vocab_size, seed)
    if tokenizer_size > vocab_size:
        raise ValueError(f"tokenizer has {tokenizer_size} tokens, more than vocab_size={vocab_size}")

    head_dim = hidden // heads
    intermediate = intermediate or 3 * hidden
    gen = torch.Generator().manual_seed(seed)

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return torch.randn(out_features, in_features, generator=gen) / in_features**0.5

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=gen)

    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(vocab_size, hidden, generator=gen)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = norm(hidden)
        tensors[p + "post_attention_layernorm.weight"] = norm(hidden)
        tensors[p + "self_attn.q_proj.weight"] = linear(heads * head_dim, hidden)
        tensors[p + "self_attn.k_proj.weight"] = linear(kv_heads * head_dim, hidden)
        tensors[p + "self_attn.v_proj.weight"] = linear(kv_heads * head_dim, hidden)
        tensors[p + "self_attn.o_proj.weight"] = linear(hidden, heads * head_dim)
        if qkv_bias:
            tensors[p + "self_attn.q_proj.bias"] = 0.1 * torch.randn(heads * head_dim, generator=gen)
            tensors[p + "self_attn.k_proj.bias"] = 0.1 * torch.randn(kv_heads * head_dim, generator=gen)
            tensors[p + "self_attn.v_proj.bias"] = 0.1 * torch.randn(kv_heads * head_dim, generator=gen)
        tensors[p + "mlp.gate_proj.weight"] = linear(intermediate, hidden)
        tensors[p + "mlp.up_proj.weight"] = linear(intermediate, hidden)
        tensors[p + "mlp.down_proj.weight"] = linear(hidden, intermediate)
    tensors["model.norm.weight"] = norm(hidden)
    if not tie_embeddings:
        # Scaled up so the logits spread over several units: clear greedy winners.
        tensors["lm_head.weight"] = 4.0 * linear(vocab_size, hidden)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    eos_id = tok.token_to_id(IM_END)
    config = {
        "architectures": ["Qwen2ForCausalLM" if qkv_bias else "LlamaForCausalLM"],
        "model_type": "qwen2" if qkv_bias else "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": tie_embeddings,
        "attention_bias": False,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": tok.token_to_id(EOS_TOKEN),
        "torch_dtype": "float32",
    }
    if qkv_bias:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=num_layers)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_id}))
    return path


# ------------------------------------------------------------------ model-level test helpers


def prefill_logits(model, token_ids: list[int], *, chunk: int | None = None, block_size: int = 16, kv_dtype=None):
    """fp32 logits at every position of `token_ids`, computed through a paged cache (in
    `kv_dtype`, default the model's dtype).

    With `chunk`, the prompt goes in chunks of that many tokens (each after the first attends to
    the earlier ones through the cache); `chunk=1` runs every token through the decode path.
    """
    import torch

    from servelab.runtime.kv_cache import PagedKVCache
    from servelab.spec.kv_groups import KVGroups

    T = len(token_ids)
    nb = -(-T // block_size) + 1
    groups = KVGroups.of_model(model.config).num_groups  # a block table per KV group, on disjoint pages
    kv = PagedKVCache(model.config, nb * groups + 3, block_size, dtype=kv_dtype or model.dtype)
    # Scrambled block tables, so a wrong slot computation cannot pass by accident.
    tables = [list(range(nb * (g + 1) + 2, nb * g + 2, -1)) for g in range(groups)]
    chunk = chunk or T
    out = []
    for start in range(0, T, chunk):
        n = min(chunk, T - start)
        ids = torch.tensor(token_ids[start : start + n])
        metas = [_chunk_metadata(table, start, n, block_size) for table in tables]
        meta = metas[0]
        if groups > 1:
            meta.by_group = metas
        out.append(model.forward(ids, meta, kv.k_layers, kv.v_layers))
    return torch.cat(out)


def _chunk_metadata(table: list[int], start: int, n: int, block_size: int):
    """The attention metadata of positions [start, start + n) over one block table: a decode
    when n == 1, else a prefill chunk."""
    import torch

    from servelab.runtime.model import AttentionMetadata

    slot = lambda p: table[p // block_size] * block_size + p % block_size  # noqa: E731
    slots = torch.tensor([slot(p) for p in range(start, start + n)])
    if n == 1:
        return AttentionMetadata(
            positions=torch.tensor([start]),
            slots=slots,
            num_decodes=1,
            block_size=block_size,
            decode_block_table=torch.tensor([table]),
            decode_ctx_lens=torch.tensor([start + 1]),
            decode_max_ctx=start + 1,
            decode_ctx_slots=torch.tensor([[slot(p) for p in range(start + 1)]]),
            decode_mask=torch.ones(1, 1, 1, start + 1, dtype=torch.bool),
            prefills=[],
            logits_indices=torch.tensor([0]),
        )
    ctx = None if start == 0 else torch.tensor([slot(p) for p in range(start + n)])
    return AttentionMetadata(
        positions=torch.arange(start, start + n),
        slots=slots,
        num_decodes=0,
        block_size=block_size,
        decode_block_table=None,
        decode_ctx_lens=None,
        decode_max_ctx=0,
        decode_ctx_slots=None,
        decode_mask=None,
        prefills=[(0, n, start, ctx)],
        logits_indices=torch.arange(n),
    )


def max_rel_diff(ours, ref) -> float:
    """Largest absolute difference relative to the largest reference logit."""
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())
