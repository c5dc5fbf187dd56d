"""ZeRO-3 loads the policy partitioned: 2 CPU ranks (gloo, torchrun), one launch.

A tiny Llama with tied embeddings is saved with ``save_pretrained``; each rank loads it the way the
loop does (``load_policy(cfg.model, init_context=load_context(cfg))``, trainer at ZeRO-3 with every
parameter partitioned) and then, for comparison, whole (the ZeRO 0-2 path, which DeepSpeed partitions
when its engine is built). What can fail:

* a parameter that is not a partition: each rank's ``ds_tensor`` must hold half of ``ds_numel``
  (rounded up) while the module's own tensor is the empty placeholder, before any engine exists;
* the weights: gathered through the backend's sync stream they must equal the saved file bit for
  bit, the tied head included (one parameter, not a copy);
* transformers' ZeRO-3 switch must be off once the load returns (a model built later, such as a
  teacher, must not be partitioned by accident);
* one update (each rank half of a fixed batch, global normalizer, weight decay on) must give the
  same per-rank loss, grad norm and parameters as the same update of the model loaded whole; weight
  decay is what tells a matrix from a 1-D gain, which a partition's 1-D placeholder would hide;
* the HF export after that update (gathered, written by rank 0, the only rank that keeps the
  gathered copy) must hold the updated weights bit for bit.

In-process (no launch): the torch backend and ZeRO 0-2 load under an empty context, and a
``trainer.device`` DeepSpeed cannot drive is refused on entering the context, before anything loads.

Skipped without deepspeed. The launch: ~45 s on 2 busy cores (one torchrun start, two engines per rank).
"""

from __future__ import annotations

import json
import os
import textwrap

import pytest
import torch

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.long  # one torchrun launch, bounded by its own timeout

