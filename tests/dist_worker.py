"""Training runs on identical rollouts, for comparing N ranks with one (tests/test_distributed.py).

    python tests/dist_worker.py OUT RUNS_JSON                     # one process
    torchrun --nproc_per_node 2 tests/dist_worker.py OUT RUNS_JSON

RUNS_JSON is a list of {"name", "script", "argv"}; each run is a train_*.py main() called in turn in this
process. Generation is replaced by a deterministic double (tests/rollout_double.py): the completions of a
prompt depend on the prompt's text alone, so the global batch is the same whatever the number of ranks and
whichever rank samples it. Every gradient clip call (the policy's, then PPO's critic's) records the flattened
gradient it is given, before clipping, into OUT/<name>.rank<r>.pt. A run with "generate": after training, a
script's own common.generate calls (greedy, 2 per prompt) on the first 4, 3 and 1 held-out prompts, shared
out over the ranks (2 + 2, 2 + 1, 1 + none), and common.logprobs of a rollout batch on micro-batches of 1
(rank 0) and 64 (rank 1), gathered into OUT/<name>.generate.rank<r>.pt. A run with "uneven": on 2 ranks,
rank 0 trains on micro-batches of 1 (the update's micro-batch counts differ between the ranks). A run with
"prefixes": after training, the real HF engine (FSDP2's collective forwards) continues partial completions
of 3 held-out prompts (1 + 2 over 2 ranks): rank 0's only prefix is a whole completion, so it has nothing to
sample and joins rank 1's forwards on a stand-in, rank 1's cut to their first token; the completions, the
sampler's and the trainer's log-probs (common.logprobs), and the line each rank stops with when the last
rank's prefix is refused, go to OUT/<name>.prefixes.rank<r>.pt. Then
dist.top_share_threshold of fixed values split unevenly over the ranks (one rank may hold none) goes to
OUT/thresholds.rank<r>.json, common.cov_tokens of fixed completions split over the ranks to
OUT/cov_tokens.rank<r>.pt. A mixture of experts' MoE block parameters, whole and this rank's shard, go to
OUT/<name>.experts.rank<r>.json.
"""
import importlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
from rlmini import dist  # noqa: E402
from rlmini.engine import HFEngine  # noqa: E402
from rollout_double import generate_double  # noqa: E402

out_dir, runs = sys.argv[1], json.load(open(sys.argv[2]))
recorded = []


clip = torch.nn.utils.clip_grad_norm_


def recording_clip(parameters, *a, **k):
    params = list(parameters)
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    recorded.append(torch.cat([dist.full_tensor(g).detach().flatten().cpu() for g in grads]))  # FSDP2: whole
    return clip(params, *a, **k)


