"""A mixture of experts' routes: the experts each token was sent to in every MoE layer, captured where the
sampler ran (the HF engine's own forwards; vLLM's enable_return_routed_experts), and replayed in the
trainer's forward (--routing_replay: rollout routing replay, R3, Ma et al. 2025): the sampler's experts, with
the router's weights over them computed from the trainer's own router logits, so its gradient flows. The
share of routing decisions where the trainer's own top-k equals the sampler's is moe/route_agree.

The one hook point is the router module transformers 5 records as the model's router_logits
(`_can_record_outputs`, e.g. transformers/models/qwen3_moe/modeling_qwen3_moe.py::Qwen3MoeTopKRouter): its
forward returns (logits, top-k weights, top-k indices), the weights softmax(logits) at the top-k, renormalised
over them or not by family (Mixtral always, Qwen3-MoE and OLMoE by the router's norm_topk_prob). A forward
hook replaces the last two. A route is one int per (token position, MoE layer, k): [positions, layers, top_k],
uint8 up to 256 experts, positions 0..P+L-2 of prompt + completion (the last token is never fed to the
sampler: vllm/distributed/aux_output_connector/connector.py::AuxOutputSchedulerConnector.take_output,
token_end = num_tokens - 1)."""
import re
import sys

import torch

from rlmini import dist
from rlmini.packing import packing_enabled, unwrapped


def routers(model) -> list:
    """The router modules of `model` in layer order (the class its decoder records as router_logits), [] for
    a dense model or one whose router transformers does not record."""
    model = getattr(model, "policy", model)  # AdaptersOff (a LoRA policy's reference): its policy
    kinds = {getattr(rec, "target_class", None) for m in model.modules()
             for name, rec in (getattr(m, "_can_record_outputs", None) or {}).items()
             if name == "router_logits"}
    kinds.discard(None)
    return [m for m in model.modules() if kinds and isinstance(m, tuple(kinds))]


def experts(model) -> int:
    """The number of routed experts of a mixture-of-experts model (its config's), 0 for a dense one."""
    config = getattr(unwrapped(model), "config", None)
    return max([int(getattr(config, k, 0) or 0) for k in ("num_experts", "num_local_experts",
                                                          "n_routed_experts")])


def route_dtype(experts: int) -> torch.dtype:
    return torch.uint8 if experts <= 256 else torch.int16


def install(model, name: str) -> str:
    """Hook every router of `model` once (capture, replay, agreement); "" when done, else why its family's
    routes cannot be replayed (one line naming it). Each router's rule, renormalised over its top-k or not, is
    its own (norm_topk_prob; Mixtral always); a forward on 8 tokens checks it on every router: the router's
    weights must equal softmax(logits) at its indices under that rule (a router without one: under exactly
    one of the two)."""
    if installed(model):
        return ""
    found, base = routers(model), getattr(model, "policy", model)
    family = type(base).__name__
    if not found:
        return (f"--model {name}: {family} is a mixture of experts whose router transformers does not record "
                f"(no router_logits in _can_record_outputs): its routes cannot be captured or replayed")
    names = {id(m): name for name, m in base.named_modules()}
    numbers = [re.findall(r"\.(\d+)\.", f".{names[id(r)]}.") for r in found]  # model.layers.3.mlp.gate: 3
    state = {"routes": None, "replay": False, "captured": None, "agree": None, "valid": None, "replaced": 0,
             "renorm": [_declared(r) for r in found], "probed": [False] * len(found),
             "layers": len(found), "top_k": 0, "experts": 0,  # each router's decoder layer (vLLM's columns)
             "layer_ids": [int(x[0]) if x else None for x in numbers]}
    base._rlmini_routes = state
    for layer, r in enumerate(found):
        r.register_forward_hook(lambda module, args, out, layer=layer: _route(state, layer, out))
    with torch.no_grad():  # a whole forward (under FSDP2 a collective of every rank): its routers' weighing
        base(input_ids=torch.arange(2, 10, device=next(base.parameters()).device)[None], use_cache=False)
    dist.reshard(model)  # FSDP2 keeps the root gathered after a forward: sharded again before the optimizer
    why = next((x for x in state["renorm"] if isinstance(x, str)), None)
    if why is None and not all(state["probed"]):
        why = "was not called by a forward on 8 tokens"
    if why:  # its hooks stay, inert: no state to capture, compare or replay into
        del base._rlmini_routes
        return f"--model {name}: {family}'s router {why}: its routes cannot be replayed"
    return ""


