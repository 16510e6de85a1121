"""What flows through a step: the rollout batch (whole groups, scored), what the pre-update pass computed, and
the minibatches and micro-batches of the update, laid out for the trainer."""
import itertools
from dataclasses import dataclass, replace

import torch

from rlmini import moe
from rlmini.data import Rollouts
from rlmini.dist import all_gather, local_slice, reshard_frozen, world_size
from rlmini.logprobs import to_padded, to_ragged, token_logprobs
from rlmini.models import autocast
from rlmini.packing import make_batch, padded_tokens


@dataclass
class Keep:
    """Which groups a step trains on: those whose `on` values ("correct" or "rewards") differ, since the
    others carry no advantage. New prompts are sampled until every rank's batch is full or, with `min_valid`,
    until that many groups (all ranks) were kept, for at most `max_rounds` rounds; then the batch is topped up
    with the last round's other groups. DAPO's dynamic sampling (Yu et al. 2025, sec. 3.2); GPG's beta_th
    rule."""
    on: str = "correct"
    max_rounds: int = 20
    min_valid: float | None = None


@dataclass
class Scored:
    """What common.generate returns, this rank's: n completions of each prompt (grouped by prompt), scored and
    shaped as training rollouts are."""
    examples: list          # one per prompt
    rollouts: Rollouts
    rewards: torch.Tensor   # the task's reward + --format_weight x format + the overlong penalty
    correct: torch.Tensor
    fmt: torch.Tensor
    parts: torch.Tensor     # [completions, --reward functions]: each function's unweighted value
    scores: list            # each completion's rewards.Score (its extracted answer, its probability, ...)

    def __len__(self):
        return len(self.rollouts.completion_ids)


@dataclass
class Batch:
    """This rank's share of a step's rollouts: whole groups of G completions, scored."""
    examples: list
    rollouts: Rollouts
    rewards: torch.Tensor   # the task's reward + --format_weight x format + the overlong penalty
    correct: torch.Tensor
    fmt: torch.Tensor
    first: tuple            # (rewards, correct, format, --reward parts) of the first round: the policy's
    rounds: int             # sampling rounds (Keep)
    generated: int          # completions sampled over every round
    spread_on: str          # the values whose spread decides a group ("correct", "rewards"; "" without Keep)
    in_loss: torch.Tensor   # 1 for a completion in the loss, 0 for one cut by the limit (--mask_truncated)
    pushes: int | None = None  # --engine server: the weight pushes made when the batch is trained on
    kept: torch.Tensor | None = None  # 1 for a completion the update computes, 0 for one a filter dropped
    filtered: bool = False  # a filter (common.keep_completions) chose `kept`: the filter/* metrics
    empty_updates: int = 0  # minibatches the filter left empty on every rank: no step (common.minibatches)

    def __post_init__(self):
        """lengths and sampler_logp count the policy's tokens only (with tools, their output is context)."""
        r = self.rollouts
        if self.kept is None:
            self.kept = torch.ones(len(r.completion_ids))
        masks = r.policy_mask or [None] * len(r.completion_ids)
        self.lengths = torch.tensor([len(c) if m is None else sum(m)
                                     for c, m in zip(r.completion_ids, masks)], dtype=torch.float32)
        # pushes since each completion was sampled (--async_steps; 0 for an in-process engine)
        versions = r.versions if r.versions is not None and self.pushes is not None else []
        self.staleness = torch.tensor([self.pushes - v for v in versions] or [0] * len(r.completion_ids),
                                      dtype=torch.float32)
        self.sampler_logp = [torch.tensor(lp if m is None else [x for x, keep in zip(lp, m) if keep],
                                          dtype=torch.float32) for lp, m in zip(r.sampler_logprobs, masks)]

    def __len__(self):
        return len(self.rollouts.completion_ids)


