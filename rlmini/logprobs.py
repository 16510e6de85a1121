"""Token log-probs (and entropies) under the trainer's model, with the vocabulary projection in checkpointed
chunks, and the conversions between a micro-batch's [b, T-1] layout and per-completion (ragged) tensors."""
import torch
import torch.nn.functional as F

from rlmini.packing import model_forward, to_batch_layout


def _chunk_logprobs(hidden, weight, targets, temperature, with_entropy=False):
    """log pi(target) and, if asked, the entropy H = logsumexp(z) - sum_v softmax(z)_v z_v of one chunk."""
    logits = F.linear(hidden, weight).float() / temperature
    lse = torch.logsumexp(logits, -1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    return logp, (lse - (logits.softmax(-1) * logits).sum(-1)) if with_entropy else None


def token_logprobs(model, batch: dict, temperature: float, chunk_tokens: int = 4096,
                   with_entropy: bool = False) -> tuple:
    """log pi(token) for every target position, [B, T-1] in fp32 (zero where mask is 0), and the policy
    entropy per position if asked (with its gradient when grad is on: an entropy bonus).

    The vocabulary projection runs over chunks of `chunk_tokens` completion positions, each recomputed in the
    backward pass (checkpointed), so a full-vocabulary fp32 log-softmax never exists for the whole batch.
    """
    for m in model.modules():  # --lora_dropout acts in gradient passes only (not pi_old, guards, reference)
        if isinstance(m, torch.nn.Dropout) and m.p > 0:
            m.train(torch.is_grad_enabled())
    # the forward computes logits for one position only; the final normed hidden state feeds the projection
    out, pick = model_forward(model, batch, output_hidden_states=True, logits_to_keep=1, use_cache=False)
    h, tg = pick(out.hidden_states[-1]), batch["targets"]
    weight = model.get_output_embeddings().weight  # FSDP2: gathered until backward (see dist.shard_model)
    lp_parts, ent_parts = [], []
    for s in range(0, h.shape[0], chunk_tokens):
        hs, ts = h[s:s + chunk_tokens], tg[s:s + chunk_tokens]
        if torch.is_grad_enabled() and hs.requires_grad:
            lp, ent = torch.utils.checkpoint.checkpoint(_chunk_logprobs, hs, weight, ts, temperature,
                                                        with_entropy, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(hs, weight, ts, temperature, with_entropy)
        lp_parts.append(lp)
        ent_parts.append(ent)
    empty = h.new_zeros(0, dtype=torch.float32)
    logp = to_batch_layout(torch.cat(lp_parts) if lp_parts else empty, batch)
    entropy = to_batch_layout(torch.cat(ent_parts) if ent_parts else empty, batch) if with_entropy else None
    return logp, entropy


def to_ragged(padded, mask) -> list:
    """[b, T] values laid out like `mask` -> one 1-D tensor per completion (its tokens only)."""
    return [v[m > 0] for v, m in zip(padded, mask)]


def to_padded(ragged: list, idx: list, mask):
    """The inverse: the 1-D tensors of completions `idx` -> [b, T] laid out like `mask`, 0 elsewhere."""
    out = torch.zeros_like(mask)
    out[mask > 0] = torch.cat([ragged[i].to(mask.device) for i in idx])
    return out
