"""The paged engine's compiled programs: prefill into pages, and decode chunks of N steps.

KV lives in page pools, per layer `[G, Hkv, N, bs, D]` (a page = one selection block of bs
tokens; G pools = one per data shard, each owning its shard's slots) plus the key centroid of
every page `[G, Hkv, N, D]`. A slot reads its pages through its page table `[S, P]` (logical
block -> physical page). The host scheduler (`rollout/continuous.py`) owns the tables, the page
allocator (`rollout/page_pool.py`) and the samples; these programs only read and write pages.

Shapes are bucketed by the scheduler (slots S, pages per slot P, prefill rows R and width W), so
a rollout compiles a bounded number of programs; unused slots / rows are masked and their writes
dropped (page id N is out of range: scatters with mode="drop" skip it).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

import pallas_kernels
from pallas_kernels import pallas_triton, pallas_triton_select, pallas_triton_write
from pallas_kernels.reference import HeadFinish
from sparrow_jax.model.attention import masked_gqa_attention
from sparrow_jax.model.config import Qwen3Config
from sparrow_jax.model.qwen3 import Qwen3ForCausalLM
from sparrow_jax.rollout import fused
from sparrow_jax.rollout.config import RolloutConfig, RolloutMode
from sparrow_jax.rollout.prefill import prefill, prefill_attention
from sparrow_jax.rollout.sampling import sample_rows, topk_logprobs
from sparrow_jax.rollout.state import budget_for_lengths, sample_tokens
from sparrow_jax.runtime import compiler_options
from sparrow_jax.runtime.sharding import ShardingSpec
from sparrow_jax.sparsity import block_scores, selection

# Logical axes: pools and slots over `data` (a pool serves its shard's slots), heads over `model`.
POOL_AXES = ("batch", "kv_heads", None, None, "head_dim")       # [G, Hkv, N, bs, D]
CENTROID_AXES = ("batch", "kv_heads", None, "head_dim")          # [G, Hkv, N, D]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedKV:
    k: tuple[jax.Array, ...]          # L x [G, Hkv, N, bs, D]
    v: tuple[jax.Array, ...]          # L x [G, Hkv, N, bs, D]
    centroids: tuple[jax.Array, ...]  # L x [G, Hkv, N, D] (mean key of each full page)

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[2]


def init_pages(cfg: Qwen3Config, pools: int, pages: int, block_size: int, dtype,
               spec: ShardingSpec | None = None) -> PagedKV:
    """Zeroed page pools, `pages` per pool, created directly with their sharding. The zeros
    programs are cached per (shape, dtype, sharding): a rollout at shapes seen before compiles
    nothing (a fresh jitted lambda per array recompiled 3 x layers programs every rollout)."""
    kv_shape = (pools, cfg.num_key_value_heads, pages, block_size, cfg.head_dim)
    c_shape = kv_shape[:3] + kv_shape[4:]

    def zeros(shape, axes):
        sharding = None if spec is None else spec.sharding(axes, shape)
        return _zeros_program(shape, jnp.dtype(dtype), sharding)()

    layers = range(cfg.num_hidden_layers)
    return PagedKV(k=tuple(zeros(kv_shape, POOL_AXES) for _ in layers),
                   v=tuple(zeros(kv_shape, POOL_AXES) for _ in layers),
                   centroids=tuple(zeros(c_shape, CENTROID_AXES) for _ in layers))


@functools.lru_cache(maxsize=64)
def _zeros_program(shape: tuple[int, ...], dtype, sharding):
    """One jitted zeros program per (shape, dtype, sharding), kept for the process."""
    return jax.jit(functools.partial(jnp.zeros, shape, dtype), out_shardings=sharding)


# -- prefill ----------------------------------------------------------------------------------
def _write_pages(k_pool, v_pool, c_pool, ks, vs, write_pages, *, block_size: int):
    """Writes R rows' prefilled K/V (and page centroids) into one pool (under shard_map: this
    shard's rows into this shard's pool). ks/vs [R, Hkv, W, D]; pools [1, Hkv, N, bs, D],
    centroids [1, Hkv, N, D]; write_pages [R, n, W/bs] target page of each block for each of a
    row's n samples (N = none: the write is dropped)."""
    r, hkv, w, d = ks.shape
    n = write_pages.shape[1]
    nb = w // block_size

    def put(pool, data):                      # data [R, Hkv, nb, ...] -> pool[0][:, pages]
        vals = jnp.broadcast_to(jnp.moveaxis(data, 1, 0)[:, :, None],
                                (hkv, r, n, nb) + data.shape[3:])
        return pool[0].at[:, write_pages].set(vals.astype(pool.dtype), mode="drop")[None]

    def blocks(x):
        return x.reshape(r, hkv, nb, block_size, d)

    return (put(k_pool, blocks(ks)), put(v_pool, blocks(vs)),
            put(c_pool, block_scores.block_centroids(ks, block_size)))