@dataclass
class Micro:
    """Completions `rows` of the batch, laid out for the trainer (packing.make_batch)."""
    rows: list
    epoch: int              # the pass over the batch (--updates_per_rollout) it belongs to
    layout: dict
    loss_mask: torch.Tensor  # the completion tokens in the loss (the policy's, never a tool's)
    sampler_logp: torch.Tensor
    computed: int           # token positions the forward computes ...
    padded: int             # ... and how many of them are padding (perf/pad_frac)
    size: int = 0           # completions in this rank's batch (advantages: this rank's or the global batch's)
    idle: bool = False      # torchrun: a repeat that keeps this rank in step, every mask zero (Minibatch)
    groups: torch.Tensor | None = None  # whole groups (common.minibatches): each row's group, 0, 0, 1, ...
    routes: torch.Tensor | None = None  # a mixture of experts: the sampler's routes (rlmini/moe.py::padded)
    route_agree: tuple | None = None  # the first pass's (agreeing, all) routing decisions (moe.agreement)

    @property
    def mask(self):
        return torch.zeros_like(self.layout["mask"]) if self.idle else self.layout["mask"]

    def per_token(self, ragged: list) -> torch.Tensor:
        """Per-completion 1-D tensors of the whole batch -> [b, T-1] for these rows."""
        return to_padded(ragged, self.rows, self.layout["mask"])

    def per_seq(self, values: torch.Tensor) -> torch.Tensor:
        """One value per completion of the batch -> these rows', on the trainer's device."""
        return values[self.rows].to(self.mask.device)

    def per_group(self, values: torch.Tensor) -> torch.Tensor:
        """Whole groups only: one value per row [b] -> the sum over each group's rows [g], in the order of
        `groups` (a loss over pairs or groups: the group's rows are all here)."""
        if self.groups is None:
            raise ValueError("Micro.per_group: this micro-batch may split a group; iterate "
                             "common.minibatches(run, batch, whole_groups=True)")
        out = values.new_zeros(int(self.groups.max()) + 1 if len(self.groups) else 0)
        return out.index_add(0, self.groups.to(values.device), values)

    @property
    def in_loss(self) -> torch.Tensor:
        """[b]: 1 for a row with a token in the loss, 0 for one without (--mask_truncated, an idle repeat)."""
        return (self.loss_mask.sum(1) > 0).to(self.loss_mask.dtype)

    def advantages(self, adv) -> torch.Tensor:
        """These rows' advantages, broadcastable against [b, T-1]: per token (a ragged list like
        batch.sampler_logp, this rank's completions) -> [b, T-1]; per completion (1-D, this rank's batch or
        the global batch, all_gather's order) -> [b, 1]. A loss takes either with `adv = advantages`."""
        if isinstance(adv, (list, tuple)):
            return self.per_token(adv)
        mine = this_ranks(adv, self.size)
        if mine is None:
            raise ValueError(f"Micro.advantages: {len(adv)} advantages for {self.size} completions per rank "
                             f"({world_size()} ranks): give one per completion or a list per token")
        return self.per_seq(mine).unsqueeze(1)


def this_ranks(values, n: int):
    """One value per completion, of this rank's n or of the global batch (all_gather's order) -> this rank's
    n (dist.local_slice); None for any other length."""
    if len(values) == n * world_size() != n:  # the global batch: this rank's block
        return values[local_slice(n)]
    return values if len(values) == n else None


