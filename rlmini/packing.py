"""Batch layouts of the trainer and packed attention.

make_batch lays out a micro-batch twice: padded rows (prompt + completion, right-padded), and one packed,
padding-free sequence in which each distinct prompt appears once, followed by every completion. With packing
on, attention runs through packed_attention (registered in transformers' AttentionInterface), so the G
completions of a prompt share its one forward pass and no position is padding.
"""
import functools
import itertools
import sys

import torch
import torch.nn.functional as F


def make_batch(prompt_ids: list, completion_ids: list, pad_id: int, device,
               kernel: str | None = None, policy: list | None = None) -> dict:
    """One micro-batch in two layouts. Padded: right-padded prompt+completion rows, `mask` [b, T-1] marking
    completion tokens in the shifted targets (position t predicts token t+1). Packed (`packed`): the micro-
    batch as one padding-free sequence in which each distinct prompt appears once, followed by every
    completion; position ids restart per sequence and attention stays inside each prompt+completion, so the
    G completions of a prompt share its one forward pass (see packed_attention). `targets`: the completion
    tokens in `mask`'s nonzero order; `target_index`: that order's (row, position) pairs. `kernel`: how packed
    attention runs, "flex" (FlexAttention over a block mask built on the device; the default on CUDA) or
    "rows" (one sdpa call per row set; the default elsewhere). `policy`: per completion, 1 for each token the
    policy sampled, 0 for a tool's output: only the former are targets (in `mask`), the latter context."""
    b = len(prompt_ids)
    P = torch.tensor([len(p) for p in prompt_ids], dtype=torch.long)
    L = torch.tensor([len(c) for c in completion_ids], dtype=torch.long)
    n = P + L
    width = int(n.max())
    rows = itertools.chain.from_iterable(x for pc in zip(prompt_ids, completion_ids) for x in pc)
    seq = torch.tensor(list(rows), dtype=torch.long)
    col = torch.arange(width)
    inside = col < n[:, None]
    input_ids = torch.full((b, width), pad_id, dtype=torch.long).masked_scatter_(inside, seq)
    mask = ((col[:-1] >= P[:, None] - 1) & (col[:-1] < (n - 1)[:, None])).float()  # position t predicts t + 1
    targets = torch.tensor(list(itertools.chain.from_iterable(completion_ids)), dtype=torch.long)
    keep = None
    if policy is not None:  # tool output: context, not a target
        keep = torch.tensor(list(itertools.chain.from_iterable(policy)), dtype=torch.bool)
        rows, cols = mask.nonzero(as_tuple=True)  # completion tokens in targets order
        mask = torch.zeros_like(mask).index_put_((rows[keep], cols[keep]), torch.tensor(1.0))
        targets = targets[keep]
    batch = {"input_ids": input_ids.to(device), "attention_mask": inside.long().to(device),
             "mask": mask.to(device), "targets": targets.to(device),
             "target_index": tuple(i.to(device) for i in mask.nonzero(as_tuple=True))}
    kernel = kernel or default_kernel(torch.device(device))
    batch["packed"] = _pack(prompt_ids, completion_ids, P, L, keep, device, kernel)
    return batch


_KERNEL = {"packed_attention": "auto"}  # --packed_attention, set once by models.load_model


def use_kernel(name: str) -> None:
    _KERNEL["packed_attention"] = name


def default_kernel(device) -> str:
    """--packed_attention: auto is FlexAttention on CUDA, where sdpa with a mask and GQA falls to the math
    kernel (fp32 [rows, heads, Lq, Lk] scores kept for backward, docs/models.md), and the row sets elsewhere
    (torch has no FlexAttention backward on CPU)."""
    name = _KERNEL["packed_attention"]
    return name if name != "auto" else ("flex" if device.type == "cuda" else "rows")


