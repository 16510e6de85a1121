"""The newer losses of docs/algorithms.md against the peers' own functions, on random inputs: each worked
example's script built from the page (tests/test_siblings.py::worked_example), its `policy_loss` and
aggregation, against verl's `core_algos.py` function or TRL's `GRPOTrainer._compute_loss` (called on a
stand-in trainer holding only what the loss reads), where the peer imports. Prints a Markdown table: the
loss of each side and the largest gradient difference in log pi over the gradient's norm.

    python benchmarks/peer_losses.py                          # the peers importable in this Python

or the peers (as of docs/algorithms.md's numbers) in folders apart from this Python's packages, and ray, which
verl's core_algos.py imports but no row runs, replaced by an in-process stand-in (--stub_ray):

    pip install --no-deps --target /tmp/peers verl==0.9.1 trl==1.16.0
    pip install --no-deps --target /tmp/peers/deps omegaconf==2.4.0 antlr4-python3-runtime==4.9.3 \
        tensordict==0.15.3 codetiming==1.4.0 cloudpickle==3.1.3 orjson==3.13.0 pyvers==0.2.3
    python benchmarks/peer_losses.py --path /tmp/peers/deps --path /tmp/peers --stub_ray --seed 0

The rows: GMPO (verl `geo_mean`, TRL's experimental GMPOTrainer); Clip-Cov on-policy (verl `clip_cov`,
every token of the band chosen, share 1: verl's random draw of r N tokens, its rounding down and its
exclusion of PPO-clipped tokens, none on-policy, are not compared, only the band, the cut and the loss);
KL-Cov (verl `kl_cov`, the tokens chosen
by common.cov_tokens from the current log-probs as verl does; the scripts choose from pi_old, the same
on-policy); LUSPO (TRL `luspo`, ours through the script's own aggregation line), VESPO, SAPO (TRL `vespo`,
`sapo`); TRL `bnpo` against `--loss_agg token-mean`
in one micro-batch and in three, where TRL normalises each micro-batch by its own tokens.
"""
import argparse
import importlib
import os
import sys
import tempfile
from collections import defaultdict
from types import SimpleNamespace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
import common  # noqa: E402


def built(name: str, folder: str):
    """train_<name>.py as docs/algorithms.md writes it (into `folder`), imported."""
    from pathlib import Path
    from test_siblings import worked_example
    worked_example(name, Path(folder))
    sys.path.insert(0, folder)
    return importlib.import_module(f"train_{name}")


RAY_STUB = """# a stand-in for ray (benchmarks/peer_losses.py --stub_ray): verl imports it, no row runs it
def __getattr__(name):
    return type(name, (), {})
"""


def inputs(seed: int, b: int = 6, t: int = 8, spread: float = 0.3):
    """log pi (with a gradient), log pi_old, one advantage per completion, a mask of ragged lengths."""
    g = torch.Generator().manual_seed(seed)
    logp = (torch.randn(b, t, generator=g) * 0.7 - 1.5).double()
    old = logp + torch.randn(b, t, generator=g).double() * spread
    adv = torch.randn(b, generator=g).double()
    lengths = torch.randint(2, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None] < lengths[:, None]).double()
    return logp.requires_grad_(), old, adv, mask


def grad_of(loss_fn, logp):
    x = logp.detach().clone().requires_grad_()
    loss = loss_fn(x)
    (g,) = torch.autograd.grad(loss, x)
    return loss.item(), g


def row(name, peer, ours_fn, peer_fn, logp, mask):
    a, ga = grad_of(ours_fn, logp)
    b, gb = grad_of(peer_fn, logp)
    rel = ((ga - gb) * mask).abs().max().item() / max((gb * mask).norm().item(), 1e-30)
    return f"| {name} | {peer} | {a:.10f} | {b:.10f} | {abs(a - b):.2e} | {rel:.2e} |"


