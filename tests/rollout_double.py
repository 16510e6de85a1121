"""A deterministic stand-in for generation (HFEngine.generate) on the addition and ordinal tasks: the
completions of a prompt depend on the prompt's text alone (correct, off by one or two, or unfinished: no EOS
within the budget), whichever process or rank samples it; the sampler's log-probs are the trainer's own."""
import hashlib
import re

import torch

from rlmini import data, logprobs, models, packing
from rlmini.engine import HFEngine


def generate_double(engine, prompt_ids, n, max_new_tokens, temperature, seed, stop=None, routes=False):
    """HFEngine.generate's stand-in (the engine gives the tokenizer, the policy, device and dtype). modmul
    prompts (--tools): the first turn calls (```output), answers right or wrong, or runs on; a turn after a
    tool's output copies it (or misreads it). `routes` (a mixture of experts): none returned, as a sampler
    that cannot give them (the trainer routes every token itself)."""
    tok = engine.tokenizer
    r = data.Rollouts([], [], [], [], engine.pad_id)
    budgets = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompt_ids)
    for ids, budget in zip(prompt_ids, budgets):
        text = tok.decode(ids, skip_special_tokens=True)
        for j in range(n):
            kind = hashlib.sha256(f"{text}/{j}".encode()).digest()[0] % 4
            if "```python" in text:
                toks = _modmul_turn(tok, text, kind, budget)
            else:
                answer = sum(int(x) for x in text.rstrip("=").split("+"))
                toks = tok.convert_tokens_to_ids(list(str(answer + (0, 1, 2, 0)[kind]))) + [tok.eos_token_id]
                if kind == 3:  # unfinished: no EOS within the budget
                    toks = tok.convert_tokens_to_ids(list("9" * budget))
            r.prompt_ids.append(list(ids))
            r.completion_ids.append(toks[:budget])
            r.finished.append(r.completion_ids[-1][-1:] == [tok.eos_token_id])
    # greedy (temperature 0): the log-probs of the untempered logits, as both engines report them
    return with_trainer_logprobs(r, engine.model, temperature or 1.0, engine.device, engine.dtype)


def _modmul_turn(tok, text, kind, budget):
    if "```output" in text:  # after the output: copy it (kind 2: misread it)
        shown = int(text.rsplit("```output", 1)[1].split()[0])
        return tok.convert_tokens_to_ids([str((shown + (kind == 2)) % 10)]) + [tok.eos_token_id]
    a, b, m = map(int, re.search(r"(\d+)\*(\d+)%(\d+)", text).groups())
    if kind == 0:
        return tok.convert_tokens_to_ids(["```output"])
    if kind == 3:
        return tok.convert_tokens_to_ids(list("9" * budget))
    return tok.convert_tokens_to_ids([str((a * b % m + (kind == 2)) % 10)]) + [tok.eos_token_id]


def with_trainer_logprobs(r, model, temperature, device, dtype):
    """A double's rollouts get the trainer's own log-probs as the sampler's (an exact sampler)."""
    batch = packing.make_batch(r.prompt_ids, r.completion_ids, r.pad_id, device)
    with torch.no_grad(), models.autocast(device, dtype):
        logp, _ = logprobs.token_logprobs(model, batch, temperature)
    r.sampler_logprobs = [lp[m > 0].tolist() for lp, m in zip(logp.cpu(), batch["mask"].cpu())]
    return r


def record_first_step(monkeypatch, script, argv):
    """Run one training step of `script` (a train_*.py module) on this double, in this process; returns (run,
    the rollout batches generated, each policy gradient clip call's gradients before clipping, tokenizer)."""
    grads, batches = [], []
    clip = torch.nn.utils.clip_grad_norm_

    def recording_double(engine, *a, **k):
        batches.append(generate_double(engine, *a, **k))
        return batches[-1]

    def recording_clip(parameters, *a, **k):
        params = list(parameters)
        grads.append([p.grad.clone() for p in params])
        return clip(params, *a, **k)

    monkeypatch.setattr(HFEngine, "generate", recording_double)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", recording_clip)
    run = script.main(["--wandb", "false", "--engine", "hf", "--steps", "1", "--save_every", "0", *argv])
    return run, batches, grads, run.tokenizer


def addition_rewards(run, tok, r):
    """The task's reward of each completion of a rollout batch of the addition task (the answer from the
    prompt)."""
    def answer(p):
        return sum(int(x) for x in tok.decode(p, skip_special_tokens=True).rstrip("=").split("+"))
    return torch.tensor([run.task.score(tok.decode(c, skip_special_tokens=True), {"answer": answer(p)},
                                        f).reward
                         for p, c, f in zip(r.prompt_ids, r.completion_ids, r.finished)])