def _pack(prompt_ids, completion_ids, P, L, keep, device, kernel) -> dict:
    """The packed layout of make_batch: [distinct prompts][completions, by length class], with position ids,
    the attention rows of packed_attention and, per completion token (targets order), the packed position that
    predicts it (its prompt's last token for the first one). Completions are grouped into length classes
    (up to 16 tokens, 17-32, 33-64, ...), one attention row set each, so that a long tail of lengths does not
    pad every short completion's attention to the longest one."""
    first, owner = {}, []  # distinct prompts by content: identical tokens give identical keys and values
    for p in prompt_ids:
        owner.append(first.setdefault(tuple(p), len(first)))
    prompts = list(first)
    owner = torch.tensor(owner, dtype=torch.long)
    Pu = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    p_start = torch.cumsum(Pu, 0) - Pu
    n_prompt = int(Pu.sum())
    length_class = torch.log2(L.clamp(min=16).double()).ceil().long()
    order = torch.sort(length_class, stable=True).indices  # the completions' order in the packed sequence
    c_start = torch.empty_like(L)
    c_start[order] = n_prompt + torch.cumsum(L[order], 0) - L[order]
    completions = itertools.chain.from_iterable(completion_ids[i] for i in order.tolist())
    ids = itertools.chain(itertools.chain.from_iterable(prompts), completions)
    ids = torch.tensor(list(ids), dtype=torch.long)
    # position of each token within its own sequence: prompts 0..P-1, a completion continues its prompt
    pos_p = torch.arange(n_prompt) - torch.repeat_interleave(p_start, Pu)
    pos_c = (torch.repeat_interleave(P[order], L[order]) + torch.arange(int(L.sum()))
             - torch.repeat_interleave(c_start[order] - n_prompt, L[order]))
    seq = torch.repeat_interleave(torch.arange(len(L)), L)  # per target: its completion; j: its index there
    j = torch.arange(int(L.sum())) - torch.repeat_interleave(torch.cumsum(L, 0) - L, L)
    pred = torch.where(j == 0, (p_start[owner] + P - 1)[seq], c_start[seq] + j - 1)
    pred = pred if keep is None else pred[keep]  # `keep`: the policy's tokens (make_batch's `policy`)
    packed = {"input_ids": ids[None].to(device), "position_ids": torch.cat([pos_p, pos_c])[None].to(device),
              "pred": pred.to(device), "computed": len(ids),  # places: built only when routes ask (moe.py)
              "places": functools.partial(_padded_places, P, L, owner, order, p_start, Pu, c_start, pos_p,
                                          pos_c, device)}
    if kernel == "flex":
        packed["rows"] = FlexLayout(p_start, Pu, c_start[order], L[order], P[order], p_start[owner[order]],
                                    len(ids), device)
        return packed
    none = torch.zeros_like(Pu)
    rows = [_attention_rows(p_start, Pu, none, p_start, none)]  # prompts: themselves
    for c in torch.unique(length_class).tolist():  # completions: their prompt, then themselves
        i = order[length_class[order] == c]
        rows.append(_attention_rows(c_start[i], L[i], P[i], p_start[owner[i]], P[i]))
    packed["rows"] = [tuple(t.to(device) for t in r) for r in rows]
    return packed


def _padded_places(P, L, owner, order, p_start, Pu, c_start, pos_p, pos_c, device) -> dict:
    """Where each packed token sits in the padded rows (flat index row * width + position: a shared prompt's
    tokens in its first row), `padded_at`, and the reverse for every padded place, `packed_at` (-1: padding):
    what lays per-token inputs of the padded layout out for the packed forward and back (rlmini/moe.py);
    `owner` (each row's distinct prompt) and `prompt_of` (each packed prompt token's) let moe.set_routes
    take a shared prompt from another of its rows."""
    width, b = int((P + L).max()), len(P)
    first = torch.full((len(Pu),), b, dtype=torch.long).scatter_reduce_(0, owner, torch.arange(b), "amin")
    padded_at = torch.cat([torch.repeat_interleave(first * width, Pu) + pos_p,
                           torch.repeat_interleave(order * width, L[order]) + pos_c])
    packed_at = torch.full((b * width,), -1, dtype=torch.long)
    packed_at[padded_at[len(pos_p):]] = torch.arange(len(pos_p), len(padded_at))  # completions: their own
    j = torch.arange(int(P.sum())) - torch.repeat_interleave(torch.cumsum(P, 0) - P, P)  # every row's prompt
    packed_at[torch.repeat_interleave(torch.arange(b) * width, P) + j] = torch.repeat_interleave(
        p_start[owner], P) + j
    return {"padded_at": padded_at.to(device), "packed_at": packed_at.to(device), "owner": owner.to(device),
            "prompt_of": torch.repeat_interleave(torch.arange(len(Pu)), Pu).to(device)}


