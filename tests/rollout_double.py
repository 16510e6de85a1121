"""A deterministic stand-in for generation (common.generate) on the addition and ordinal tasks: the
completions of a prompt depend on the prompt's text alone (correct, off by one or two, or unfinished:
no EOS within the budget), whichever process or rank samples it; the sampler's log-probs are the
trainer's own. Set `generate_double.tokenizer` before use."""
import hashlib

import torch

import common


def generate_double(engine, model, prompt_ids, n, max_new_tokens, temperature, seed, device, dtype):
    tok = generate_double.tokenizer
    r = common.Rollouts([], [], [], [], engine.pad_id)
    for ids in prompt_ids:
        text = tok.decode(ids, skip_special_tokens=True)
        answer = sum(int(x) for x in text.rstrip("=").split("+"))
        for j in range(n):
            kind = hashlib.sha256(f"{text}/{j}".encode()).digest()[0] % 4
            toks = tok.convert_tokens_to_ids(list(str(answer + (0, 1, 2, 0)[kind]))) + [engine.eos_id]
            if kind == 3:  # unfinished: no EOS within the budget
                toks = tok.convert_tokens_to_ids(list("9" * max_new_tokens))
            r.prompt_ids.append(list(ids))
            r.completion_ids.append(toks[:max_new_tokens])
            r.finished.append(kind != 3)
    batch = common.make_batch(r.prompt_ids, r.completion_ids, r.pad_id, device)
    with torch.no_grad(), common.autocast(device, dtype):
        logp, _ = common.token_logprobs(model, batch, temperature)
    r.sampler_logprobs = [lp[m > 0].tolist() for lp, m in zip(logp.cpu(), batch["mask"].cpu())]
    return r