from test_multirank_loop import torchrun  # noqa: E402
from test_trainer_deepspeed import assert_same_params  # noqa: E402

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, torch
    sys.path.insert(0, {test_dir!r})
    from safetensors.torch import load_file
    from transformers.integrations import is_deepspeed_zero3_enabled

    from stapo.core.config import config_from_dict
    from stapo.core.trainer.models import count_params, is_partitioned, load_policy
    from stapo.core.trainer import build_trainer_backend, load_context
    from test_trainer_deepspeed import params, rollout_batch

    if __name__ == "__main__":
        ckpt, out = sys.argv[1], sys.argv[2]
        cfg = config_from_dict({{
            "model": {{"name_or_path": ckpt, "gradient_checkpointing": True}},
            "trainer": {{"backend": "deepspeed", "device": "auto", "zero_stage": 3,
                        "zero3_param_persistence_threshold": 0, "lr": 1e-2, "weight_decay": 0.1,
                        "max_grad_norm": 1.0, "micro_batch_size": 2, "logits_chunk_size": 5}},
        }})

        def update(model):
            b = build_trainer_backend(cfg, model, total_optimizer_steps=2)
            r = b.rank
            start = params(b)
            ids, attn, resp, w = rollout_batch(1)
            n = resp.sum()                   # the GLOBAL normalizer
            sl = slice(2 * r, 2 * r + 2)     # this rank's half of the batch
            lp, _ = b.token_stats(ids[sl], attn[sl], resp[sl], grad=True)
            loss = -(lp * w[sl]).sum() / n
            b.backward(loss)
            m = b.step()
            return b, start, {{"loss": loss.item(), **m}}, params(b)

        model, _ = load_policy(cfg.model, init_context=load_context(cfg))
        seen = {{
            "zero3_switch_after_load": is_deepspeed_zero3_enabled(),
            "partitioned": is_partitioned(model),
            "count": count_params(model),
            "tied": model.lm_head.weight is model.model.embed_tokens.weight,
            "shapes": {{n: [p.ds_numel, p.ds_tensor.numel(), p.numel()] for n, p in model.named_parameters()}},
        }}
        b, start, seen["partitioned_step"], after = update(model)
        rank = b.rank
        seen["kept_by_export"] = len(b.full_state_dict(rank0_only=True))  # only the writing rank keeps a copy
        b.export_hf(out + "_export", tokenizer=None)
        saved = load_file(os.path.join(ckpt, "model.safetensors"))
        seen["bit_equal"] = sorted(n for n in saved if torch.equal(start[n], saved[n]))
        seen["saved"] = sorted(saved)
        whole, _ = load_policy(cfg.model)  # no context: built whole, partitioned by the engine
        seen["whole_partitioned_before_engine"] = is_partitioned(whole)
        _, _, seen["whole_step"], after_whole = update(whole)
        if rank == 0:
            torch.save({{"partitioned": after, "whole": after_whole}}, out + ".pt")
        with open(f"{{out}}.rank{{rank}}.json", "w") as f:
            json.dump(seen, f)
        torch.distributed.barrier()
        sys.stdout.flush()
        os._exit(0)  # skip the interpreter teardown: gloo's threads can abort a normal exit
    """
)


def test_zero3_loads_partitioned_and_updates_like_whole(tmp_path):
    from stapo.core.config import TinyModel
    from stapo.core.trainer.models import build_tiny_model, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    model = build_tiny_model(TinyModel(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64), tok)
    assert model.config.tie_word_embeddings
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    full = {n: p.numel() for n, p in model.named_parameters()}

    script = tmp_path / "zero3_load.py"
    script.write_text(SCRIPT.format(test_dir=os.path.dirname(__file__)))
    out = tmp_path / "out"
    torchrun([str(script), str(ckpt), str(out)], tmp_path)
    seen = [json.loads((tmp_path / f"out.rank{r}.json").read_text()) for r in range(2)]

    for s in seen:
        assert s["partitioned"] and not s["zero3_switch_after_load"] and s["tied"]
        assert s["count"] == sum(full.values())
        assert s["shapes"].keys() == full.keys()
        for name, (ds_numel, local, placeholder) in s["shapes"].items():
            # each rank holds ceil(numel / 2) elements (DeepSpeed pads the last partition)
            assert (ds_numel, local, placeholder) == (full[name], -(-full[name] // 2), 0), name
        assert s["bit_equal"] == s["saved"]  # every saved tensor, gathered, is the saved bytes
        assert "lm_head.weight" not in s["saved"]  # tied: stored once, as the embedding
        assert not s["whole_partitioned_before_engine"]
        part, whole = s["partitioned_step"], s["whole_step"]
        assert part["skipped"] == whole["skipped"] == 0.0
        assert part["loss"] == pytest.approx(whole["loss"], rel=1e-6)
        assert part["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-6) and part["grad_norm"] > 0
    assert seen[0]["partitioned_step"]["loss"] != seen[1]["partitioned_step"]["loss"]  # each rank its half

    buffers = len(list(model.named_buffers()))  # the rotary tables ride along
    assert [s["kept_by_export"] for s in seen] == [len(full) + buffers, 0]
    after = torch.load(tmp_path / "out.pt")
    from safetensors.torch import load_file

    exported = load_file(tmp_path / "out_export" / "model.safetensors")
    assert_same_params({n: exported[n] for n in full}, after["partitioned"], atol=0)
    assert_same_params(after["partitioned"], after["whole"], atol=1e-7)
    moved = max((after["partitioned"][n] - p.detach()).abs().max().item() for n, p in model.named_parameters())
    assert moved > 1e-3  # the update did something to compare


def _cfg(backend: str, stage: int, device: str = "auto", name: str = "tiny-random"):
    from stapo.core.config import config_from_dict

    return config_from_dict({"model": {"name_or_path": name},
                             "trainer": {"backend": backend, "device": device, "zero_stage": stage}})


@pytest.mark.parametrize(("backend", "stage"), [("torch", 3), ("deepspeed", 0), ("deepspeed", 2)])
def test_only_zero3_loads_under_a_context(backend, stage):
    """The torch backend and ZeRO 0-2 load whole: their context switches nothing on (no process group)."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    from stapo.core.trainer import load_context

    with load_context(_cfg(backend, stage)):
        assert not is_deepspeed_zero3_enabled()


def test_a_device_deepspeed_does_not_drive_is_refused_before_the_load(tmp_path):
    """trainer.device=cuda while DeepSpeed's accelerator is the CPU: one line naming the key, before
    from_pretrained reads anything (the path does not even exist)."""
    from stapo.core.trainer import load_context
    from stapo.core.trainer.models import load_policy

    cfg = _cfg("deepspeed", 3, device="cuda", name=str(tmp_path / "no-such-model"))
    with pytest.raises(ValueError, match=r"^trainer.device='cuda' but DeepSpeed's accelerator is 'cpu'"):
        load_policy(cfg.model, init_context=load_context(cfg))