class FlexLayout:
    """The packed sequence's attention for FlexAttention, in O(tokens): each query's keys are at most two
    contiguous spans of the packed sequence, its prompt [a1, b1) and its own completion so far [a2, b2)
    (sliding windows shorten both), held as int tensors of N entries on the device. block_mask(window) turns
    them into a BlockMask (which 128 x 128 blocks to compute, which of those need the mask) without an [N, N]
    tensor: the block table is [N/128, N/128]."""

    BLOCK = 128  # FlexAttention's default sparse block size

    def __init__(self, p_start, p_len, c_start, c_len, c_prompt_len, c_prompt_start, n, device):
        seq, m = torch.arange(n), int(p_len.sum())  # m: prompt tokens, first in the packed sequence
        a1, b1, a2, b2 = seq.clone(), seq + 1, seq.clone(), seq.clone()  # prompts: their own prefix
        a1[:m] = torch.repeat_interleave(p_start, p_len)
        a1[m:] = torch.repeat_interleave(c_prompt_start, c_len)  # completions: their prompt, then themselves
        b1[m:] = torch.repeat_interleave(c_prompt_start + c_prompt_len, c_len)
        a2[m:] = torch.repeat_interleave(c_start, c_len)
        b2[m:] = seq[m:] + 1
        offset = torch.zeros(n, dtype=torch.long)  # the position of a2's token: its prompt's length
        offset[m:] = torch.repeat_interleave(c_prompt_len, c_len)
        self.n, self.device, self.masks = n, device, {}
        self.spans = torch.stack([a1, b1, a2, b2]).to(device)  # [4, N]
        self.offset = offset.to(device)
        self.pos = torch.where(seq < m, seq - a1, offset + seq - a2).to(device)  # position in its sequence

    def windowed(self, window):
        """(a1, b1, a2, b2) without the keys more than `window - 1` positions back (sliding-window layers)."""
        a1, b1, a2, b2 = self.spans
        if window is None:
            return a1, b1, a2, b2
        first = self.pos - window + 1  # the earliest position a query sees; a1 is position 0
        return torch.maximum(a1, a1 + first), b1, torch.maximum(a2, a2 + first - self.offset), b2

    def block_mask(self, window=None):
        if window not in self.masks:
            self.masks[window] = self._block_mask(*self.windowed(window))
        return self.masks[window]

    def _block_mask(self, a1, b1, a2, b2):
        from torch.nn.attention.flex_attention import BlockMask
        B, n = self.BLOCK, self.n
        nb = (n + B - 1) // B
        qb = torch.arange(n, device=self.device) // B
        touched = torch.zeros(nb, nb + 1, dtype=torch.int32, device=self.device)
        covered = torch.zeros_like(touched)
        for a, b in ((a1, b1), (a2, b2)):
            some = a < b
            lo, hi = a // B, (b - 1) // B  # the blocks the span touches
            lo_f = (a + B - 1) // B  # the blocks it covers whole (the last block may be short)
            hi_f = torch.where(b >= n, nb - 1, b // B - 1)
            whole = some & (lo_f <= hi_f)
            for count, first, last, ok in ((touched, lo, hi, some), (covered, lo_f, hi_f, whole)):
                one = ok.to(torch.int32)  # +1 at the first block, -1 after the last: a cumsum counts
                count.view(-1).index_add_(0, qb * (nb + 1) + first.clamp(0, nb), one)
                count.view(-1).index_add_(0, qb * (nb + 1) + (last + 1).clamp(0, nb), -one)
        queries = torch.bincount(qb, minlength=nb).to(torch.int32)  # per query block (the last may be short)
        needed = touched.cumsum(1)[:, :nb] > 0
        full = covered.cumsum(1)[:, :nb] == queries[:, None]
        partial = needed & ~full

        def table(blocks):  # per query block: how many kv blocks, and their indices first
            indices = torch.argsort((~blocks).to(torch.int8), dim=1, stable=True).to(torch.int32)
            return blocks.sum(1).to(torch.int32)[None, None], indices[None, None]

        def mask_mod(b, h, q, kv):
            return ((a1[q] <= kv) & (kv < b1[q])) | ((a2[q] <= kv) & (kv < b2[q]))
        return BlockMask.from_kv_blocks(*table(partial), *table(full), BLOCK_SIZE=B, mask_mod=mask_mod,
                                        seq_lengths=(n, n))


def _attention_rows(q_start, q_len, q_pos0, ctx_start, ctx_len):
    """Index tensors of one set of attention rows over the packed sequence. Row r queries the q_len[r] tokens
    from q_start[r] (positions q_pos0[r] on); its keys are ctx_len[r] context tokens from ctx_start[r]
    (positions 0 on: its prompt) followed by its queries, each query seeing the context and the queries up to
    itself. Returns (query index [R, Lq], query valid [R, Lq], key index [R, Lk], allowed [R, Lq, Lk],
    query positions, key positions); padding slots index token 0 and are masked."""
    R = len(q_len)
    s, t = torch.arange(max(int(q_len.max()), 1)), torch.arange(int(ctx_len.max()))
    q_valid, ctx_valid = s < q_len[:, None], t < ctx_len[:, None]
    q_idx = torch.where(q_valid, q_start[:, None] + s, 0)
    q_pos = q_pos0[:, None] + s
    k_idx = torch.cat([torch.where(ctx_valid, ctx_start[:, None] + t, 0), q_idx], 1)
    k_valid = torch.cat([ctx_valid, q_valid], 1)
    k_pos = torch.cat([t.expand(R, len(t)), q_pos], 1)
    allowed = q_valid[:, :, None] & k_valid[:, None, :] & (k_pos[:, None, :] <= q_pos[:, :, None])
    allowed[:, :, 0] |= ~q_valid  # padding queries see one key (else NaN); their outputs are dropped
    return q_idx, q_valid, k_idx, allowed, q_pos, k_pos


def index_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[index] along dim 0 ([*index.shape, *x.shape[1:]]), with a backward that sums repeated rows (a
    prompt's keys, read by each of its G completions) in a fixed order: on CPU indexing's backward adds
    them with atomics across threads (another float sum on every run), on CUDA index_select's does
    (torch's use_deterministic_algorithms list), so each device takes the other one."""
    if x.device.type == "cpu":
        return x.index_select(0, index.reshape(-1)).view(*index.shape, *x.shape[1:])
    return x[index]


# what transformers' attention layers pass that changes nothing here (the packed rows carry the positions)
_INERT = {"position_ids", "cache_position", "use_cache", "output_attentions", "past_key_values", "is_causal"}
# off, what a mixture of experts passes every layer: routing is per token, so a packed token is routed as in
# its padded row (no router logits asked for: the trainer adds no load-balancing loss)
_INERT_WHEN_FALSE = {"output_router_logits"}


def packed_attention(delegate):
    """An attention function for transformers' AttentionInterface: with `packed_rows` (a make_batch packed
    layout) it attends within each prompt+completion of the packed sequence, one attention call per row set
    (distinct prompts; completions, whose keys are their prompt's keys and values followed by their own);
    without, it is `delegate` (sdpa, eager, ...), so generation and every other call are unchanged.
    Per-token layers (projections, MLP, norms) see each packed token once: no padding, each prompt once.
    A keyword it does not implement (attention sinks, ...) raises: enable_packing then keeps padded rows."""
    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                  softcap=None, packed_rows=None, **kwargs):
        if packed_rows is None:
            if softcap is None and _grouped_on_cpu(delegate, module, query, attention_mask, kwargs):
                return _grouped_sdpa(query, key, value, attention_mask, scaling, dropout), None
            extra = {} if softcap is None else {"softcap": softcap}
            return delegate(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                            sliding_window=sliding_window, **extra, **kwargs)
        unknown = sorted(k for k, v in kwargs.items() if k not in _INERT and v is not None
                         and not (k in _INERT_WHEN_FALSE and v is False))
        if unknown:
            raise NotImplementedError(f"packed attention does not implement {', '.join(unknown)}")
        if isinstance(packed_rows, FlexLayout):
            mask = packed_rows.block_mask(sliding_window)
            return _flex_attention(query, key, value, mask, scaling, softcap), None
        q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [N, heads, head_dim]
        out = []
        for q_idx, q_valid, k_idx, allowed, q_pos, k_pos in packed_rows:
            if sliding_window is not None:  # sliding-window layers (Mistral, Qwen2 with use_sliding_window)
                allowed = allowed & (q_pos[:, :, None] - k_pos[:, None, :] < sliding_window)
                allowed[:, :, 0] |= ~q_valid
            qs, ks, vs = (index_rows(x, i).transpose(1, 2) for x, i in ((q, q_idx), (k, k_idx), (v, k_idx)))
            if softcap is None:
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed[:, None], dropout_p=dropout,
                                                   scale=scaling, enable_gqa=q.shape[1] != k.shape[1])
            else:
                o = _softcapped_attention(qs, ks, vs, allowed[:, None], scaling, softcap)
            out.append(o.transpose(1, 2)[q_valid])  # row-major valid queries: this row set's packed order
        return torch.cat(out)[None], None
    return attention


def _grouped_on_cpu(delegate, module, query, attention_mask, kwargs) -> bool:
    """transformers' sdpa given a mask with fewer key than query heads copies the keys and values once per
    query head of a group (sdpa_attention.py::repeat_kv, kept because CUDA's masked kernels lack grouped
    queries): on CPU, for each layer of each decoding step, the whole KV cache (SmolLM2: 3 -> 9 heads, most of
    a decoding step's attention time). torch's CPU flash kernel takes the mask with enable_gqa, a query head
    reading its KV head in place (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp: gqa_shards =
    num_head / num_head_k), the same values: used there, for calls with nothing else sdpa handles."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    return (delegate is sdpa_attention_forward and query.device.type == "cpu" and attention_mask is not None
            and getattr(module, "num_key_value_groups", 1) > 1 and not kwargs.get("output_attentions")
            and kwargs.get("position_bias") is None and kwargs.get("cache") is None)


def _grouped_sdpa(query, key, value, attention_mask, scaling, dropout):
    """sdpa_attention_forward's computation for a masked call, the key and value heads shared by their groups
    of query heads in the kernel (enable_gqa) rather than copied: [B, L, heads, head_dim] out."""
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous()


def _flex_attention(query, key, value, block_mask, scaling, softcap):
    """FlexAttention over the packed sequence ([1, heads, N, head_dim] in, [1, N, heads, head_dim] out):
    compiled on CUDA (a fused kernel: memory linear in N, blocks outside the mask skipped); eager elsewhere
    (it materialises the scores: for tests). q and k are cast to v's dtype, as sdpa's autocast does: under
    autocast the policy's rotary embedding leaves them fp32 against a bf16 v, the reference's are bf16, and
    each mix would be one more compiled variant of the few that fit torch's recompile_limit."""
    from torch.nn.attention.flex_attention import flex_attention
    backend = _FLEX["backend"]
    attend = _compiled_flex(backend or "inductor") if query.is_cuda or backend else flex_attention
    query, key = query.to(value.dtype), key.to(value.dtype)
    try:
        out = attend(query, key, value, block_mask=block_mask, scale=scaling,
                     score_mod=None if softcap is None else _soft_cap(softcap, query.device),
                     enable_gqa=query.shape[1] != key.shape[1])
    except torch._dynamo.exc.FailOnRecompileLimitHit:
        raise RuntimeError(f"FlexAttention needs more than torch._dynamo.config.recompile_limit = "
                           f"{torch._dynamo.config.recompile_limit} compiled variants (this call: "
                           f"{_variant(query, key, value)}); past it torch runs eager flex, which "
                           f"materialises [N, N] scores: use --packed_attention rows") from None
    return out.transpose(1, 2)


@functools.cache
def _soft_cap(softcap: float, device):
    """Gemma 2's attention soft cap as a score_mod, as in its eager attention; one per cap, which is a tensor:
    dynamo makes a float captured by a score_mod an unbacked symbol, and the grad pass fails to trace it."""
    cap = torch.tensor(softcap, device=device)

    def soft_cap(score, b, h, q, kv):
        return torch.tanh(score / cap) * cap
    return soft_cap


_FLEX = {"backend": None}  # None: inductor on CUDA, eager elsewhere; tests count variants with their own


def _variant(*tensors) -> str:
    """What a compiled variant is keyed on besides the model: grad mode, dtypes, the length (one block or
    more: dynamo specialises a dimension of size 1)."""
    grad = "grad" if torch.is_grad_enabled() and any(t.requires_grad for t in tensors) else "no-grad"
    dtypes = "/".join(str(t.dtype).removeprefix("torch.") for t in tensors)
    return f"{grad}, q/k/v {dtypes}, {tensors[0].shape[2]} tokens"


@functools.cache
def _compiled_flex(backend):
    from torch.nn.attention.flex_attention import flex_attention
    # dynamic: the packed length changes every micro-batch; fullgraph: past recompile_limit dynamo raises
    # instead of running flex eagerly (torch/_dynamo/convert_frame.py::_compile: "fullgraph=True")
    return torch.compile(flex_attention, dynamic=True, fullgraph=True, backend=backend)


def _softcapped_attention(q, k, v, allowed, scaling, softcap):
    """Attention with Gemma 2's logit soft cap, cap * tanh(s / cap) on the scores (eager_attention_forward in
    transformers' gemma2, op for op; sdpa has no soft cap). q [R, H, Lq, d], k and v [R, H_kv, Lk, d]."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scaling
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    return torch.matmul(torch.softmax(scores, -1, dtype=torch.float32).to(q.dtype), v)


def _own_eager(module, *args, **kwargs):
    """The model's own eager attention: each transformers model file defines one (get_interface's default)."""
    return sys.modules[type(module).__module__].eager_attention_forward(module, *args, **kwargs)


def exact_attention(model) -> None:
    """Run attention that computes what the model defines: transformers' sdpa and flash functions drop the
    attention soft cap Gemma 2 passes (`softcap` ends in sdpa_attention_forward's **kwargs), so a soft-capped
    model runs eager attention, which applies it."""
    if getattr(model.config, "attn_logit_softcapping", None) is not None:
        impl = model.config._attn_implementation
        if impl not in ("eager", "packed_eager"):
            model.set_attn_implementation("eager")


def enable_packing(model) -> bool:
    """Route `model`'s attention through packed_attention (registered as 'packed_<its implementation>', mask
    creation unchanged), so that model_forward can run make_batch's packed layout, after checking on a small
    batch that packed and padded forwards agree. False (padded batches, with a note) when the model does not
    use transformers' attention interface (eager attention, custom code) or computes something the packed
    rows do not (attention sinks, ...)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    impl = model.config._attn_implementation
    if impl.startswith("packed_"):
        return True
    functions = {**AttentionInterface._global_mapping, "eager": _own_eager}
    if impl not in functions or impl not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        return False
    name = "packed_" + impl
    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, packed_attention(functions[impl]))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[impl])
    from torch._guards import active_fake_mode
    if active_fake_mode() is not None or next(model.parameters()).is_meta:  # no values to compare (memplan)
        model.set_attn_implementation(name)
        return True
    device = next(model.parameters()).device
    probe = make_batch([[2, 3, 4], [2, 3, 4], [5]], [[6, 7], [8], [3, 2, 9, 4]], 0, device)
    was_training = model.training
    why = None
    with torch.no_grad():
        model.eval()
        (_, pick_b), b = final_hidden(model, lambda: model_forward(model, probe))
        model.set_attn_implementation(name)
        try:
            (_, pick_a), a = final_hidden(model, lambda: model_forward(model, probe))
        except NotImplementedError as e:
            why = str(e)
        model.train(was_training)
    if why is None:
        a, b = pick_a(a).float(), pick_b(b).float()
        diff, scale = (a - b).abs().max().item(), b.abs().max().item()
        if not diff <= (1e-4 if next(model.parameters()).dtype == torch.float32 else 5e-2) * max(scale, 1.0):
            why = f"its packed forward differs from the padded one by {diff:.3g} on a test batch"
    if why is not None:
        model.set_attn_implementation(impl)
        print(f"note: --packing is off for this model ({type(model).__name__}): {why}; the update uses "
              f"padded rows", file=sys.stderr)
        return False
    return True


