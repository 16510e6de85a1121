"""python tests/vllm_family_worker.py OUT FAMILY...: for each family, a random model of it (head_dim 64, which
vLLM's CPU kernels take; the built-in tokenizer) in vLLM next to the trainer's copy: the sampler's log-probs
against the trainer's on what vLLM sampled, then a weight change pushed and the push check. One JSON line per
family in OUT (vLLM engines are process-wide, so the test runs this in its own process)."""
import gc
import json
import os
import sys
import time

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402
import rewards  # noqa: E402
import test_architectures as archs  # noqa: E402
from rlmini import engine, logprobs, models, packing  # noqa: E402


def check(family: str, folder: str, tokenizer) -> dict:
    cls, kw = archs.FAMILIES[family]
    kw = {**kw, **({"head_dim": 64} if "head_dim" in kw else {})}
    config = getattr(transformers, cls)(**{**archs.BASE, **kw, "hidden_size": 128, "num_attention_heads": 2,
                                           "intermediate_size": 256, "vocab_size": len(tokenizer)})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    logprobs.check_output_head(model, family)
    models.prepare_for_training(model, gradient_checkpointing=False, packing=True)
    sampler = engine.make_engine(common.Args(engine="vllm", seed=0), folder, model, tokenizer,
                                 torch.device("cpu"), torch.float32, max_len=64)
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in ("3+4=", "12+9=")]
    r = sampler.generate(prompts, 3, 8, 0.8, seed=1)
    batch = packing.make_batch(r.prompt_ids, r.completion_ids, 0, torch.device("cpu"))
    with torch.no_grad():
        ours = logprobs.token_logprobs(model, batch, 0.8)[0][batch["mask"] > 0]
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    theirs = torch.tensor([x for lp in r.sampler_logprobs for x in lp])
    sampler.push()
    probe = (prompts[0], r.completion_ids[0])
    out = {"family": family, "sampler_vs_trainer": (ours - theirs).abs().max().item(),
           "push_check": sampler.check_push(probe, 2e-3)}
    sampler.llm = None
    return out


if __name__ == "__main__":
    out_path, families = sys.argv[1], sys.argv[2:]
    task = rewards.load_task("addition")
    tokenizer = transformers.AutoTokenizer.from_pretrained(models.build_tiny_model(task.alphabet))
    with open(out_path, "w") as f:
        for family in families:
            t = time.time()
            try:
                result = check(family, f"{out_path}.{family}", tokenizer)
            except SystemExit as e:  # refused in one line (an architecture this vLLM cannot run)
                result = {"family": family, "refused": str(e)}
            gc.collect()
            f.write(json.dumps({**result, "seconds": round(time.time() - t, 1)}) + "\n")
            f.flush()