def _declared(router):
    """A router's own rule: its norm_topk_prob (Qwen3-MoE, OLMoE, Qwen2-MoE); True for Mixtral's, which always
    renormalises (transformers/models/mixtral/modeling_mixtral.py::MixtralTopKRouter); else None (the probe
    decides)."""
    rule = getattr(router, "norm_topk_prob", None)
    if isinstance(rule, bool):
        return rule
    return True if type(router).__name__ == "MixtralTopKRouter" else None


def prepare(args, model) -> None:
    """At start: a mixture of experts' routers hooked (the HF engine returns routes, moe/route_agree is
    logged); --routing_replay on a dense model, or on a family whose routes cannot be replayed, refused in
    one line (without it, a note says moe/route_agree is not logged)."""
    if not experts(model):
        if args.routing_replay:
            family = type(getattr(model, "policy", model)).__name__
            raise SystemExit(f"--routing_replay: --model {args.model} ({family}) is not a mixture of "
                             f"experts: it has no routes to replay")
        return
    why = install(model, args.model)
    if why and args.routing_replay:
        raise SystemExit(f"--routing_replay: {why}")
    unnumbered = [k for k, x in enumerate(_state(model)["layer_ids"] if not why else []) if x is None]
    if unnumbered and args.routing_replay:  # vLLM returns a column per decoder layer: which is this router's
        raise SystemExit(f"--routing_replay: --model {args.model}: router {unnumbered[0]}'s module name has "
                         f"no layer number, so its decoder layer (vLLM's routes column) is unknown")
    if why:
        print(f"note: moe/route_agree is not logged: {why}", file=sys.stderr)


def layout(micro, replay: bool) -> dict:
    """A policy pass's micro-batch layout: with the sampler's routes, replayed (--routing_replay) or only
    compared with the trainer's own (moe/route_agree)."""
    if micro.routes is None:
        return micro.layout
    return {**micro.layout, "routes": micro.routes, "replay": replay}


def _weighing(state: dict, layer: int, out):
    """Checks a router's rule against its own output: True (renormalised over the top-k), False (the softmax
    itself), or why neither or both (a string): the declared rule must reproduce its weights; without one,
    exactly one rule must (a top-k mass of about 1 on the probe fits both)."""
    if not (isinstance(out, tuple) and len(out) == 3 and not out[2].is_floating_point()):
        return "does not return (logits, weights, indices)"
    logits, weights, index = out
    picked = logits.float().softmax(-1).gather(-1, index)
    state["top_k"], state["experts"] = index.shape[-1], logits.shape[-1]
    rules = {False: picked, True: picked / picked.sum(-1, keepdim=True)}
    fits = [renorm for renorm, w in rules.items()
            if torch.allclose(w.to(weights.dtype).float(), weights.float(), rtol=1e-2, atol=1e-6)]
    declared = state["renorm"][layer]
    if declared is not None:
        return declared if declared in fits else (f"{layer} weighs its experts otherwise than its "
                                                  f"norm_topk_prob={declared} says")
    if len(fits) == 1:
        return fits[0]
    if not fits:
        return f"{layer} weighs its experts otherwise than a softmax at the top-k, renormalised or not"
    return f"{layer} declares no norm_topk_prob and its probe fits both rules (top-k mass ~1)"


def _state(model):
    return getattr(getattr(model, "policy", model), "_rlmini_routes", None)


