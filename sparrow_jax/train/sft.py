"""`sparrow sft`: supervised warm-up of a small Qwen3 on the synthetic task, so the RL demo starts
from a policy with non-zero reward and long (>= 1K token) generations.

Two phases, measured to be the fast route (docs/data.md, "Warm-up"): short crops of full-length
sequences learn the lookup mechanics quickly (every step copies from a constant offset); whole
full-length sequences then teach late positions, which crop training does not generalise to. The result is a Hugging Face directory (config, safetensors,
tokenizer) that `load_hf` and transformers both read.

Sparsity-aware warm-up (`sparse_loss_coef > 0`): the whole-sequence steps also fit the forward
the sparse rollout decodes with (block top-k selection replayed at every response position,
`rollout.teacher_forced.sparse_attention_fn`), so the model learns to keep what it needs in the
blocks the selection picks - the alpha tail a sparse schedule must hold (docs/experiment.md).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from pathlib import Path

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from sparrow_jax.data import synthetic
from sparrow_jax.data.tokenizer import build_synthetic_tokenizer
from sparrow_jax.model import Qwen3Config, Qwen3ForCausalLM, save_hf
from sparrow_jax.model.attention import (chunked_causal_attention, dense_causal_attention,
                                         layer_splits_of)
from sparrow_jax.rollout.teacher_forced import sparse_attention_fn
from sparrow_jax.runtime import interrupts, output_dir

log = logging.getLogger(__name__)


# Whole-sequence batches are padded to a multiple of this many tokens (few shapes, few compiles).
PACK_WIDTH = 64


@gin.configurable
@dataclasses.dataclass(frozen=True)
class SFTConfig:
    output_dir: str = "checkpoints/demo_sft"
    overwrite: bool = False           # replace an existing, non-empty output_dir (the default
                                      # output_dir is the shipped demo checkpoint)
    init_from: str = ""               # continue from an existing HF directory ("" = random init)
    seed: int = 0
    # Model (~0.8M params): 4 layers so layers 2-3 are sparse (0 and 1 always stay dense).
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    # Phase 1: fixed-length crops of full-length sequences (at their real positions);
    # phase 2: whole full-length sequences.
    crop_steps: int = 1000
    crop_length: int = 240
    crop_batch: int = 8
    crop_start_fraction: float = 0.5  # crops that start at the prompt: cycle 1 reads the table
    # Long tasks (K ~ 50, ~4.5K tokens): each crop keeps the prompt before its window (real
    # positions on both), so the window's cycle labels and the stop decision ("label == K ->
    # '='") see the prompt at their true distance, at the cost of a (P + crop_length)^2 window
    # instead of a whole sequence's T^2; a `crop_end_fraction` of the windows end with the
    # sequence (the stop decision is one token per sequence and uniform windows rarely hold it).
    crop_keep_prompt: bool = False
    crop_end_fraction: float = 0.0
    long_steps: int = 250
    long_k_range: tuple[int, int] = (8, 13)
    long_batch: int = 8
    learning_rate: float = 1e-3
    warmup_steps: int = 50
    eval_problems: int = 16
    log_every: int = 25
    attention_chunk: int = 0          # > 0: causal attention in query chunks of this size
                                      # (model.attention.chunked_causal_attention): a 4.5K-token
                                      # batch then never holds [B, H, T, T] scores
    max_position_embeddings: int = 0  # > 0: written into the model's config (the demo model
                                      # says 4096; the long task needs ~4.6K positions)
    # Sparsity-aware whole-sequence steps: loss = CE(dense forward) + sparse_loss_coef x
    # CE(block-sparse forward at sparse_budget tokens, layers sparse_dense_layers dense, blocks
    # of sparse_block_size: the rollout's RolloutConfig.block_size). 0 = dense only. Costs about
    # one more forward and backward per whole-sequence step.
    sparse_loss_coef: float = 0.0
    sparse_budget: int = 256
    sparse_dense_layers: tuple[int, ...] = (0, 1)
    sparse_block_size: int = 16
    # A wall-clock budget (issue 56: a warm-up that must end inside one lent-GPU call): > 0 =
    # train for this many seconds (compiles included), crops for the first `crop_share` of them,
    # then whole sequences; crop_steps / long_steps become upper bounds and the learning rate
    # follows the elapsed share of the budget (warm-up over `warmup_steps` steps, then a cosine
    # to a tenth of the peak at the budget's end). 0 = the step counts alone (as before).
    max_seconds: float = 0.0
    crop_share: float = 0.5
    # > 0: whole-sequence batches are padded to exactly this many tokens (one program to
    # compile, not one per multiple of 64 a batch's longest sequence lands on); at least the
    # longest prompt + target + <eos> of long_k_range.
    long_width: int = 0
    save_dtype: str = ""              # the checkpoint's weights' dtype ("" = as trained, float32)

    def __post_init__(self):
        fractions = (self.crop_start_fraction, self.crop_end_fraction)
        if min(fractions) < 0 or sum(fractions) > 1:
            raise ValueError(f"SFTConfig.crop_start_fraction = {self.crop_start_fraction} and "
                             f"crop_end_fraction = {self.crop_end_fraction} must be >= 0 and sum "
                             f"to at most 1 (the rest of the windows start anywhere)")
        if self.crop_end_fraction and not self.crop_keep_prompt:
            raise ValueError(f"SFTConfig.crop_end_fraction = {self.crop_end_fraction} needs "
                             f"crop_keep_prompt = True (windows without their prompt cannot "
                             f"learn the stop decision, which reads K from the prompt)")
        if self.sparse_loss_coef < 0 or self.sparse_budget % self.sparse_block_size or \
                self.sparse_budget < 3 * self.sparse_block_size or \
                PACK_WIDTH % self.sparse_block_size:
            raise ValueError(f"SFTConfig.sparse_loss_coef = {self.sparse_loss_coef} must be >= 0 "
                             f"and sparse_budget = {self.sparse_budget} a multiple of "
                             f"sparse_block_size = {self.sparse_block_size} of at least 3 blocks "
                             f"(sink + 2 local); sparse_block_size must divide {PACK_WIDTH} (the "
                             f"whole-sequence batches' width multiple)")
        if self.max_seconds < 0 or not 0 <= self.crop_share <= 1 or self.long_width < 0:
            raise ValueError(f"SFTConfig.max_seconds = {self.max_seconds} must be >= 0 (0 = no "
                             f"time budget), crop_share = {self.crop_share} in [0, 1] and "
                             f"long_width = {self.long_width} >= 0")
        if self.attention_chunk < 0 or self.max_position_embeddings < 0:
            raise ValueError(f"SFTConfig.attention_chunk = {self.attention_chunk} and "
                             f"max_position_embeddings = {self.max_position_embeddings} must be "
                             f">= 0 (0 = off)")


def pack(pairs, pad_id: int, block: int = PACK_WIDTH, width: int = 0):
    """(prompt, target) id pairs -> tokens [B, L], loss mask [B, L] (1 where the next token is a
    target token), L padded to a multiple of `block` (few shapes, few recompiles), or to exactly
    `width` when it is given (one shape)."""
    lengths = [len(p) + len(t) for p, t in pairs]
    if width and width < max(lengths):
        raise ValueError(f"SFTConfig.long_width = {width} is shorter than a training sequence "
                         f"({max(lengths)} tokens of prompt and target, SFTConfig.long_k_range)")
    width = width or -(-max(lengths) // block) * block
    tokens = np.full((len(pairs), width), pad_id, np.int32)
    weights = np.zeros((len(pairs), width), np.float32)
    for i, (p, t) in enumerate(pairs):
        seq = np.concatenate([p, t])
        tokens[i, :len(seq)] = seq
        weights[i, len(p) - 1:len(seq) - 1] = 1.0  # position j predicts token j + 1
    return tokens, weights


def crops(pairs, length: int, context: int, rng: np.random.Generator,
          start_fraction: float = 0.0, keep_prompt: bool = False, end_fraction: float = 0.0):
    """Random windows of `length` tokens of prompt ++ target, with their real positions.

    The loss skips the first `context` tokens of a window: what they copy lies before it.
    A `start_fraction` of the windows start at 0: the first cycle looks digits up in the prompt
    table at irregular offsets, a different skill from the later cycles' constant-offset copy,
    and uniformly placed windows almost never contain it (measured: greedy decoding then fails
    in cycle 1 on every problem). keep_prompt: `_prompt_crops` (end_fraction is theirs).
    Returns tokens, positions, weights and the attention mask (all ones here), [B, length] each.
    """
    if keep_prompt:
        return _prompt_crops(pairs, length, context, rng, start_fraction, end_fraction)
    tokens = np.zeros((len(pairs), length), np.int32)
    positions = np.zeros_like(tokens)
    weights = np.zeros((len(pairs), length), np.float32)
    for i, (p, t) in enumerate(pairs):
        seq = np.concatenate([p, t])
        if len(seq) < length:
            raise ValueError(f"SFTConfig.crop_length = {length} is longer than a training "
                             f"sequence ({len(seq)} tokens of prompt and target, "
                             f"SFTConfig.long_k_range): use a crop_length of at most {len(seq)}")
        start = 0 if rng.random() < start_fraction else int(rng.integers(0, len(seq) - length + 1))
        tokens[i] = seq[start:start + length]
        positions[i] = np.arange(start, start + length)
        w = np.zeros(len(seq), np.float32)
        w[len(p) - 1:len(seq) - 1] = 1.0
        if start:
            w[start:start + context] = 0.0
        weights[i] = w[start:start + length]
    return tokens, positions, weights, np.ones_like(tokens)


def _prompt_crops(pairs, length: int, context: int, rng: np.random.Generator,
                  start_fraction: float, end_fraction: float):
    """Windows of `length` target tokens, each after its own prompt: tokens [B, P + length]
    (P the longest prompt; shorter prompts are left-padded with masked-out pad tokens at
    position 0), positions [B, P + length] real (the window's start where it lies in the
    sequence), weights [B, P + length] as in `crops` (the first `context` window tokens
    unweighted unless the window starts right after the prompt)."""
    width = max(len(p) for p, _ in pairs)
    tokens = np.zeros((len(pairs), width + length), np.int32)
    positions = np.zeros_like(tokens)
    weights = np.zeros(tokens.shape, np.float32)
    mask = np.ones(tokens.shape, np.int32)
    for i, (p, t) in enumerate(pairs):
        if len(t) < length:
            raise ValueError(f"SFTConfig.crop_length = {length} is longer than a target "
                             f"({len(t)} tokens, SFTConfig.long_k_range): use a crop_length of "
                             f"at most {len(t)}")
        u = rng.random()
        if u < start_fraction:
            start = 0
        elif u < start_fraction + end_fraction:
            start = len(t) - length
        else:
            start = int(rng.integers(0, len(t) - length + 1))
        lead = width - len(p)
        mask[i, :lead] = 0
        tokens[i, lead:width] = p
        positions[i, lead:width] = np.arange(len(p))
        tokens[i, width:] = t[start:start + length]
        positions[i, width:] = len(p) + np.arange(start, start + length)
        # position j predicts j + 1: the last prompt token predicts the window's first token
        # only when the window starts the target
        w = np.ones(length, np.float32)
        if start:
            w[:context] = 0.0
        weights[i, width:width + length - 1] = w[1:]
        weights[i, width - 1] = w[0] if start == 0 else 0.0
    return tokens, positions, weights, mask


def nll_and_accuracy(logits, tokens, weights):
    """Mean next-token NLL and argmax accuracy over the weighted positions ([B, L] each)."""
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
    w = weights[:, :-1]
    correct = (jnp.argmax(logits[:, :-1], -1) == tokens[:, 1:]) * w
    return jnp.sum(nll * w) / jnp.sum(w), jnp.sum(correct) / jnp.sum(w)


def sft_loss(model: Qwen3ForCausalLM, tokens, positions, weights, mask, prompt_lengths,
             attention_chunk: int, sparse: tuple | None):
    """CE of the dense forward, plus coef x CE of the block-sparse one when sparse = (coef,
    budget, dense_layers, block_size). Returns (loss, (dense nll, dense acc, sparse nll,
    sparse acc)); the sparse pair is 0 without it.

    The sparse forward's layers before its first sparse one are dense, with the same inputs as
    the dense forward's: they run once and both forwards continue from their output (the same
    values as two whole forwards; the shared layers' gradient is the sum of both branches')."""
    fn = chunked_causal_attention(attention_chunk) if attention_chunk > 0 else None
    if sparse is None:
        nll, acc = nll_and_accuracy(model(tokens, positions, attention_mask=mask,
                                          attention_fn=fn), tokens, weights)
        return nll, (nll, acc, jnp.zeros(()), jnp.zeros(()))
    coef, budget, dense_layers, block_size = sparse
    sparse_fn = sparse_attention_fn(budgets=jnp.full((1,), budget, jnp.int32), bin_size=1 << 30,
                                    prompt_lengths=prompt_lengths,
                                    max_selected=budget // block_size, block_size=block_size,
                                    dense_layers=dense_layers, query_chunk=attention_chunk)
    fn = fn or dense_causal_attention
    n = model.config.num_hidden_layers
    shared = next((i for i in range(n) if i not in dense_layers), n)

    def hidden(attention_fn, x, layers):
        return model.run_layers(
            x, positions, lambda i, q, k, v: attention_fn(i, q, k, v, positions, mask),
            layer_splits=layer_splits_of(attention_fn), layers=layers)

    x = model.embed(tokens)
    if shared == n:                       # no sparse layer: the sparse forward is the dense one
        nll, acc = nll_and_accuracy(model.logits(hidden(fn, x, None)), tokens, weights)
        return nll + coef * nll, (nll, acc, nll, acc)
    if shared:
        x = hidden(fn, x, (0, shared))
    nll, acc = nll_and_accuracy(model.logits(hidden(fn, x, (shared, n))), tokens, weights)
    s_nll, s_acc = nll_and_accuracy(model.logits(hidden(sparse_fn, x, (shared, n))), tokens,
                                    weights)
    return nll + coef * s_nll, (nll, acc, s_nll, s_acc)


@functools.partial(nnx.jit, static_argnames=("attention_chunk", "sparse"))
def train_step(model, optimizer, tokens, positions, weights, mask, prompt_lengths,
               attention_chunk: int = 0, sparse: tuple | None = None, learning_rate=None):
    """One optimiser step on `sft_loss` (model and optimizer updated in place); returns its
    metrics (dense nll, dense acc, sparse nll, sparse acc). `learning_rate`: this step's, for
    an optimizer whose AdamW takes it as an injected hyperparameter (`make_optimizer` with a
    time budget); None: the optimizer's own step-count schedule."""
    if learning_rate is not None:
        optimizer.opt_state[1].hyperparams["learning_rate"][...] = learning_rate
    (_, metrics), grads = nnx.value_and_grad(sft_loss, has_aux=True)(
        model, tokens, positions, weights, mask, prompt_lengths, attention_chunk, sparse)
    optimizer.update(model, grads)
    return metrics