def micro_batch(batch: Batch, rows: list, model, device, epoch: int = 0, group_size: int = 0) -> Micro:
    r = batch.rollouts
    prompts, completions = [r.prompt_ids[i] for i in rows], [r.completion_ids[i] for i in rows]
    layout = make_batch(prompts, completions, r.pad_id, device,
                        policy=[r.policy_mask[i] for i in rows] if r.policy_mask else None)
    mask = layout["mask"]
    loss_mask = mask * batch.in_loss[rows].unsqueeze(1).to(device)
    groups = torch.unique_consecutive(torch.tensor(rows) // group_size, return_inverse=True)[1] \
        if group_size else None
    routes = (moe.padded(r.routes, rows, layout["input_ids"].shape[1], device)
              if r.routes is not None and any(x is not None for x in r.routes) else None)
    return Micro(rows, epoch, layout, loss_mask, to_padded(batch.sampler_logp, rows, mask),
                 *padded_tokens(layout, model), size=len(batch), groups=groups, routes=routes)


@torch.no_grad()
def ragged_pass(batch: Batch, forward, max_seqs: int, max_tokens: int, model, device, wanted=()) -> dict:
    """`forward(micro)` -> {name: [b, T-1] values} over this rank's kept completions (batch.kept) in
    micro-batches (update_schedule), without gradient -> {name: one CPU 1-D tensor per completion, laid out
    like batch.sampler_logp} (a None value is left out); a dropped completion's are zeros, never computed,
    and so are all of a name in `wanted` when nothing was computed (every completion dropped).
    Under torchrun every rank runs as many micro-batches, a rank with fewer repeating one and dropping what
    it gives: a FSDP2-sharded model's forward is a collective of every rank."""
    out = {name: [None] * len(batch) for name in wanted}
    for rows, idle in update_schedule(batch, list(range(len(batch))), max_seqs, max_tokens):
        micro = micro_batch(batch, rows, model, device)
        values = forward(micro)
        for name, v in values.items() if not idle else ():
            if v is not None:  # one copy to the host per micro-batch, then split there (no sync per row)
                got = out.setdefault(name, [None] * len(batch))
                for i, x in zip(rows, to_ragged(v.detach().cpu(), micro.mask.cpu())):
                    got[i] = x
    for got in out.values():  # dropped completions: zeros of their length, so the lists stay aligned
        for i in (i for i, x in enumerate(got) if x is None):
            got[i] = torch.zeros(int(batch.lengths[i]), dtype=torch.float32)
    return out


def batch_logprobs(batch: Batch, model, temperature: float, max_seqs: int, max_tokens: int, device,
                   dtype) -> list:
    """log model(token) at `temperature` of each policy token of this rank's completions, without gradient:
    one fp32 CPU 1-D tensor per completion, aligned with batch.sampler_logp (with --tools a tool's output is
    context, not a target: make_batch's `policy`), packed and micro-batched as the update is, under autocast
    in `dtype`. Every rank calls it (ragged_pass)."""
    def forward(micro):
        with autocast(device, dtype):
            return {"logp": token_logprobs(model, micro.layout, temperature)[0]}
    out = ragged_pass(batch, forward, max_seqs, max_tokens, model, device, wanted=("logp",))["logp"]
    reshard_frozen(model)  # a frozen model's root is not left gathered until its next pass
    return out


@dataclass
class Minibatch:
    """One optimizer step's completions (whole groups); iterating it yields its micro-batches. The loss
    normalisers count the completions and tokens in the loss over all ranks, divided by the number of ranks
    since FSDP2 averages gradients over ranks."""
    batch: Batch
    rows: list
    epoch: int
    n_seqs: float
    n_tokens: float
    micro_batch_size: int
    micro_batch_tokens: int
    model: object
    device: torch.device
    n_groups: float = 1.0   # the groups with a completion in the loss, over all ranks / ranks (as n_seqs)
    group_size: int = 0     # whole groups: no micro-batch splits a group of this size (0: cut anywhere)

    def __iter__(self):
        """Its kept completions' micro-batches (update_schedule): under torchrun every rank yields as many
        (FSDP2's forward and backward are collectives), a rank with fewer repeating its last one, and a rank
        with none one of its rows, with every mask zero, so its loss, gradient and statistics add nothing."""
        schedule = update_schedule(self.batch, self.rows, self.micro_batch_size, self.micro_batch_tokens,
                                   self.group_size)
        for rows, idle in schedule:
            micro = micro_batch(self.batch, rows, self.model, self.device, self.epoch, self.group_size)
            if idle:
                micro = replace(micro, loss_mask=torch.zeros_like(micro.loss_mask), computed=0, padded=0,
                                idle=True)
            yield micro


def most_micro_batches(rows: list) -> int:
    """The most micro-batches any rank has (this rank's `rows`, a list of micro-batches)."""
    return int(all_gather(torch.tensor([len(rows)])).max()) if world_size() > 1 else len(rows)


def update_schedule(batch: Batch, rows: list, max_seqs: int, max_tokens: int = 0, group_size: int = 0):
    """Yields (a micro-batch's rows, idle): the kept of `rows` (batch.kept) cut into micro-batches
    (micro_rows; whole groups of `group_size` if given), as many as any rank has (most_micro_batches): past
    its own, a rank repeats its last one, or with none kept the first of `rows`, idle (the caller drops what
    it computes). Dropped rows cost nothing."""
    kept = batch.kept.tolist()  # one copy, not a tensor index per row (thousands of rows a step)
    cut = micro_rows(batch, [i for i in rows if kept[i]], max_seqs, max_tokens, group_size)
    for k in range(most_micro_batches(cut)):
        yield (cut[min(k, len(cut) - 1)] if cut else rows[:1]), k >= len(cut)


def micro_rows(batch: Batch, rows: list, max_seqs: int, max_tokens: int = 0, group_size: int = 0) -> list:
    """`rows` cut in order into micro-batches of at most max_seqs completions and, when max_tokens > 0, at
    most max_tokens prompt+completion tokens (a longer completion goes alone): at 4k-token completions a
    micro-batch of 64 sequences would be 256k tokens. Each prompt is counted with each of its completions
    (what padded rows compute; packing computes less). With `group_size`, the cuts fall between groups only
    (row // group_size): a group is never split, and one over the budget is a micro-batch of its own."""
    r = batch.rollouts
    units = [[i] for i in rows]
    if group_size:  # the rows of each group, consecutive in `rows` (group_permutation keeps them so)
        units = [list(g) for _, g in itertools.groupby(rows, lambda i: i // group_size)]
    out, current, tokens = [], [], 0
    for unit in units:
        n = sum(len(r.prompt_ids[i]) + len(r.completion_ids[i]) for i in unit)
        if current and (len(current) + len(unit) > max_seqs or (max_tokens and tokens + n > max_tokens)):
            out.append(current)
            current, tokens = [], 0
        current += unit
        tokens += n
    return out + [current] if current else out


def group_permutation(n: int, group_size: int, generator) -> torch.Tensor:
    """A random order of n completions that keeps each group of `group_size` together, in order."""
    groups = torch.randperm(n // group_size, generator=generator)
    return (groups[:, None] * group_size + torch.arange(group_size)).flatten()


@dataclass
class PreUpdate:
    """What the update needs from before it, per completion (ragged lists on the CPU, laid out like
    batch.sampler_logp: ragged_pass): pi_old, the reference's log-probs, entropies and values."""
    on_policy: bool         # pi_old is the update's own first forward (detached)
    old: list
    ref: list | None        # None: no reference model
    entropy: list
    values: list
    tau: float = float("nan")  # --top_entropy_quantile: the entropy threshold over the global batch

    def old_logp(self, micro: Micro, logp: torch.Tensor) -> torch.Tensor:
        return logp.detach() if self.on_policy else micro.per_token(self.old)

    def ref_logp(self, micro: Micro):
        return micro.per_token(self.ref) if self.ref is not None else None