def installed(model) -> bool:
    return _state(model) is not None


def ask(engine) -> dict:
    """engine.generate's keyword asking for routes, where the engine's model has hooked routers (a sampler
    double or a dense model: none)."""
    return {"routes": True} if installed(getattr(engine, "model", None)) else {}


def _route(state: dict, layer: int, out):
    """The router's output, captured (the HF engine), compared with the sampler's routes, or replayed: the
    sampler's indices, weights softmax(logits) at them (fp32, as the families compute them), renormalised
    where the family renormalises, in the dtype of the router's own weights; positions without a route
    (padding, the last token) keep the router's own choice."""
    if not state["probed"][layer]:
        state["renorm"][layer], state["probed"][layer] = _weighing(state, layer, out), True
    if isinstance(state["renorm"][layer], str):
        return out
    logits, weights, own = out
    if state["captured"] is not None:
        state["captured"][layer].append(own.detach())
    routes = state["routes"]
    if routes is None:
        return out
    if routes.shape[0] != own.shape[0]:
        raise ValueError(f"routing replay: routes for {routes.shape[0]} token positions, the router saw "
                         f"{own.shape[0]} (the trainer's layout is not the one the routes were laid out for)")
    given = routes[:, layer].long()
    valid = given[:, 0] >= 0
    if state["agree"] is not None:  # moe/route_agree: the trainer's own top-k set against the sampler's
        same = (own.sort(-1).values == given.sort(-1).values).all(-1) & valid
        state["agree"] += same
        state["valid"] += valid
    if not state["replay"]:
        return out
    index = torch.where(valid[:, None], given, own)
    changed = (index.sort(-1).values != own.sort(-1).values).any(-1)
    state["replaced"] = state["replaced"] + changed.sum().detach()  # decisions replay overrode (no host sync)
    w = logits.float().softmax(-1).gather(-1, index)
    if state["renorm"][layer]:
        w = w / w.sum(-1, keepdim=True)
    return logits, w.to(weights.dtype), index.to(own.dtype)


def set_routes(model, routes, replay: bool = False, batch: dict | None = None) -> None:
    """The routes of the next forward's token positions ([b * width, layers, top_k] ints in the padded rows'
    places, -1 where none; None: the router's own), replayed or only compared (moe/route_agree); left in
    place for the backward's recomputation (gradient checkpointing) until the next call. A packed forward
    (`batch`'s packed layout, when the model packs) takes them in its own token order, a shared prompt's from
    the first of its rows that has routes (a continued prefix with nothing sampled has none). A model without
    routers: nothing."""
    state = _state(model)
    if state is None:
        return
    packed = batch.get("packed") if batch and routes is not None and packing_enabled(model) else None
    packed = packed["places"]() if packed else None  # packing.py::_padded_places
    state["unpack"] = packed["packed_at"] if packed else None  # agreement(): back to the padded places
    if packed:
        owner, prompt_of, at = packed["owner"], packed["prompt_of"], packed["padded_at"].clone()
        b, m = len(owner), len(prompt_of)
        width = routes.shape[0] // b
        has = routes.view(b, width, -1)[:, 0, 0] >= 0  # a row's routes start at its prompt's first token
        key = torch.arange(b, device=owner.device) + b * (~has).long()  # rows with routes first, in order
        best = key.new_full((int(owner.max()) + 1,), 2 * b).scatter_reduce_(0, owner, key, "amin") % b
        at[:m] = best[prompt_of] * width + at[:m] % width
        routes = routes[at]
    state["routes"], state["replay"], state["captured"] = routes, replay and routes is not None, None
    n = routes.shape[0] if routes is not None else 0
    state["agree"] = routes.new_zeros(n, dtype=torch.float32) if routes is not None else None
    state["valid"] = routes.new_zeros(n, dtype=torch.float32) if routes is not None else None