def _sharded_write(spec: ShardingSpec | None, num_kv_heads: int, block_size: int):
    fn = functools.partial(_write_pages, block_size=block_size)
    if spec is None:
        return fn
    data, heads = mesh_axes(spec, num_kv_heads)
    pool, cent = P(data, heads, None, None, None), P(data, heads, None, None)
    rows = P(data, heads, None, None)
    return jax.shard_map(fn, mesh=spec.mesh,
                         in_specs=(pool, pool, cent, rows, rows, P(data, None, None)),
                         out_specs=(pool, pool, cent), check_vma=False)


def _replay_attention(layer, q, k_cache, v_cache, start, lengths, *, prompt_lengths, budgets,
                      bin_size: int, cfg: RolloutConfig):
    """A prefill chunk's attention that reproduces decode-time block selection for positions past
    the prompt in sparse layers (the teacher-forced replay's rule), so a preempted sample's
    recomputed KV is the KV its sparse decoding wrote. q [B, C, Hq, D], k/v [B, Hkv, S, D]."""
    if layer in cfg.dense_layers:
        return prefill_attention(q, k_cache, v_cache, start, lengths)
    b, c = q.shape[:2]
    bs = cfg.block_size
    stop = start + c if isinstance(start, int) else k_cache.shape[2]
    k, v = k_cache[:, :, :stop], v_cache[:, :, :stop]
    pos = jnp.broadcast_to(start + jnp.arange(c), (b, c))
    scores = block_scores.centroid_scores(q, block_scores.block_centroids(k, bs)[:, None])
    max_selected = cfg.max_budget // bs
    budget = budget_for_lengths(budgets, pos + 1, bin_size)
    budget_blocks = jnp.minimum(budget // bs, max_selected)
    chosen = selection.selected_keys(scores, pos, budget_blocks, max_selected=max_selected,
                                     block_size=bs)                       # [B, C, Hkv, S']
    chosen = chosen | (budget >= pos + 1)[..., None, None]    # covered: dense (the decode's rule)
    keys = jnp.arange(stop)
    seen = (keys[None, None, :] <= pos[..., None]) & (keys[None, None, :] < lengths[:, None, None])
    is_decode = (pos >= prompt_lengths[:, None])[..., None, None]
    visible = seen[:, :, None, :] & jnp.where(is_decode, chosen, True)
    return masked_gqa_attention(q, k.swapaxes(1, 2), v.swapaxes(1, 2), visible.swapaxes(1, 2))


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg", "spec", "bin_size", "replay"),
                   donate_argnames=("kv",))