def trl_loss(loss_type: str, logp, old, adv, mask, micro: int = 1, trainer=None, **extra):
    """TRL's GRPOTrainer._compute_loss on a stand-in trainer: the log-probs given, no KL, no entropy terms;
    the batch split into `micro` micro-batches of one optimizer step, their losses summed (as TRL
    accumulates them). `trainer`: another class whose _compute_loss to call (TRL's experimental GMPO)."""
    from trl.trainer.grpo_trainer import GRPOTrainer
    total, rows = 0.0, torch.arange(len(adv)).chunk(micro)
    for r in rows:
        args = SimpleNamespace(delta=None, steps_per_generation=1, sapo_temperature_pos=1.0,
                               sapo_temperature_neg=1.05, vespo_k_pos=2.0, vespo_lambda_pos=3.0,
                               vespo_k_neg=3.0, vespo_lambda_neg=2.0)
        fake = SimpleNamespace(**{
            "_get_per_token_logps_and_entropies": lambda *a, r=r, **k: (logp[r], 0 * logp[r], None),
            "top_entropy_quantile": 1.0, "off_policy_mask_threshold": None, "beta": 0.0,
            "loss_type": loss_type,
            "epsilon_low": 0.2, "epsilon_high": 0.2, "args": args, "use_vllm": False,
            "model": SimpleNamespace(training=True), "importance_sampling_level": "token",
            "current_gradient_accumulation_steps": micro, "_entropy_bonus_enabled": False,
            "aux_loss_enabled": False, "_metrics": defaultdict(lambda: defaultdict(list)),
            "accelerator": SimpleNamespace(gather=lambda x: x, reduce=lambda x, reduction: x, num_processes=1,
                                           gather_for_metrics=lambda x: x),
            "get_gamma_weights": GRPOTrainer.get_gamma_weights, **extra})
        n = mask[r].shape[1]
        batch = {"prompt_ids": torch.zeros(len(r), 1, dtype=torch.long), "prompt_mask": torch.ones(len(r), 1),
                 "completion_ids": torch.zeros(len(r), n, dtype=torch.long), "completion_mask": mask[r],
                 "advantages": adv[r], "old_per_token_logps": old[r],
                 "num_items_in_batch": mask.sum()}  # the whole step's tokens (TRL's dapo, vespo)
        total = total + (trainer or GRPOTrainer)._compute_loss(fake, None, batch)
    return total


def verl_config(**policy_loss):
    return SimpleNamespace(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, global_batch_info={},
                           policy_loss=SimpleNamespace(**policy_loss))


class Rows(SimpleNamespace):  # what common.cov_tokens reads of a batch
    def __len__(self):
        return len(self.kept)