def demo_model_config(cfg: SFTConfig, tokenizer) -> Qwen3Config:
    return Qwen3Config(vocab_size=len(tokenizer), hidden_size=cfg.hidden_size,
                       intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                       num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                       head_dim=cfg.head_dim, rope_theta=10000.0, tie_word_embeddings=True,
                       max_position_embeddings=cfg.max_position_embeddings or 4096, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def greedy_exact(model: Qwen3ForCausalLM, tokenizer, problems, max_new_tokens: int) -> float:
    """Fraction of problems solved exactly by greedy dense decoding (the rollout engine)."""
    from sparrow_jax.rollout import RolloutConfig, generate
    prompts = [tokenizer.encode(p["prompt"]) for p in problems]
    width = max(map(len, prompts))
    toks = np.full((len(prompts), width), tokenizer.pad_token_id, np.int32)
    for i, p in enumerate(prompts):
        toks[i, :len(p)] = p
    rcfg = RolloutConfig(max_new_tokens=max_new_tokens, temperature=0.0, mode="dense",
                         stop_token_ids=(tokenizer.eos_token_id,),
                         pad_token_id=tokenizer.pad_token_id)
    traj = generate(model, toks, [len(p) for p in prompts], cfg=rcfg, budgets=[4096])
    tokens, lens = np.asarray(traj.tokens), np.asarray(traj.response_lengths)
    solved = [synthetic.synthetic_exact_reward(tokenizer.decode(tokens[i, :lens[i]]), p["answer"],
                                               prompt=p["prompt"])
              for i, p in enumerate(problems)]
    return float(np.mean(solved))


def check_output_dir(cfg: SFTConfig) -> None:
    """FileExistsError unless `output_dir` is new or empty, or `overwrite` is set: checked
    before training, so that minutes of training do not end by replacing a model."""
    out = Path(cfg.output_dir)
    if not out.exists():
        return
    if not out.is_dir():
        raise FileExistsError(f"SFTConfig.output_dir {str(out)!r} exists and is not a directory")
    # A model (an earlier warm-up, or a model directory) is what overwrite may replace; another
    # command's output never (sparrow_jax.runtime.output_dir).
    output_dir.check(out, "sft", {}, overwrite=True, compare=False,
                     name="SFTConfig.output_dir", option=None)
    if not cfg.overwrite and any(out.iterdir()):
        raise FileExistsError(
            f"SFTConfig.output_dir {str(out)!r} already holds a model; choose a new directory "
            f"(--gin_param \"SFTConfig.output_dir = 'DIR'\") or replace it with "
            f"--gin_param 'SFTConfig.overwrite = True'")


def run_sft(cfg: SFTConfig) -> Path:
    check_output_dir(cfg)
    if cfg.init_from:
        from sparrow_jax.model import load_hf, load_tokenizer
        tokenizer, model = load_tokenizer(cfg.init_from), load_hf(cfg.init_from, dtype=jnp.float32)
        mcfg = model.config
        if cfg.max_position_embeddings:
            mcfg = dataclasses.replace(mcfg, max_position_embeddings=cfg.max_position_embeddings)
            model.config = mcfg
    else:
        tokenizer = build_synthetic_tokenizer()
        mcfg = demo_model_config(cfg, tokenizer)
        model = Qwen3ForCausalLM(mcfg, dtype=jnp.float32, rngs=nnx.Rngs(cfg.seed))
    total = cfg.crop_steps + cfg.long_steps
    optimizer = make_optimizer(model, cfg)
    log.info("sft: %.2fM params, %d crop + %d full-length steps%s", mcfg.num_params() / 1e6,
             cfg.crop_steps, cfg.long_steps,
             f" at most, for {cfg.max_seconds:.0f} s (crops for the first "
             f"{cfg.crop_share:.0%})" if cfg.max_seconds else "")
    sparse = None
    if cfg.sparse_loss_coef > 0:
        bad = [i for i in cfg.sparse_dense_layers if not 0 <= i < mcfg.num_hidden_layers]
        if bad:
            raise ValueError(f"SFTConfig.sparse_dense_layers = {cfg.sparse_dense_layers}: layers "
                             f"{bad} do not exist (the model has {mcfg.num_hidden_layers})")
        sparse = (float(cfg.sparse_loss_coef), int(cfg.sparse_budget),
                  tuple(cfg.sparse_dense_layers), int(cfg.sparse_block_size))
        log.info("sft: whole-sequence steps also fit the block-sparse forward (budget %d tokens, "
                 "dense layers %s, weight %g)", cfg.sparse_budget, sparse[2], sparse[0])
    rng = np.random.default_rng(cfg.seed)
    start = time.time()
    done = {"crop": 0, "full": 0}
    last: dict[str, float] = {}
    metrics = None
    with tqdm(total=total, desc="sft", unit="step") as bar:
        while True:
            if cfg.max_seconds and metrics is not None:
                jax.block_until_ready(metrics)    # the budget counts finished steps' time
            elapsed = time.time() - start
            phase = next_phase(cfg, done["crop"], done["full"], elapsed)
            if phase is None:
                break
            step = done["crop"] + done["full"]
            crop = phase == "crop"
            batch = cfg.crop_batch if crop else cfg.long_batch
            problems = [synthetic.make_problem(rng, cfg.long_k_range) for _ in range(batch)]
            pairs = synthetic.sft_examples(tokenizer, problems=problems)
            if crop:
                tokens, positions, weights, mask = crops(
                    pairs, cfg.crop_length, synthetic.cycle_tokens() + 3, rng,
                    cfg.crop_start_fraction, cfg.crop_keep_prompt, cfg.crop_end_fraction)
            else:
                tokens, weights = pack(pairs, tokenizer.pad_token_id, width=cfg.long_width)
                positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
                mask = np.ones_like(tokens)
            prompt_lengths = np.asarray([len(p) for p, _ in pairs], np.int32)
            lr = (None if not cfg.max_seconds else
                  jnp.float32(budgeted_learning_rate(cfg, step, elapsed / cfg.max_seconds)))
            metrics = train_step(
                model, optimizer, jnp.asarray(tokens), jnp.asarray(positions),
                jnp.asarray(weights), jnp.asarray(mask), jnp.asarray(prompt_lengths),
                attention_chunk=cfg.attention_chunk, sparse=None if crop else sparse,
                learning_rate=lr)
            done[phase] += 1
            bar.update(1)
            if step % cfg.log_every == 0 or step == total - 1:
                last = step_summary(metrics, phase, sparse is not None)
                bar.set_postfix(**{k: f"{v:.4g}" if isinstance(v, float) else v
                                   for k, v in last.items()})
    if metrics is not None:
        last = step_summary(metrics, phase_of_last(done), sparse is not None)
    seconds = time.time() - start
    log.info("sft done in %.0f s: %d crop + %d full-length steps", seconds, done["crop"],
             done["full"])
    summary = {"crop_steps_done": done["crop"], "long_steps_done": done["full"],
               "train_seconds": round(seconds, 1), **last}
    if cfg.eval_problems:
        eval_problems = synthetic.make_problems(cfg.eval_problems, cfg.seed + 10_000,
                                                cfg.long_k_range)
        max_new = synthetic.target_tokens(cfg.long_k_range[1]) + 16
        exact = greedy_exact(model, tokenizer, eval_problems, max_new)
        log.info("held-out greedy exact (K in %s): %.3f", cfg.long_k_range, exact)
        summary = {"greedy_exact": round(exact, 4), "problems": cfg.eval_problems, **summary}
    summary.update(k_range=cfg.long_k_range, steps=done["crop"] + done["full"])
    with interrupts.critical():      # a Ctrl-C now waits for the whole model (runtime.interrupts)
        out = save_hf(model, cfg.output_dir, tokenizer=tokenizer,
                      dtype=jnp.dtype(cfg.save_dtype) if cfg.save_dtype else None)
        output_dir.write_record(out, "sft", {k: v for k, v in dataclasses.asdict(cfg).items()
                                             if k not in ("output_dir", "overwrite")})
        summary["seconds"] = round(time.time() - start)
        (out / SUMMARY_NAME).write_text(" ".join(
            f"{k}={str(v).replace(' ', '')}" for k, v in summary.items()) + "\n")
    return out


SUMMARY_NAME = "sft_summary.txt"


def read_summary(model_dir: str | Path) -> dict[str, str]:
    """A warm-up checkpoint's `sft_summary.txt` as {key: value text} ({} when it has none)."""
    path = Path(model_dir) / SUMMARY_NAME
    if not path.is_file():
        return {}
    return dict(field.split("=", 1) for field in path.read_text().split() if "=" in field)


def make_optimizer(model: Qwen3ForCausalLM, cfg: SFTConfig) -> nnx.Optimizer:
    """AdamW (weight decay 0.01) after global-norm clipping at 1. Its learning rate: warm-up over
    `warmup_steps`, then a cosine to a tenth of the peak over the steps - or, with a time budget
    (`max_seconds`), set per step from `budgeted_learning_rate` (an injected hyperparameter)."""
    if cfg.max_seconds:
        adamw = optax.inject_hyperparams(optax.adamw)(learning_rate=0.0, weight_decay=0.01)
    else:
        total = cfg.crop_steps + cfg.long_steps
        lr = optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate,
                                                min(cfg.warmup_steps, total - 1), total,
                                                cfg.learning_rate * 0.1)
        adamw = optax.adamw(lr, weight_decay=0.01)
    return nnx.Optimizer(model, optax.chain(optax.clip_by_global_norm(1.0), adamw),
                         wrt=nnx.Param)


