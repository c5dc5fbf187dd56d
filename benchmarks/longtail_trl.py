"""The learner step at the shape of real RL: stapo packed, stapo row-padded and TRL's GRPOTrainer, one run.

The workload is benchmarks/longtail.py's, built by its own functions (same tiny random Llama with a
32,000-token vocabulary, same prompts, same long-tailed response lengths: log-normal, median ~300,
clipped to 32-2,048, same advantages). Three learners do one step's work on that batch, in turns:

- ``stapo packed``  : ``trainer.micro_batch_tokens`` forwards (rows packed, no padding);
- ``stapo padded``  : ``trainer.micro_batch_size`` rows per forward, padded to the longest row;
- ``trl``           : TRL 1.16's ``GRPOTrainer`` learner step, driven through its public methods.

One learner step = the no-grad old-log-prob pass (the off-policy mini-batches need pi_old) + one
epoch of ``--mini-batches`` optimizer steps, each accumulated over micro-batches. All three start
from the same weights (deep copies of one model) and use the same optimizer settings (AdamW, the
same lr / betas / eps / weight decay, constant LR, global-norm clipping at 1.0).

How TRL is driven, and why that is its real step. TRL's GRPO has no ``padding_free`` and no
token-budget micro-batches (1.16: ``padding_free`` exists in its SFT/DPO configs only; GRPO forwards
``per_device_train_batch_size`` rows at a time). Its training loop hands ``compute_loss`` one
micro-batch of the generation batch, a dict with ``prompt_ids`` / ``prompt_mask`` (left-padded),
``completion_ids`` / ``completion_mask`` (right-padded to the longest completion of the WHOLE
generation batch: TRL pads once when it scores the completions and splits afterwards, so every
micro-batch has that width), ``advantages`` [rows], ``num_items_in_batch`` (the generation batch's
completion tokens) and ``old_per_token_logps`` (present because the generation batch spans several
optimizer steps). This script builds exactly that dict from the stapo batch and calls:

- the old pass: the model's forward with TRL's fused LM head (``add_fused_lm_head``, which the
  GRPOTrainer constructor installs: ``model(input_ids, attention_mask, labels, fused_lm_head=True)``),
  under ``torch.no_grad()``, ``per_device_train_batch_size`` rows at a time, on the generation
  batch's full width: the forward TRL's scoring step makes (its method for it is private, so its
  model call is made here directly);
- per micro-batch ``trainer.compute_loss(model, inputs)`` then ``loss.backward()``; per mini-batch
  global-norm clipping and ``optimizer.step()`` of ``trainer.create_optimizer()`` (what TRL's loop
  does around them). ``trainer.current_gradient_accumulation_steps`` is set to the micro-batches per
  optimizer step, as Hugging Face's training loop sets it before ``compute_loss``.

Loss: TRL ``loss_type="dapo"`` (token-level: sum of per-token clipped losses over a normalizer of
tokens), clip 0.2 / 0.28, ``beta=0`` (no KL, no reference model), ``importance_sampling_level="token"``;
stapo ``ppo_clip`` with ``aggregation: token-mean``, eps 0.2 / 0.28, weighting ``none`` (DAPO). The
aggregation's normalizer differs in one scalar: stapo divides by the mini-batch's exact token count,
TRL by the generation batch's tokens / steps_per_generation x accumulation steps (the mean
mini-batch size). The computed work is the same; the weights after the step differ by that scale.

Before timing, the per-token log-probs of stapo (packed old pass) and TRL (its old pass) on every
response token of the batch are compared: they must agree to 1e-4 (same model, same tokens), so the
ratio compares the same function. On CPU TRL's fused head projects EVERY position of the padded row
(prompt and padding included: it keeps only valid positions where Triton runs, i.e. on GPU), while
stapo projects response tokens only; "computed tokens" counts the transformer body's tokens
(rows x width per forward), the head's share shows in the time.

    .venv-trl/bin/python benchmarks/longtail_trl.py                 # defaults; one torch thread
    python benchmarks/longtail_trl.py --prompts 4 --n 4 --repeat 1 --hidden 128   # smaller

TRL is a benchmark-only dependency (``pip install "trl==1.16.*"`` in a separate venv, next to the
pinned transformers, plus stapo with ``pip install --no-deps -e .``), never a runtime one.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads: one thread unless the caller says more
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import longtail  # noqa: E402  (the workload: the same functions build the same batch)

TOLERANCE = 1e-4  # max |stapo log-prob - TRL log-prob| over the batch's response tokens


# ----------------------------------------------------------------------------- TRL side


def require_trl() -> Any:
    try:
        import trl
    except ImportError:
        raise SystemExit(
            'longtail_trl: TRL is not installed. It is a benchmark-only dependency: in a separate venv, '
            'pip install "trl==1.16.*" (and stapo with --no-deps -e .), then run again.'
        ) from None
    return trl


def trl_trainer(args: argparse.Namespace, model: torch.nn.Module, cfg: Any, rows: int) -> Any:
    """A GRPOTrainer configured to the step's shape: ``rows`` per forward, the step's micro-batches
    per optimizer step, one generation batch spanning ``--mini-batches`` optimizer steps."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from stapo.core.trainer.models import build_tiny_tokenizer

    n_rows = args.prompts * args.n
    per_mini = n_rows // args.mini_batches
    tc, al = cfg.trainer, cfg.algorithm
    conf = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="longtail_trl_"),
        per_device_train_batch_size=rows,
        gradient_accumulation_steps=per_mini // rows,
        steps_per_generation=n_rows // rows,  # one generation batch = the whole step batch
        num_generations=args.n,
        num_iterations=1,
        max_completion_length=2048,
        temperature=1.0,
        learning_rate=tc.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=tc.weight_decay,
        adam_beta1=tc.betas[0],
        adam_beta2=tc.betas[1],
        adam_epsilon=tc.adam_eps,
        max_grad_norm=tc.max_grad_norm,
        beta=0.0,
        loss_type="dapo",
        epsilon=al.eps_low,
        epsilon_high=al.eps_high,
        importance_sampling_level="token",
        bf16=False,
        activation_checkpointing=False,  # TRL's default is True; stapo's here recomputes nothing either
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=args.seed,
    )
    ds = Dataset.from_list([{"prompt": "x"} for _ in range(n_rows)])  # never iterated: no generation here
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions),
                          args=conf, train_dataset=ds, processing_class=build_tiny_tokenizer())
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = per_mini // rows
    return trainer