def agreement(model, mask) -> tuple | None:
    """(routing decisions that agree, routing decisions) over the completion tokens of `mask` [b, T-1] in the
    forward just run (position t predicts token t + 1, so its routes are those of position t), as tensors;
    (0, 0) without routes (every rank adds the keys: check_sampler's all_sum); None for a model without hooked
    routers."""
    state = _state(model)
    if state is None:
        return None
    if state["agree"] is None:
        zero = mask.new_zeros((), dtype=torch.float32)
        return zero, zero.clone()
    b, width = mask.shape[0], mask.shape[1] + 1
    agree, valid = state["agree"], state["valid"]
    if state.get("unpack") is not None:  # a packed forward: each padded place's packed token
        at = state["unpack"]
        agree, valid = (torch.where(at >= 0, x[at.clamp(min=0)], 0) for x in (agree, valid))
    agree, valid = agree.view(b, width)[:, :-1], valid.view(b, width)[:, :-1]
    return (agree * mask).sum(), (valid * mask).sum()


def capture(model, on: bool = True):
    """on: from now every forward's router outputs are kept, and the function returned gives each forward's
    [tokens, layers, top_k] (route_dtype), in call order (None: `model` has no hooked routers); no replay
    meanwhile. off: none kept (set_routes also ends a capture, one a generate that raised left open)."""
    state = _state(model)
    if state is None:
        return None
    state["routes"], state["agree"], state["valid"] = None, None, None
    state["captured"] = [[] for _ in range(state["layers"])] if on else None
    dtype = route_dtype(state["experts"])

    def take() -> torch.Tensor:
        return torch.stack([x.pop(0) for x in state["captured"]], 1).to(dtype)  # [tokens, layers, top_k]
    return take if on else None


def padded(routes: list, rows: list, width: int, device, model) -> torch.Tensor:
    """Completions `rows`' routes ([P + L - 1, layers, top_k] each, or None) laid out like the trainer's
    padded rows (packing.make_batch: prompt + completion, right-padded to `width`) -> [b * width, layers,
    top_k] int16, -1 where there is none (padding, the last token, a completion without routes: all of a
    rank's may lack them, its forward's collectives the same as the others')."""
    state = _state(model)
    shape = (state["layers"], state["top_k"])
    out = torch.full((len(rows), width, *shape), -1, dtype=torch.int16)
    for j, i in enumerate(rows):
        if routes[i] is not None:
            out[j, :len(routes[i])] = routes[i].to(torch.int16)
    return out.view(-1, *shape).to(device)


def from_vllm(completion, prompt_len: int, length: int, model) -> torch.Tensor:
    """A vLLM CompletionOutput's routes as ours (`model`: the trainer's, hooked). vllm/outputs.py::
    CompletionOutput.routed_experts is [seq_len, layer_num, topk] (numpy, uint8/uint16/int32), one row per
    fed position from SamplingParams.routed_experts_prompt_start (0 here) to num_tokens - 1
    (vllm/distributed/aux_output_connector/connector.py::take_output), so P + L - 1 rows, and one column per
    decoder layer, dense ones included (vllm/model_executor/layers/fused_moe/routed_experts_capturer.py::
    _get_routed_experts_shape: get_total_num_hidden_layers): the MoE layers' columns are ours."""
    state = _state(model)
    got = getattr(completion, "routed_experts", None)
    if got is None:
        raise ValueError("--routing_replay: vLLM returned no routed_experts for a completion (its engine was "
                         "not started with enable_return_routed_experts?)")
    if got.shape[0] != prompt_len + length - 1:
        raise ValueError(f"--routing_replay: vLLM returned routes for {got.shape[0]} positions, expected "
                         f"prompt {prompt_len} + completion {length} - 1")
    if got.shape[1] <= max(state["layer_ids"]):
        raise ValueError(f"--routing_replay: vLLM returned routes for {got.shape[1]} layers, the model's MoE "
                         f"layers are {state['layer_ids']}")
    return torch.from_numpy(got[:, state["layer_ids"]].astype("int64")).to(route_dtype(state["experts"]))