def prefill_program(graphdef, params, kv: PagedKV, tokens, lengths, write_pages, sample_ids,
                    index, rng, prompt_lengths, budgets, *, cfg: RolloutConfig,
                    spec: ShardingSpec | None, bin_size: int = 2000, replay: bool = False):
    """Dense prefill of R sequences into pages, fanned out to n samples each.

    tokens [R, W] (W a multiple of bs), lengths [R]; rows are laid out by pool (R / G rows per
    pool, the pool's data shard). write_pages [R, n, W/bs] the page (in the row's pool) each of
    the row's blocks goes to for each of its n samples: full prompt pages the same shared page
    for all n, the partly filled last page a private page per sample, unused N (dropped).
    sample_ids/index [R, n]: the sampling key of each sample's next token.
    replay (sparse mode, resumed samples): positions from prompt_lengths [R] on attend as their
    sparse decoding did (budgets [num_bins], bin_size), see `_replay_attention`.
    Returns (kv, tokens/logprobs [R, n], top-k values/ids [R, n, k]).
    """
    model: Qwen3ForCausalLM = nnx.merge(graphdef, params)
    r = tokens.shape[0]
    n = write_pages.shape[1]
    attention = None
    if replay:
        attention = functools.partial(_replay_attention, prompt_lengths=prompt_lengths,
                                      budgets=budgets, bin_size=bin_size, cfg=cfg)
    ks, vs, last_logits = prefill(model, tokens, lengths, chunk=cfg.prefill_chunk,
                                  attention=attention)
    write = _sharded_write(spec, model.config.num_key_value_heads, cfg.block_size)
    out = [write(k, v, c, kx, vx, write_pages)
           for k, v, c, kx, vx in zip(kv.k, kv.v, kv.centroids, ks, vs)]
    kv = PagedKV(*(tuple(o[i] for o in out) for i in range(3)))
    # Each of a row's n samples draws its own token; the recorded top-k is the row's, shared.
    tok, lp = sample_rows(rng, jnp.repeat(last_logits, n, axis=0), sample_ids.reshape(-1),
                          index.reshape(-1), temperature=cfg.temperature, top_k=cfg.top_k,
                          top_p=cfg.top_p)
    top_v, top_i = topk_logprobs(last_logits, cfg.record_topk, temperature=cfg.temperature)
    fan = functools.partial(jnp.repeat, repeats=n, axis=1)
    return (kv, tok.reshape(r, n), lp.reshape(r, n), fan(top_v[:, None]), fan(top_i[:, None]))


# -- decode -----------------------------------------------------------------------------------
def write_token_pages(pool, new, page, offset, write):
    """Writes one token per slot (new [S, Hkv, D] at row `offset` of page `page`) into a pool
    [1, Hkv, N, bs, D], as whole pages: each writing slot's page is read, its row replaced, and
    the page scattered back. A row-granular scatter (one [Hkv, D] row per slot) makes the TPU
    compiler relayout the whole pool around it (Hkv next to D: a copy of the pool in and one out,
    per layer and step - 22 GiB of temporaries in the 8B pod decode chunk); a page is whole
    (bs, D) tiles in the pool's own layout, so the scatter updates it in place. Active slots
    never share a page being written (the partly filled last page is private), so page writes
    equal row writes. Slots with write False are dropped (page id N is out of range).
    Returns (the written pages [Hkv, S, bs, D], pool)."""
    n_pages, bs = pool.shape[2], pool.shape[3]
    cur = pool[0][:, jnp.clip(page, 0, n_pages - 1)]                     # [Hkv, S, bs, D]
    row = (jnp.arange(bs)[None, :] == offset[:, None])[None, :, :, None]  # [1, S, bs, 1]
    pages = jnp.where(row, new.swapaxes(0, 1)[:, :, None].astype(pool.dtype), cur)
    target = jnp.where(write, page, n_pages)
    return pages, pool[0].at[:, target].set(pages, mode="drop")[None]


def write_token_rows(pool, new, page, offset, write):
    """Writes one token per slot (new [S, Hkv, D]) as one [Hkv, D] row each into a pool
    [1, Hkv, N, bs, D] (a row scatter into its flat [Hkv, N * bs, D] view); slots with write
    False are dropped. Returns the pool."""
    _, hkv, n_pages, bs, d = pool.shape
    flat = jnp.where(write, page * bs + offset, n_pages * bs)           # out of range: dropped
    rows = pool.reshape(hkv, n_pages * bs, d).at[:, flat].set(
        new.swapaxes(0, 1).astype(pool.dtype), mode="drop")
    return rows.reshape(pool.shape)


def writes_whole_pages(backend: str) -> bool:
    """Which in-place token write the compiler keeps in place: on TPU (Mosaic kernels) the row
    scatter relayouts every layer's pool (22 GiB of copies in the 8B pod chunk) and whole-page
    writes do not; on GPU and CPU it is the other way round - the page write (a gather of the
    pages, then a scatter into the same pool) made XLA:GPU copy the pools (12 pool copies in
    the 1.7B H100 chunk at 3 layers), the row scatter stays in place. Both give equal pools."""
    if backend == "auto":
        return pallas_kernels.dispatch.current_platform() == "tpu"   # the target's, in a dryrun
    return backend == "pallas_tpu"


