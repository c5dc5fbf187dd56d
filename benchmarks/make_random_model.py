"""Write a random-weight causal LM of a real model's shape, plus a tokenizer, as an HF folder.

For GPU benchmarks on machines without a model hub: the step time of a policy depends on
its shape, not its weights. ``qwen3-1.7b`` is Qwen3-1.7B's published config (28 layers, hidden
2048, 16 query / 8 KV heads of dim 128, MLP 6144, vocab 151,936, tied embeddings; values from
the model card's config.json); ``tiny-qwen3`` keeps the vocabulary and shrinks the rest (dry runs).
The tokenizer is stapo's character-level tiny tokenizer (built in code; ids it does not know
decode to nothing), so the sampled text is noise and every reward is 0 unless ``--force-length``
work is what is measured.

    python benchmarks/make_random_model.py --arch qwen3-1.7b --out /tmp/qwen3-1.7b-random
"""

from __future__ import annotations

import argparse

ARCHS = {
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151_936, max_position_embeddings=40_960,
                       rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151_936, max_position_embeddings=40_960,
                       rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "tiny-qwen3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=151_936, max_position_embeddings=4096,
                       rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="qwen3-1.7b", choices=sorted(ARCHS))
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from stapo.core.trainer.models import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    cfg = Qwen3Config(**ARCHS[args.arch], bos_token_id=None, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(args.seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen3ForCausalLM(cfg).to(getattr(torch, args.dtype))
    model.save_pretrained(args.out, safe_serialization=True)
    tok.save_pretrained(args.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"{args.arch}: {n / 1e6:.1f}M parameters ({args.dtype}) -> {args.out}")


if __name__ == "__main__":
    main()
