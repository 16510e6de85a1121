"""Token log-probs (and entropies) under the trainer's model, with the vocabulary projection in checkpointed
chunks, and the conversions between a micro-batch's [b, T-1] layout and per-completion (ragged) tensors."""
import torch

from rlmini import moe
from rlmini.packing import final_hidden, model_forward, to_batch_layout, unwrapped


def output_logits(model, hidden):
    """The model's logits from its final (normed) hidden states, as its own forward computes them: its output
    layer (with a bias where it has one), then the scaling or soft cap of its family. check_output_head
    proves at load that this equals the model's forward, and refuses a model for which it does not."""
    model = unwrapped(model)
    config = model.config
    logits = model.get_output_embeddings()(hidden)
    if getattr(config, "logits_scaling", None) is not None:  # Granite (GraniteForCausalLM.forward)
        logits = logits / config.logits_scaling
    if getattr(config, "logit_scale", None) is not None:  # Cohere (CohereForCausalLM.forward)
        logits = logits * config.logit_scale
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is not None:  # Gemma 2/3: cap * tanh(z / cap) (Gemma2ForCausalLM.forward)
        logits = torch.tanh(logits / cap) * cap
    return logits


def check_output_head(model, name: str) -> None:
    """Refuse (one line) a model whose forward maps its final hidden states to logits in a way output_logits
    does not reproduce. The probe replaces the decoder's output with hidden states large enough that a soft
    cap, a scale or a bias shows (logits of about +-50), and compares the model's own logits with ours."""
    model = unwrapped(model)
    width = model.get_output_embeddings().in_features
    param = next(model.parameters())
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        h = torch.randn(1, 8, width, generator=gen).to(param.device, param.dtype)
        h = h * (50.0 / output_logits(model, h).float().std().clamp(min=1e-6)).to(h.dtype)
        ours = output_logits(model, h).float()

        def replace(module, args, out):  # the decoder's output, [1, 8, width], becomes the probe
            out[0].copy_(h)
            return out
        hook = model.get_decoder().register_forward_hook(replace)
        try:
            theirs = model(input_ids=torch.zeros(1, 8, dtype=torch.long, device=param.device),
                           use_cache=False).logits.float()
        finally:
            hook.remove()
    diff, scale = (ours - theirs).abs().max().item(), theirs.abs().max().item()
    if not diff <= 1e-5 * max(scale, 1.0):
        raise SystemExit(f"--model {name}: {type(model).__name__} computes its logits from the last hidden "
                         f"state differently from an output layer with the known scalings (logits_scaling, "
                         f"logit_scale, final_logit_softcapping): max difference {diff:.3g} on a probe; the "
                         f"trainer's log-probs would not be the model's, so it is not supported")


def _chunk_logprobs(hidden, model, targets, temperature, with_entropy=False, entropy_grad=False):
    """log pi(target) and, if asked, the entropy H = logsumexp(z) - sum_v softmax(z)_v z_v of one chunk, with
    its gradient only if `entropy_grad`."""
    logits = output_logits(model, hidden).float()
    if temperature != 1:  # x / 1 is x: no [chunk, vocab] pass and buffer for it
        logits = logits / temperature
    lse = torch.logsumexp(logits, -1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy:
        return logp, None
    # without a gradient the entropy saves nothing for backward: else the checkpoint's recomputation of every
    # chunk keeps its fp32 softmax and logits ([chunk, vocab] each) until the whole backward ends, since no
    # gradient reaches the nodes that would release them (torch/utils/checkpoint.py::_checkpoint_hook)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        return logp, lse - (logits.softmax(-1) * logits).sum(-1)


def chunk_for(vocab: int) -> int:
    """Positions per chunk of the vocabulary projection: 4096, fewer for a large vocabulary so that one fp32
    [chunk, vocab] buffer stays under 1 GiB (its backward holds five: Qwen2.5's 152k vocabulary, 1766)."""
    return max(256, min(4096, (1 << 30) // (4 * vocab)))


def recompute_chunks(hidden, chunk_tokens: int) -> bool:
    """Whether the vocabulary chunks are checkpointed: on CPU one chunk is kept for backward, not recomputed
    (5-6% of SmolLM2's update): no memory plan binds host memory, and chunk_for bounds a chunk's buffers; on
    a GPU the memory plan counts checkpointed chunks."""
    return hidden.device.type != "cpu" or hidden.shape[0] > chunk_tokens


def token_logprobs(model, batch: dict, temperature: float, chunk_tokens: int | None = None,
                   with_entropy: bool = False, entropy_grad: bool = False) -> tuple:
    """log pi(token) for every target position, [B, T-1] in fp32 (zero where mask is 0), and the policy
    entropy per position if asked (`with_entropy`), with its gradient if `entropy_grad` (an entropy bonus).

    The vocabulary projection runs over chunks of `chunk_tokens` completion positions (chunk_for the model's
    vocabulary unless given), each recomputed in the backward pass (checkpointed), so a full-vocabulary fp32
    log-softmax never exists for the whole batch; on CPU a micro-batch of one chunk is not recomputed (the
    same gradients, bit for bit).
    """
    for m in model.modules():  # --lora_dropout acts in gradient passes only (not pi_old, guards, reference)
        if isinstance(m, torch.nn.Dropout) and m.p > 0:
            m.train(torch.is_grad_enabled())
    moe.set_routes(model, batch.get("routes"), batch.get("replay", False), batch)  # a policy pass: sampler's
    # the forward computes logits for one position only; the final normed hidden state feeds the projection
    forward = lambda: model_forward(model, batch, logits_to_keep=1, use_cache=False)  # noqa: E731
    (out, pick), last = final_hidden(model, forward)
    h, tg = pick(last), batch["targets"]
    chunk_tokens = chunk_tokens or chunk_for(unwrapped(model).get_output_embeddings().weight.shape[0])
    lp_parts, ent_parts = [], []
    recompute = recompute_chunks(h, chunk_tokens)
    for s in range(0, h.shape[0], chunk_tokens):
        hs, ts = h[s:s + chunk_tokens], tg[s:s + chunk_tokens]
        if torch.is_grad_enabled() and hs.requires_grad and recompute:
            lp, ent = torch.utils.checkpoint.checkpoint(_chunk_logprobs, hs, model, ts, temperature,
                                                        with_entropy, entropy_grad, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(hs, model, ts, temperature, with_entropy)
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
    out[mask > 0] = torch.cat([ragged[i] for i in idx]).to(mask.device)  # one copy to the device
    return out