def _layer_attention(q, k_new, v_new, k_pool, v_pool, c_pool, page_table, lengths, write,
                     budget_blocks, covered, cos, sin, q_norm, k_norm, *, sparse: bool,
                     cfg: RolloutConfig, max_selected: int, norm_eps: float,
                     combined: bool = False):
    """One layer, one token per slot, on one pool (under shard_map: this shard's).

    q [S, Hq, D]; k_new/v_new [S, Hkv, D] the fed token's key/value, written at position
    lengths - 1; pools [1, Hkv, N, bs, D], centroids [1, Hkv, N, D]; page_table [S, P];
    lengths [S] tokens including the fed one; write [S] bool (inactive slots write nothing);
    covered [S] bool: budget >= length, attended densely (also beyond the selection width).
    Where the layer runs as the fewest kernels (`fused.fewest_kernels`) q and k_new are the raw
    projected heads, which the kernels RMSNorm (weights q_norm / k_norm [D], norm_eps) and
    rotate (cos / sin [S, D] f32 at the fed token's position) as they read them; elsewhere
    they are finished already (the model's own norms and RoPE) and these go unused.
    combined: q, k_new and v_new are one array [S, Hq + 2 Hkv, D], the layer's q, k and v heads
    in that order (`fused.combined_heads`).
    Returns (out [S, Hq, D], k_pool, v_pool, c_pool).
    """
    bs = cfg.block_size
    _, hkv, n_pages, _, _ = k_pool.shape
    s, p = page_table.shape
    pos = lengths - 1
    page = jnp.take_along_axis(page_table, (pos // bs)[:, None], axis=1)[:, 0]
    triton = fused.fewest_kernels(cfg.backend)
    q_heads = q.shape[1] - 2 * hkv if combined else None
    if triton:
        # One kernel writes K, V and (sparse layers) the filled page's centroid, in place.
        k_pool, v_pool, c_written = pallas_triton_write.write_token_triton(
            k_pool, v_pool, c_pool if sparse else None, k_new, v_new, page, pos % bs, write,
            k_finish=HeadFinish(k_norm, cos, sin, norm_eps), k_first=q_heads or 0,
            v_first=(q_heads or 0) + hkv if combined else 0)
        c_pool = c_written if sparse else c_pool
        q_finish = HeadFinish(q_norm, cos, sin, norm_eps)
    elif writes_whole_pages(cfg.backend):
        k_page, k_pool = write_token_pages(k_pool, k_new, page, pos % bs, write)
        _, v_pool = write_token_pages(v_pool, v_new, page, pos % bs, write)
    else:
        k_pool = write_token_rows(k_pool, k_new, page, pos % bs, write)
        v_pool = write_token_rows(v_pool, v_new, page, pos % bs, write)
        k_page = None

    def attend(idx, num):
        return pallas_kernels.paged_block_sparse_decode(q, k_pool, v_pool, page_table, idx, num,
                                                        lengths, backend=cfg.backend)[0]

    def dense():
        return pallas_kernels.paged_dense_decode(q, k_pool, v_pool, page_table, lengths,
                                                 backend=cfg.backend)[0]
    if triton:
        # No branch: the kernel reads covered rows' every block through their page tables and
        # the other rows' selected pages (a lax.cond costs a predicate and branch kernels per
        # layer on GPU, where each kernel launch is a cost of its own).
        picked = covered_rows = None
        if sparse:
            picked = pallas_triton_select.select_pages_triton(
                q, c_pool, page_table, lengths, budget_blocks, width=max_selected,
                block_size=bs, q_finish=q_finish, q_heads=q_heads,
                radix_bits=selection.TRITON_RADIX_BITS)[0]
            covered_rows = covered
        out = pallas_triton.paged_table_decode_triton(
            q, k_pool, v_pool, page_table, lengths, selection=picked, covered=covered_rows,
            q_finish=q_finish, q_heads=q_heads)[0]
        return out, k_pool, v_pool, c_pool
    if not sparse:
        return dense(), k_pool, v_pool, c_pool
    # The page this token filled gets its centroid (mean post-RoPE key, f32 accumulation).
    filled = write & (lengths % bs == 0)
    if k_page is None:
        k_page = k_pool[0][:, jnp.clip(page, 0, n_pages - 1)]
    full_keys = k_page.astype(jnp.float32)      # [Hkv, S, bs, D]: the written page, as stored
    cent = jnp.mean(full_keys, axis=2).astype(c_pool.dtype)
    c_pool = c_pool[0].at[:, jnp.where(filled, page, n_pages)].set(cent, mode="drop")[None]
    cents = c_pool[0][:, jnp.clip(page_table, 0, n_pages - 1)].swapaxes(0, 1)  # [S, Hkv, P, D]

    def sparse_out():
        idx, num = selection.select_blocks(q, cents, lengths, budget_blocks,
                                           max_selected=max_selected, block_size=bs,
                                           backend=cfg.selection_backend)
        return attend(idx, num)
    if max_selected >= p:
        out = sparse_out()           # the selection itself is dense for covered rows
    else:
        def mixed():
            return jnp.where(covered[:, None, None], dense(), sparse_out())
        out = jax.lax.cond(jnp.all(covered), dense,
                           lambda: jax.lax.cond(jnp.any(covered), mixed, sparse_out))
    return out, k_pool, v_pool, c_pool


def mesh_axes(spec: ShardingSpec, num_kv_heads: int) -> tuple[str | None, str | None]:
    """Mesh axes of pools/slots (data) and KV heads (model, unless the heads do not divide it:
    then replicated, as the static engine's cache)."""
    model_size = spec.mesh.shape.get("model", 1)
    return spec.rules.get("batch"), "model" if num_kv_heads % model_size == 0 else None


def _sharded(fn, spec: ShardingSpec | None, num_kv_heads: int):
    """Per-layer attention under shard_map: slots and pools over data, KV heads over model."""
    if spec is None:
        return fn
    data, heads = mesh_axes(spec, num_kv_heads)
    tok, pool, cent, row = P(data, heads, None), P(data, heads, None, None, None), \
        P(data, heads, None, None), P(data)
    table, weight = P(data, None), P(None)
    return jax.shard_map(fn, mesh=spec.mesh,
                         in_specs=(tok, tok, tok, pool, pool, cent, table, row, row, row, row,
                                   table, table, weight, weight),
                         out_specs=(tok, pool, pool, cent), check_vma=False)


def layer_attention_fns(cfg: RolloutConfig, spec: ShardingSpec | None, num_kv_heads: int,
                        max_selected: int, norm_eps: float) -> dict:
    """One layer's attention over the page pools, jitted, for dense (False) and sparse (True)
    layers: `_layer_attention`'s arguments and results, under shard_map when sharded
    (norm_eps: the model's RMSNorm epsilon). Used through `decode_step_hidden`, which paged_exact.py's
    drafts share. One jitted function per kind of layer: every layer of a kind
    has the same shapes, so jax traces (and lowers) its attention - the kernel calls of the
    dense, mixed and sparse branches - once instead of once per layer (the 8B pod chunk: ~400
    Pallas calls traced)."""
    combined = fused.combined_heads(cfg, spec)
    return {sp: jax.jit(_sharded(functools.partial(_layer_attention, sparse=sp, cfg=cfg,
                                                   max_selected=max_selected,
                                                   norm_eps=norm_eps, combined=combined), spec,
                                 num_kv_heads)) for sp in (False, True)}


def decode_step_hidden(model: Qwen3ForCausalLM, attn: dict, kv: list[list], tokens, positions,
                       page_table, write, budget_blocks, covered, *, cfg: RolloutConfig,
                       spec: ShardingSpec | None,
                       own_attention: Mapping[int, Callable] | None = None):
    """One decode step's layers over the page pools (`fused.decode_layers`): tokens [S] fed at
    positions [S] (their cache index) -> final-normed hidden [S, 1, H]. attn:
    `layer_attention_fns`; kv: [ks, vs, cs], each the layers' pools, updated in place (the list
    entries); write, budget_blocks, covered [S] as `_layer_attention`. own_attention: layers
    whose attention the caller supplies (paged_exact.py's verify-guided drafts), with attn's
    arguments and results."""
    ks, vs, cs = kv
    lengths = positions + 1

    def layer(i, q, k, v, *finish):
        fn = (own_attention or {}).get(i) or attn[cfg.sparse_layer(i)]
        out, ks[i], vs[i], cs[i] = fn(q, k, v, ks[i], vs[i], cs[i], page_table, lengths, write,
                                      budget_blocks, covered, *finish)
        return out

    return fused.decode_layers(model, layer, tokens, positions, cfg=cfg, spec=spec)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Slots:
    """The running samples of one decode chunk (host-built, bucketed to S rows)."""
    token: jax.Array         # [S] int32 last sampled token (fed next)
    length: jax.Array        # [S] int32 tokens in the cache (the fed token goes to this index)
    generated: jax.Array     # [S] int32 tokens recorded so far (index of the next one)
    active: jax.Array        # [S] bool
    sample_id: jax.Array     # [S] int32 (sampling key)
    page_table: jax.Array    # [S, P] int32 physical pages (N = none)


DECODE_CHUNK_JIT = dict(static_argnames=("graphdef", "cfg", "steps", "bin_size", "spec"),
                        donate_argnames=("kv",))


@functools.partial(jax.jit, **DECODE_CHUNK_JIT)
def decode_chunk_program(graphdef, params, kv: PagedKV, slots: Slots, budgets, rng, *,
                         cfg: RolloutConfig, steps: int, bin_size: int,
                         spec: ShardingSpec | None):
    """`steps` decode steps of every active slot (a `fori_loop`; no host round trip inside).

    The scheduler guarantees every active slot has pages for `steps` more tokens. A slot stops
    at a stop token or after cfg.max_new_tokens recorded tokens. Returns (kv, slots, records):
    records = (tokens, logprobs, budgets [S, steps], top-k values/ids [S, steps, k],
    recorded [S, steps] bool), step j of a slot being its token number generated + j.
    """
    model: Qwen3ForCausalLM = nnx.merge(graphdef, params)
    mcfg = model.config
    s, p = slots.page_table.shape
    max_selected = min(cfg.max_budget // cfg.block_size, p)
    stop_ids = jnp.asarray(cfg.stop_token_ids or (-1,), jnp.int32)
    attn = layer_attention_fns(cfg, spec, mcfg.num_key_value_heads, max_selected,
                               mcfg.rms_norm_eps)
    k_rec = cfg.record_topk
    rec0 = (jnp.zeros((s, steps), jnp.int32), jnp.zeros((s, steps), jnp.float32),
            jnp.zeros((s, steps), jnp.int32), jnp.zeros((s, steps, k_rec), jnp.float32),
            jnp.zeros((s, steps, k_rec), jnp.int32), jnp.zeros((s, steps), bool))

    def body(j, carry):
        kv, sl, rec = carry
        lengths = sl.length + 1
        budget = budget_for_lengths(budgets, lengths, bin_size)
        budget_blocks = jnp.minimum(budget // cfg.block_size, max_selected).astype(jnp.int32)
        covered = budget >= lengths          # dense for this slot (the dense rung, short rows)
        ks, vs, cs = list(kv.k), list(kv.v), list(kv.centroids)
        hidden = decode_step_hidden(model, attn, [ks, vs, cs], sl.token, sl.length,
                                    sl.page_table, sl.active, budget_blocks, covered, cfg=cfg,
                                    spec=spec)
        tok, lp, top_v, top_i = sample_tokens(rng, model.logits(hidden[:, 0]), sl.sample_id,
                                              sl.generated, cfg)
        act = sl.active
        used = budget if cfg.mode == RolloutMode.SPARSE else jnp.zeros_like(budget)
        rec = (rec[0].at[:, j].set(jnp.where(act, tok, cfg.pad_token_id)),
               rec[1].at[:, j].set(jnp.where(act, lp, 0.0)),
               rec[2].at[:, j].set(jnp.where(act, used, 0)),
               rec[3].at[:, j].set(top_v), rec[4].at[:, j].set(top_i), rec[5].at[:, j].set(act))
        generated = sl.generated + act
        done = jnp.isin(tok, stop_ids) | (generated >= cfg.max_new_tokens)
        sl = dataclasses.replace(sl, token=jnp.where(act, tok, sl.token),
                                 length=jnp.where(act, lengths, sl.length), generated=generated,
                                 active=act & ~done)
        return PagedKV(tuple(ks), tuple(vs), tuple(cs)), sl, rec

    kv, slots, rec = jax.lax.fori_loop(0, steps, body, (kv, slots, rec0))
    return kv, slots, rec


def decode_chunk_program_for(cfg: RolloutConfig):
    """`decode_chunk_program` compiled with cfg's GPU decode options
    (`RolloutConfig.decode_compiler_options`: itself at the defaults)."""
    return compiler_options.with_options(decode_chunk_program, DECODE_CHUNK_JIT,
                                         cfg.decode_compiler_options)