def budgeted_learning_rate(cfg: SFTConfig, step: int, progress: float) -> float:
    """A time-budgeted run's learning rate: linear from 0 over `warmup_steps` steps, then the
    peak times a cosine over the budget's elapsed share `progress` (0..1) down to a tenth."""
    if step < cfg.warmup_steps:
        return cfg.learning_rate * step / cfg.warmup_steps
    cosine = 0.5 * (1.0 + np.cos(np.pi * min(max(progress, 0.0), 1.0)))
    return float(cfg.learning_rate * (0.1 + 0.9 * cosine))


def next_phase(cfg: SFTConfig, crops_done: int, longs_done: int, elapsed: float) -> str | None:
    """The next step's phase - "crop", "full" (whole sequences) - or None when training is
    over: crops first (crop_steps of them, or with a time budget until its `crop_share` has
    passed), then whole sequences (long_steps, or until the budget ends)."""
    budget = cfg.max_seconds
    if budget and elapsed >= budget:
        return None
    if crops_done < cfg.crop_steps and not (budget and elapsed >= cfg.crop_share * budget):
        return "crop"
    return "full" if longs_done < cfg.long_steps else None


def phase_of_last(done: dict[str, int]) -> str:
    return "full" if done["full"] else "crop"


def step_summary(metrics, phase: str, sparse: bool) -> dict[str, float | str]:
    """One step's (dense nll, dense acc, sparse nll, sparse acc) as named numbers."""
    loss, acc, s_loss, s_acc = (float(x) for x in metrics)
    out: dict[str, float | str] = {"phase": phase, "loss": loss, "token_acc": acc}
    if phase == "full" and sparse:
        out.update(sparse_loss=s_loss, sparse_acc=s_acc)
    return out


def add_arguments(parser) -> None:
    del parser  # configured through gin (SFTConfig)


def main(args) -> int:
    del args
    try:
        out = run_sft(SFTConfig())
    except (FileExistsError, ValueError) as e:    # output_dir.OutputDirError among them
        raise SystemExit(f"sparrow sft: {e}") from None
    print(f"warm-up checkpoint written to {out}: {(out / SUMMARY_NAME).read_text().strip()}")
    return 0