def trl_inputs(batch: Any, prompt_len: int) -> dict[str, torch.Tensor]:
    """The generation batch as TRL's scoring step hands it on: prompts left-padded, completions
    right-padded to the longest completion of the batch (here: stapo's collate has the same layout)."""
    resp = batch.response_mask[:, prompt_len:]  # [N, C]
    return {
        "prompt_ids": batch.input_ids[:, :prompt_len],
        "prompt_mask": batch.attention_mask[:, :prompt_len],
        "completion_ids": batch.input_ids[:, prompt_len:],
        "completion_mask": resp.long(),
        "advantages": batch.advantages[:, prompt_len],  # [N] one advantage per completion
        "num_items_in_batch": resp.sum(),
    }


def trl_old_logps(trainer: Any, inputs: dict[str, torch.Tensor], rows: int) -> tuple[torch.Tensor, int]:
    """([N, C] pi_old per completion token, computed tokens): TRL's no-grad scoring forward, ``rows``
    at a time over the full width, through the fused head the GRPOTrainer installed."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)  # [N, P + C]
    attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    keep = inputs["completion_ids"].shape[1]
    model = trainer.model
    model.eval()
    out = []
    with torch.no_grad():
        for s in range(0, ids.shape[0], rows):
            labels = ids[s:s + rows].masked_fill(attn[s:s + rows] == 0, -100)
            labels[:, :-keep] = -100
            o = model(input_ids=ids[s:s + rows], attention_mask=attn[s:s + rows], labels=labels, fused_lm_head=True)
            out.append(o.log_probs[:, -keep:])
    return torch.cat(out), ids.numel()


def trl_step(trainer: Any, inputs: dict[str, torch.Tensor], rows: int, mini_batches: int,
             perm: torch.Tensor) -> tuple[float, float, int]:
    """(wall s, CPU s, computed tokens) of TRL's learner step: old pass + mini-batches of
    ``compute_loss`` / backward per micro-batch, clip + optimizer step per mini-batch."""
    t0, c0 = time.perf_counter(), time.process_time()
    old, computed = trl_old_logps(trainer, inputs, rows)
    full = dict(inputs, old_per_token_logps=old)
    model, opt = trainer.model, trainer.optimizer
    model.train()
    per_mini = perm.numel() // mini_batches
    for m in range(mini_batches):
        mb = perm[m * per_mini:(m + 1) * per_mini]
        for s in range(0, per_mini, rows):
            idx = mb[s:s + rows]
            micro = {k: (v if v.ndim == 0 else v[idx]) for k, v in full.items()}
            loss = trainer.compute_loss(model, micro)
            loss.backward()
            computed += micro["prompt_ids"].numel() + micro["completion_ids"].numel()
        torch.nn.utils.clip_grad_norm_(model.parameters(), trainer.args.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0, time.process_time() - c0, computed


# ----------------------------------------------------------------------------- the comparability check


def check_logprobs(stapo_side: tuple, trainer: Any, batch: Any, args: argparse.Namespace) -> float:
    """Max |stapo - TRL| per-token log-prob over every response token (stapo's packed old pass vs
    TRL's scoring forward), before any weight changes. Raises if above TOLERANCE."""
    from stapo.core.train import update

    cfg, b, _ = stapo_side
    lp, _ = update.Actor(cfg, b).old_stats(batch)  # [N, L]
    trl_lp, _ = trl_old_logps(trainer, trl_inputs(batch, args.prompt_len), args.rows)  # [N, C]
    resp = batch.response_mask[:, args.prompt_len:]
    diff = float((lp[:, args.prompt_len:][resp] - trl_lp[resp]).abs().max())
    print(f"# check: per-token log-probs, stapo (packed old pass) vs TRL (fused-head scoring forward), "
          f"{int(resp.sum())} response tokens: max |diff| = {diff:.2e} (tolerance {TOLERANCE:.0e}) -> "
          f"{'ok' if diff <= TOLERANCE else 'FAIL'}")
    if not diff <= TOLERANCE:
        raise SystemExit("longtail_trl: stapo and TRL compute different log-probs; the timing would not compare "
                         "equal work")
    return diff


# ----------------------------------------------------------------------------- main


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4, help="responses per prompt (TRL num_generations)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--median", type=float, default=300.0)
    ap.add_argument("--sigma", type=float, default=0.8, help="log-normal sigma of the response lengths")
    ap.add_argument("--mini-batches", type=int, default=4, help="optimizer steps per learner step")
    ap.add_argument("--rows", type=int, default=4,
                    help="stapo padded and TRL: rows per forward (TRL per_device_train_batch_size)")
    ap.add_argument("--tokens", type=int, default=4096,
                    help="stapo packed: token budget per forward (attention per sequence: trainer.attn_implementation auto)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeat", type=int, default=2, help="learner steps per side (sides alternate)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (CPU seconds comparable on a shared machine)")
    args = ap.parse_args(argv)
    args.weighting = "none"  # DAPO's: TRL's dapo loss has no token weighting
    n_rows = args.prompts * args.n
    if n_rows % args.mini_batches or (n_rows // args.mini_batches) % args.rows:
        ap.error(f"--rows ({args.rows}) must divide the mini-batch (prompts x n / mini-batches = "
                 f"{n_rows} / {args.mini_batches})")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    trl = require_trl()
    from rich.console import Console
    from rich.table import Table
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                                         num_attention_heads=4, num_key_value_heads=4,
                                         intermediate_size=4 * args.hidden, max_position_embeddings=4096))
    batch, resp = longtail.make_batch(args, args.vocab)
    q = sorted(resp)
    load_before = os.getloadavg()
    print(f"# {len(resp)} responses: min {q[0]}, median {q[len(q) // 2]}, p90 {q[int(0.9 * len(q))]}, max {q[-1]}; "
          f"prompt {args.prompt_len}; vocab {args.vocab}, hidden {args.hidden}, layers {args.layers}; "
          f"{args.mini_batches} mini-batches of {len(resp) // args.mini_batches} rows; torch {torch.__version__}, "
          f"trl {trl.__version__}, {platform.processor() or platform.machine()}, {torch.get_num_threads()} thread(s); "
          f"load average {load_before[0]:.1f}")

    sides: dict[str, Any] = {
        f"stapo packed ({args.tokens} tokens)": longtail.setup(
            args, model, {"micro_batch_size": args.rows, "micro_batch_tokens": args.tokens}),
        f"stapo padded ({args.rows} rows)": longtail.setup(args, model, {"micro_batch_size": args.rows}),
    }
    cfg = next(iter(sides.values()))[0]
    trainer = trl_trainer(args, copy.deepcopy(model), cfg, args.rows)
    trl_name = f"TRL GRPOTrainer ({args.rows} rows)"
    check_logprobs(next(iter(sides.values())), trainer, batch, args)

    inputs = trl_inputs(batch, args.prompt_len)
    g = torch.Generator().manual_seed(args.seed)
    names = [*sides, trl_name]
    wall: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, list[float]] = {k: [] for k in names}
    computed: dict[str, int] = {}
    for r in range(args.repeat):
        # the sides alternate (order flipped every round) so a change in the machine's load hits all alike
        for name in (names if r % 2 == 0 else names[::-1]):
            if name == trl_name:
                w, c, tokens = trl_step(trainer, inputs, args.rows, args.mini_batches, torch.randperm(len(resp), generator=g))
            else:
                w, c, tokens = longtail.one_step(*sides[name], batch)
            wall[name].append(w)
            cpu[name].append(c)
            computed[name] = tokens
            print(f"  round {r + 1} {name}: {w:.2f} s wall, {c:.2f} s CPU, {tokens} tokens computed", flush=True)
    load_after = os.getloadavg()
    # every learner really updated the weights (a silent no-op step would look fast)
    start = {k: p.detach() for k, p in model.named_parameters()}
    moved = {name: sides[name][1].model for name in sides} | {trl_name: trainer.model}
    print("# weights moved (L2 norm of the change over all parameters): " + ", ".join(
        f"{name}: {sum(float((p.detach() - start[k]).pow(2).sum()) for k, p in m.named_parameters()) ** 0.5:.2e}"
        for name, m in moved.items()))

    real = int(batch.attention_mask.sum()) * 2  # the old pass + one epoch of gradient forwards
    ref_w, ref_c = statistics.median(wall[trl_name]), statistics.median(cpu[trl_name])
    table = Table(title=f"Learner step, long-tail workload (median of {args.repeat}; load average "
                        f"{load_before[0]:.1f} before, {load_after[0]:.1f} after)")
    for col in ("learner", "computed tokens", "useful-token fraction", "step s (wall)", "CPU s",
                "vs TRL (wall)", "vs TRL (CPU)"):
        table.add_column(col, justify="left" if col == "learner" else "right")
    for name in names:
        w, c = statistics.median(wall[name]), statistics.median(cpu[name])
        table.add_row(name, str(computed[name]), f"{real / computed[name]:.1%}", f"{w:.2f}", f"{c:.2f}",
                      f"{ref_w / w:.2f}x", f"{ref_c / c:.2f}x")
    Console(width=160).print(table)
    print("(vs TRL = TRL's median / this learner's; > 1 means faster than TRL. Computed tokens: the transformer "
          "body's tokens over every forward of the step; TRL's fused head on CPU also projects each of them.)")


if __name__ == "__main__":
    main()