def ragged(x, mask):
    return [x[i, :int(mask[i].sum())].detach() for i in range(len(x))]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--path", action="append", default=[], help="a folder to import the peers from")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stub_ray", action="store_true", help="a stand-in module for ray (verl imports it)")
    a = p.parse_args()
    sys.path[:0] = a.path
    if a.stub_ray:  # verl's core_algos.py imports ray, no row calls it: a package of bare classes
        stub = tempfile.TemporaryDirectory()  # removed when the script ends
        os.makedirs(os.path.join(stub.name, "ray"))
        with open(os.path.join(stub.name, "ray", "__init__.py"), "w") as f:
            f.write(RAY_STUB)
        sys.path.insert(0, stub.name)
    try:
        from verl.trainer.ppo import core_algos as verl
    except Exception as e:  # verl or one of its dependencies missing
        verl = None
        print(f"verl: not importable ({type(e).__name__}: {e}); its rows are left out")
    try:
        import trl
        from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: F401
    except Exception as e:
        trl = None
        print(f"TRL: not importable ({type(e).__name__}: {e}); its rows are left out")
    out = ["| loss | peer | ours | peer's | loss difference | grad difference / norm |",
           "|---|---|---|---|---|---|"]
    run = SimpleNamespace(args=SimpleNamespace(seed=0), step=0)
    with tempfile.TemporaryDirectory() as folder:
        scripts = {n: built(n, folder) for n in ("gmpo", "clipcov", "klcov", "luspo", "vespo", "sapo")}
        logp, old, adv, mask = inputs(a.seed)
        B, N = len(adv), mask.sum()
        per_token = adv[:, None].expand_as(mask)

        def agg(token_loss, how):
            return common.aggregate(token_loss, mask, how, B, N, mask.shape[1])

        def padded(chosen):  # common.cov_tokens' ragged 0/1 tensors -> [B, T]
            x = torch.zeros_like(mask)
            for i, c in enumerate(chosen):
                x[i, :len(c)] = c
            return x
        if verl is not None:
            m = scripts["gmpo"]
            args, config = m.Args(clip_eps=0.4), SimpleNamespace(clip_ratio=0.4, clip_ratio_low=None,
                                                                 clip_ratio_high=None)
            out.append(row("GMPO", "verl geo_mean",
                           lambda x: agg(m.policy_loss(x, old, None, adv, mask, args)[0],
                                         "seq-mean-token-mean"),
                           lambda x: verl.compute_policy_loss_geo_mean(old, x, per_token, mask,
                                                                       config=config)[0], logp, mask))
            m, batch = scripts["clipcov"], Rows(in_loss=torch.ones(B), kept=torch.ones(B))
            args, band = m.Args(), (0.05, 3.0)
            on = old.clone().requires_grad_()  # on-policy: pi = pi_old
            cut = padded(common.cov_tokens(run, batch, ragged(old, mask), adv, 1.0, band))  # the whole band
            config = verl_config(clip_cov_ratio=1.0, clip_cov_lb=band[0], clip_cov_ub=band[1])
            out.append(row(f"Clip-Cov ({int(cut.sum())} of {int(N)} tokens cut)", "verl clip_cov",
                           lambda x: agg(m.policy_loss(x, old, None, adv, mask, args, None, cut)[0],
                                         "token-mean"),
                           lambda x: verl.compute_policy_loss_clip_cov(old, x, per_token, mask,
                                                                       config=config)[0], on, mask))
            m, k = scripts["klcov"], int(0.2 * N)  # a whole share: verl rounds r N down, common.cov_tokens up
            share = k / N.item() + 1e-12
            args, config = m.Args(kl_cov_ratio=share, kl_cov_coef=1.0), verl_config(kl_cov_ratio=share,
                                                                                    ppo_kl_coef=1.0)
            top = padded(common.cov_tokens(run, batch, ragged(logp, mask), adv, share))  # from pi, as verl's
            out.append(row(f"KL-Cov ({int(top.sum())} of {int(N)} tokens)", "verl kl_cov",
                           lambda x: agg(m.policy_loss(x, old, None, adv, mask, args, None, top)[0],
                                         "token-mean"),
                           lambda x: verl.compute_policy_loss_kl_cov(old, x, per_token, mask,
                                                                     config=config)[0], logp, mask))
        if trl is not None:
            peer = f"TRL {trl.__version__}"
            m = scripts["luspo"]
            args = m.Args()
            line = next(x for x in open(m.__file__) if "LUSPO eq. 7" in x)  # the docs' aggregation line
            luspo = line.split("=", 1)[1].split("#")[0].strip()  # (token_loss * micro.loss_mask).sum() / ...
            out.append(row("LUSPO", f"{peer} luspo",
                           lambda x: eval(luspo, {}, {"token_loss": m.policy_loss(x, old, None, adv, mask,
                                                                                  args)[0],
                                                      "micro": SimpleNamespace(loss_mask=mask),
                                                      "mb": SimpleNamespace(n_seqs=B)}),
                           lambda x: trl_loss("luspo", x, old, adv, mask,
                                              importance_sampling_level="sequence"), logp, mask))
            from trl.experimental.gmpo import GMPOTrainer
            m = scripts["gmpo"]
            args = m.Args(clip_eps=0.4)
            out.append(row("GMPO", f"{peer} experimental.gmpo",
                           lambda x: agg(m.policy_loss(x, old, None, adv, mask, args)[0],
                                         "seq-mean-token-mean"),
                           lambda x: trl_loss("gmpo", x, old, adv, mask, trainer=GMPOTrainer, epsilon_low=0.4,
                                              epsilon_high=0.4), logp, mask))
            for name, how, args in (("vespo", "token-mean", scripts["vespo"].Args()),
                                    ("sapo", "seq-mean-token-mean", scripts["sapo"].Args(surrogate="sapo"))):
                ours = lambda x, m=scripts[name], how=how, args=args: agg(  # noqa: E731
                    m.policy_loss(x, old, None, adv, mask, args)[0], how)
                out.append(row(name.upper(), f"{peer} {name}", ours,
                               lambda x, name=name: trl_loss(name, x, old, adv, mask), logp, mask))
            import train_grpo
            args = train_grpo.Args()
            for micro in (1, 3):
                tokens = "+".join(str(int(mask[r].sum())) for r in torch.arange(B).chunk(micro))
                out.append(row(f"--loss_agg token-mean, tokens {tokens}", f"{peer} bnpo",
                               lambda x: agg(train_grpo.policy_loss(x, old, None, adv, mask, args)[0],
                                             "token-mean"),
                               lambda x, k=micro: trl_loss("bnpo", x, old, adv, mask, micro=k), logp, mask))
    print("\n".join(out))


if __name__ == "__main__":
    main()