def unwrapped(model):
    return getattr(model, "policy", model)  # AdaptersOff (a LoRA policy's reference): its policy


def packing_enabled(model) -> bool:
    model = unwrapped(model)
    return str(getattr(getattr(model, "config", None), "_attn_implementation", "")).startswith("packed_")


def model_forward(model, batch: dict, **kwargs):
    """(output, pick): `model` on `batch`, packed when the model allows it, else padded; pick(x) takes any
    per-position output x [B, T, ...] at the positions that predict the completion tokens, in
    batch["targets"] order (pick of the last hidden state is [n_targets, hidden]). Packed, a prompt's last
    position predicts the first token of each of its completions, so it is taken G times (index_rows: a
    fixed-order backward)."""
    if packing_enabled(model):
        p = batch["packed"]
        # transformers takes a 4-D mask as given, so it builds no [N, N] mask; packed_attention uses the rows
        unused = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=p["input_ids"].device)
        out = model(input_ids=p["input_ids"], position_ids=p["position_ids"], attention_mask=unused,
                    packed_rows=p["rows"], **kwargs)
        return out, lambda x: index_rows(x[0], p["pred"])
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **kwargs)
    return out, lambda x: x[batch["target_index"]]  # each position once


def final_hidden(model, run):
    """(run(), the decoder's last hidden state in that call): the one activation the output layer reads,
    captured by a hook on the decoder instead of keeping every layer's output (output_hidden_states)."""
    seen = []
    hook = unwrapped(model).get_decoder().register_forward_hook(lambda m, args, out: seen.append(out[0]))
    try:
        result = run()
    finally:
        hook.remove()
    return result, seen[-1]


def to_batch_layout(values, batch: dict):
    """Values per completion token (batch["targets"] order) -> [b, T-1] laid out like batch["mask"]."""
    out = torch.zeros(batch["mask"].shape, dtype=values.dtype, device=values.device)
    return out.index_put(batch["target_index"], values)


def padded_tokens(batch: dict, model) -> tuple:
    """(token positions `model` computes on `batch`, of which padding): perf/pad_frac."""
    if packing_enabled(model):
        return batch["packed"]["computed"], 0
    real = int(batch["attention_mask"].sum())
    return batch["input_ids"].numel(), batch["input_ids"].numel() - real