real_generate = HFEngine.generate
HFEngine.generate = generate_double
torch.nn.utils.clip_grad_norm_ = recording_clip
for spec in runs:
    recorded.clear()
    argv = ["--out_dir", out_dir, "--run_name", spec["name"], "--wandb", "false", "--engine", "hf"]
    uneven = spec.get("uneven") and int(os.environ.get("WORLD_SIZE", 1)) > 1 and os.environ["RANK"] == "0"
    own = ["--micro_batch_size", "1"] if uneven else []  # rank 0 more micro-batches than rank 1: no hang
    run = importlib.import_module(spec["script"]).main(argv + spec["argv"] + own)
    torch.save(list(recorded), os.path.join(out_dir, f"{spec['name']}.rank{dist.rank()}.pt"))
    experts = {n: [list(p.shape), list(getattr(p, "_local_tensor", p).shape)]  # whole, this rank's
               for n, p in run.model.named_parameters() if ".mlp." in n and "norm" not in n}
    if any(".experts." in n for n in experts):  # a mixture of experts: its MoE blocks', router included
        json.dump(experts, open(os.path.join(out_dir, f"{spec['name']}.experts.rank{dist.rank()}.json"), "w"))
    if spec.get("generate"):
        out = {}
        for k in (4, 3, 1):
            s = common.generate(run, dist.shard(run.task.test[:k]), 2, temperature=0)
            r = s.rollouts
            out[k] = [dist.all_gather_objects(x) for x in (s.rewards.tolist(), s.correct.tolist(),
                                                             r.completion_ids, r.policy_mask)]
            if k == 4:  # the same count on every rank: the tensors gather as the batch's do
                out["tensor"] = common.all_gather(s.rewards).tolist()
        # common.logprobs of a rollout batch: rank 0 a forward per completion, rank 1 one for all (equalised)
        batch = common.rollout(run)
        run.args.micro_batch_size = 1 if dist.rank() == 0 else 64
        out["logprobs"] = [dist.all_gather_objects([x.tolist() for x in lp])
                           for lp in (common.logprobs(run, batch, run.model), batch.sampler_logp)]
        out["logprobs"].append(dist.all_gather_objects(batch.rollouts.policy_mask))
        torch.save(out, os.path.join(out_dir, f"{spec['name']}.generate.rank{dist.rank()}.pt"))

    if spec.get("prefixes"):
        HFEngine.generate = real_generate
        rows = run.task.test[:3]
        mine = dist.shard(rows)
        whole = common.generate(run, mine, 1, seed=7).rollouts.completion_ids
        cut = [[t for t in c[:1] if t not in run.engine.eos_ids] for c in whole]  # a token, or none if EOS
        prefixes = [c if ex is rows[0] else first for ex, c, first in zip(mine, whole, cut)]
        s = common.generate(run, mine, 2, seed=8, prefixes=prefixes)
        batch = common.Batch(s.examples, s.rollouts, s.rewards, s.correct, s.fmt, None, 1, len(s), "",
                             torch.ones(len(s)))
        out = {"prefixes": prefixes, "ids": s.rollouts.completion_ids, "at": s.rollouts.prefix_lengths,
               "trainer": [x.tolist() for x in common.logprobs(run, batch, run.model)],
               "sampler": s.rollouts.sampler_logprobs, "finished": s.rollouts.finished}
        try:  # the last rank's prefix is refused: every rank stops, none waits in the engine's forwards
            last = dist.rank() == dist.world_size() - 1
            common.generate(run, rows[:1], 1, prefixes=[[10**9] if last else []])
        except ValueError as e:
            out["refused"] = str(e)
        torch.save(out, os.path.join(out_dir, f"{spec['name']}.prefixes.rank{dist.rank()}.pt"))
        HFEngine.generate = generate_double

values = torch.rand(1000, generator=torch.Generator().manual_seed(0)).round(decimals=2)  # ties too
cuts = {1: [(0, 1000)], 2: [(0, 300), (300, 1000)]}[dist.world_size()]
mine = values[slice(*cuts[dist.rank()])]
last = [values] if dist.rank() == dist.world_size() - 1 else []  # all on the last rank, none elsewhere
thresholds = {f"{share}/{case}": dist.top_share_threshold(parts, share) for share in (0.2, 0.37, 1.0, 1e-4)
              for case, parts in (("split", [mine[:50], mine[50:]]), ("one rank", last))}
json.dump(thresholds, open(os.path.join(out_dir, f"thresholds.rank{dist.rank()}.json"), "w"))


class Rows(list):  # what common.cov_tokens reads of a batch: its length, in_loss, kept
    pass


g = torch.Generator().manual_seed(1)  # 8 completions, 4 a rank on 2, the sixth not in the loss
logp = [torch.randn(int(n), generator=g) for n in torch.randint(1, 7, (8,), generator=g)]
adv, rows = torch.randn(8, generator=g), dist.local_slice(8 // dist.world_size())
part = Rows(range(8 // dist.world_size()))
part.in_loss, part.kept = torch.tensor([1.0] * 5 + [0.0] + [1.0] * 2)[rows], torch.ones(len(part))
run = type("Run", (), {"args": type("Args", (), {"seed": 3}), "step": 5})
chosen = {"top": common.cov_tokens(run, part, logp[rows], adv[rows], 0.3),
          "band": common.cov_tokens(run, part, logp[rows], adv[rows], 0.2, (-0.5, 0.5)),
          "equal": common.cov_tokens(run, part, logp[rows], torch.ones(len(part)), 0.3),  # Cov 0: all tied
          "tied": common.cov_tokens(run, part, [x.round() for x in logp[rows]], adv[rows].sign(), 0.3)}
torch.save({k: [x.tolist() for x in v] for k, v in chosen.items()},
           os.path.join(out_dir, f"cov_tokens.rank{dist.rank()}.pt"))
