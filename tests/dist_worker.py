"""Training runs on identical rollouts, for comparing N ranks with one (tests/test_distributed.py).

    python tests/dist_worker.py OUT RUNS_JSON                     # one process
    torchrun --nproc_per_node 2 tests/dist_worker.py OUT RUNS_JSON

RUNS_JSON is a list of {"name", "script", "argv"}; each run is a train_*.py main() called in turn in
this process. Generation is replaced by a deterministic double: the completions of a prompt depend on
the prompt's text alone (correct, off by one or two, or unfinished), so the global batch is the same
whatever the number of ranks and whichever rank samples it; the sampler's log-probs are the trainer's
own. Every gradient clip call (the policy's, then PPO's critic's) records the flattened gradient it is
given, before clipping, into OUT/<name>.rank<r>.pt.
"""
import hashlib
import importlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402

out_dir, runs = sys.argv[1], json.load(open(sys.argv[2]))
recorded = []


def generate_double(engine, model, prompt_ids, n, max_new_tokens, temperature, seed, device, dtype):
    inner = getattr(model, "module", model)
    tok = generate_double.tokenizer
    r = common.Rollouts([], [], [], [], engine.pad_id)
    for ids in prompt_ids:
        text = tok.decode(ids, skip_special_tokens=True)
        answer = sum(int(x) for x in text.rstrip("=").split("+"))
        for j in range(n):
            kind = hashlib.sha256(f"{text}/{j}".encode()).digest()[0] % 4
            digits = str(answer + (0, 1, 2, 0)[kind])
            toks = tok.convert_tokens_to_ids(list(digits)) + [engine.eos_id]
            if kind == 3:  # unfinished: no EOS within the budget
                toks = tok.convert_tokens_to_ids(list("9" * max_new_tokens))
            r.prompt_ids.append(list(ids))
            r.completion_ids.append(toks[:max_new_tokens])
            r.finished.append(kind != 3)
    batch = common.make_batch(r.prompt_ids, r.completion_ids, r.pad_id, device)
    with torch.no_grad(), common.autocast(device, dtype):
        logp, _ = common.token_logprobs(inner, batch, temperature)
    r.sampler_logprobs = [lp[m > 0].tolist() for lp, m in zip(logp.cpu(), batch["mask"].cpu())]
    return r


clip = torch.nn.utils.clip_grad_norm_


def recording_clip(parameters, *a, **k):
    params = list(parameters)
    recorded.append(torch.cat([common.full_tensor(p.grad if p.grad is not None else torch.zeros_like(p)).detach()
                               .flatten().cpu() for p in params]))  # FSDP2: each rank's shards, gathered
    return clip(params, *a, **k)


common.generate = generate_double
torch.nn.utils.clip_grad_norm_ = recording_clip
load_model = common.load_model


def load_model_double(*a, **k):  # the generation double decodes prompts with the run's tokenizer
    model, tok, path = load_model(*a, **k)
    generate_double.tokenizer = tok
    return model, tok, path


common.load_model = load_model_double
for spec in runs:
    recorded.clear()
    importlib.import_module(spec["script"]).main(["--out_dir", out_dir, "--run_name", spec["name"], "--wandb", "false",
                                                   "--engine", "hf", *spec["argv"]])
    torch.save(list(recorded), os.path.join(out_dir, f"{spec['name']}.rank{common.rank()}.pt"))
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
