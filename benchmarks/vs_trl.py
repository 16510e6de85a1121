"""Our train_grpo.py against TRL's GRPOTrainer on one identical configuration: fp32 on CPU, one thread each,
the same model, task, batch, optimizer, loss and sampling; interleaved A/B pairs; prints the median ratio of
steps per CPU-second and each side's rollout and update CPU-seconds per step.

    python -m venv /tmp/trl && /tmp/trl/bin/pip install torch==2.13.0+cpu trl==1.16.0 transformers==5.19.0
    python benchmarks/vs_trl.py --trl_python /tmp/trl/bin/python                  # tiny: 5 pairs x 40 steps
    python benchmarks/vs_trl.py --trl_python /tmp/trl/bin/python --ours_root /tmp/old  # another checkout
    python benchmarks/vs_trl.py --trl_python /tmp/trl/bin/python --model smollm2 --task addition:14 \\
        --prompts 8 --group 8 --micro 32 --max_new_tokens 32 --pairs 3 --steps 12 --skip 2 --json r.json

TRL is installed only for this benchmark (in a virtual environment of its own), not a dependency of the
project. Each run is its own process; the first --skip steps (warm-up) are left out of the timing. Steps per
CPU-second = steps / process CPU seconds (user + system) between the end of step --skip and the last step,
so another load on the machine slows the wall clock, not the measure. Per step, over the same steps:
rollout = CPU-seconds of sampling and scoring (ours: common.rollout; TRL: _generate_and_score_completions),
update = from the rollout's end to the optimizer step's end (ours: pre_update to check_sampler; TRL: to
on_step_end), the rest of the step (logging, the guard) in neither.

`--engine vllm` puts the default engines side by side: ours as a CPU user gets it (vLLM, in the process)
against TRL's default (its HF generation; TRL's vLLM modes do not run on the CPU build), every other setting
the same; steps per CPU-second and per wall second are both printed, with each phase's CPU and wall seconds.

A model with a chat template (anything but `tiny`) gets it on both sides: ours renders each prompt as the
user's message (rlmini/data.py::encode_prompts), TRL is given the same message in its conversational format.
Both workers report the prompt token ids they handed to generation, and every prompt's ids as each side's
own code renders it; the run stops unless the two sides agree on every prompt. `--json` writes every
measurement, with the tokens of each step's groups, for benchmarks/flops.py.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LR, CLIP, SEED = 3e-4, 0.2, 0


def ours_args(c: dict) -> list:
    """train_grpo.py's options for configuration `c` (TRL's names in trl_config)."""
    return ["--model", c["model"], "--engine", c.get("engine", "hf"), "--task", c["task"],
            "--prompts_per_step", str(c["prompts"]), "--group_size", str(c["group"]),
            "--micro_batch_size", str(c["micro"]), "--max_new_tokens", str(c["max_new_tokens"]),
            "--lr", str(c["lr"]), "--warmup", "0", "--weight_decay", "0", "--grad_clip", "1.0",
            "--temperature", "1.0", "--dtype", "float32", "--seed", str(SEED),
            "--loss_agg", "seq-mean-token-mean", "--std_norm", "true", "--clip_eps", str(CLIP), "--beta", "0",
            "--updates_per_rollout", "1", "--minibatches", "1", "--wandb", "false", "--save_every", "0",
            "--eval_every", "0", "--print_every", "1000000"]


def trl_config(c: dict) -> dict:
    """GRPOConfig's settings for configuration `c` (the same as ours_args)."""
    return dict(per_device_train_batch_size=c["micro"],
                gradient_accumulation_steps=c["prompts"] * c["group"] // c["micro"],
                num_generations=c["group"], max_completion_length=c["max_new_tokens"], learning_rate=c["lr"],
                lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9,
                adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, temperature=1.0, top_p=1.0, top_k=0,
                repetition_penalty=1.0, loss_type="grpo", scale_rewards="group", epsilon=CLIP, beta=0.0,
                num_iterations=1, disable_dropout=True, use_vllm=False, use_cpu=True, bf16=False, fp16=False,
                seed=SEED, logging_steps=1, report_to="none", save_strategy="no", dataloader_num_workers=0,
                log_completions=False, mask_truncated_completions=False)


def load_task(c: dict, root: str):
    sys.path.insert(0, root)
    import rewards  # the same task and verifier (standard library only)
    return rewards.load_task(c["task"], c["style"], SEED)


def worker_ours(c: dict, out: str, root: str) -> dict:
    sys.path.insert(0, root)
    import torch
    torch.set_num_threads(c["threads"])
    import common
    import train_grpo
    from rlmini import data, rollouts as rollouts_mod, runlog
    marks, cur, fed = [], {"rollout": 0.0, "update": 0.0, "rollout_wall": 0.0, "update_wall": 0.0,
                           "groups": []}, {}
    clock = {}
    log, rollout, pre_update, check_sampler = (runlog.RunLog.log, common.rollout, common.pre_update,
                                                 common.check_sampler)
    sample = rollouts_mod.sample

    def timed_rollout(*a, **kw):
        start, wall = time.process_time(), time.perf_counter()
        try:
            return rollout(*a, **kw)
        finally:
            cur["rollout"] += time.process_time() - start
            cur["rollout_wall"] += time.perf_counter() - wall

    def timed_pre_update(*a, **kw):
        clock["update"], clock["update_wall"] = time.process_time(), time.perf_counter()
        return pre_update(*a, **kw)

    def timed_check_sampler(*a, **kw):
        cur["update"] += time.process_time() - clock.pop("update")
        cur["update_wall"] += time.perf_counter() - clock.pop("update_wall")
        return check_sampler(*a, **kw)

    def recorded_sample(run, examples, n, *a, **kw):
        r = sample(run, examples, n, *a, **kw)
        for g, ex in enumerate(examples):  # the ids the engine was given, by the prompt's text
            ids = r.prompt_ids[g * n]
            key = json.dumps(ex["prompt"])
            if fed.setdefault(key, ids) != ids or any(p != ids for p in r.prompt_ids[g * n:(g + 1) * n]):
                raise SystemExit(f"ours: prompt {key} fed with different token ids")
            cur["groups"].append([len(ids), [len(x) for x in r.completion_ids[g * n:(g + 1) * n]]])
        return r

    def timed_log(self, step, metrics):
        log(self, step, metrics)
        marks.append({"cpu": time.process_time(), "wall": time.perf_counter(),
                      "reward": metrics["reward/mean"], "len": metrics["len/mean"], **cur})
        cur.update(rollout=0.0, update=0.0, rollout_wall=0.0, update_wall=0.0, groups=[])
    runlog.RunLog.log, common.rollout, common.pre_update, common.check_sampler = (
        timed_log, timed_rollout, timed_pre_update, timed_check_sampler)
    rollouts_mod.sample = recorded_sample
    run = train_grpo.main([*ours_args(c), "--steps", str(c["steps"]), "--out_dir", out,
                           "--run_name", "bench"])
    prompts = [e["prompt"] for e in run.task.train]
    rendered = data.encode_prompts(run.tokenizer, prompts, run.style == "chat")
    return {"marks": marks, "fed": fed, "rendered": {json.dumps(p): ids for p, ids in zip(prompts, rendered)}}


def worker_trl(c: dict, out: str, root: str) -> dict:
    import torch
    torch.set_num_threads(c["threads"])
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    task = load_task(c, root)
    chat = c["style"] == "chat"
    tok = AutoTokenizer.from_pretrained(c["path"])
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token

    def reward(completions, completion_ids, answer, **kw):
        text = [x[-1]["content"] if chat else x for x in completions]  # conversational: the assistant's turn
        return [task.score(t, {"answer": a}, bool(ids) and ids[-1] == tok.eos_token_id).reward
                for t, ids, a in zip(text, completion_ids, answer)]
    marks, cur, fed, clock = [], {"rollout": 0.0, "update": 0.0, "rollout_wall": 0.0, "update_wall": 0.0,
                                  "groups": []}, {}, {}
    as_prompt = (lambda p: [{"role": "user", "content": p}]) if chat else (lambda p: p)
    as_key = (lambda p: json.dumps(p[-1]["content"])) if chat else json.dumps

    generate_and_score, generate, single_turn = (GRPOTrainer._generate_and_score_completions,
                                                 GRPOTrainer._generate, GRPOTrainer._generate_single_turn)

    def timed_generate_and_score(self, *a, **kw):
        start, wall = time.process_time(), time.perf_counter()
        try:
            return generate_and_score(self, *a, **kw)
        finally:
            clock["rollout_end"], clock["rollout_end_wall"] = time.process_time(), time.perf_counter()
            cur["rollout"] += clock["rollout_end"] - start
            cur["rollout_wall"] += clock["rollout_end_wall"] - wall

    def recorded_generate(self, prompts):
        clock["prompts"] = prompts
        return generate(self, prompts)

    def recorded_single_turn(self, prompt_ids, *a, **kw):
        completion_ids, logprobs = single_turn(self, prompt_ids, *a, **kw)
        prompts, G = clock.pop("prompts"), c["group"]
        for p, ids in zip(prompts, prompt_ids):  # the unpadded ids the generation was given, by the text
            if fed.setdefault(as_key(p), list(ids)) != list(ids):
                raise SystemExit(f"TRL: prompt {as_key(p)} fed with different token ids")
        for g in range(0, len(prompt_ids), G):  # a prompt's G copies are consecutive (RepeatSampler)
            if any(list(x) != list(prompt_ids[g]) for x in prompt_ids[g:g + G]):
                raise SystemExit("TRL: a group's prompts differ (not G consecutive copies)")
            cur["groups"].append([len(prompt_ids[g]), [len(x) for x in completion_ids[g:g + G]]])
        return completion_ids, logprobs
    GRPOTrainer._generate_and_score_completions = timed_generate_and_score
    GRPOTrainer._generate, GRPOTrainer._generate_single_turn = recorded_generate, recorded_single_turn

    class Timer(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            cur["update"] = time.process_time() - clock.pop("rollout_end")  # to the optimizer step's end
            cur["update_wall"] = time.perf_counter() - clock.pop("rollout_end_wall")

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                marks.append({"cpu": time.process_time(), "wall": time.perf_counter(),
                              "reward": logs["reward"],
                              "len": logs.get("completions/mean_length", float("nan")), **cur})
                cur.update(rollout=0.0, update=0.0, rollout_wall=0.0, update_wall=0.0, groups=[])
    data = Dataset.from_list([{"prompt": as_prompt(e["prompt"]), "answer": e["answer"]} for e in task.train])
    config = GRPOConfig(output_dir=out, max_steps=c["steps"], **trl_config(c))
    trainer = GRPOTrainer(model=c["path"], reward_funcs=reward, args=config, train_dataset=data,
                          processing_class=tok, callbacks=[Timer()])
    trainer.train()
    prompts = [as_prompt(e["prompt"]) for e in task.train]
    rendered = trainer._tokenize_prompts(prompts)[0]  # the code path its generation takes
    return {"marks": marks, "fed": fed,
            "rendered": {as_key(p): list(ids) for p, ids in zip(prompts, rendered)}}


def start(side: str, python: str, c: dict, root: str, out: str) -> tuple:
    """One side's worker process, started (its output goes to files in `out`)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(c["threads"]), "MKL_NUM_THREADS": str(c["threads"]),
           "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    files = open(os.path.join(out, "stdout"), "w+"), open(os.path.join(out, "stderr"), "w+")
    proc = subprocess.Popen([python, os.path.abspath(__file__), "--worker", side, "--config", json.dumps(c),
                             "--out", out, "--ours_root", root], env=env, cwd=out, stdout=files[0],
                            stderr=files[1], text=True)
    return side, proc, files, time.perf_counter()


def finish(started: tuple) -> dict:
    side, proc, (stdout, stderr), t0 = started
    if proc.wait():
        stderr.seek(0)
        sys.exit(f"{side} run failed:\n{stderr.read()[-3000:]}")
    stdout.seek(0)
    r = json.loads(stdout.read().strip().splitlines()[-1])
    r["first_step_s"] = r["marks"][0]["wall"] - t0 if r["marks"] else float("nan")
    return r


def run_pair(order: list, pythons: dict, c: dict, root: str, concurrent: bool) -> dict:
    """Both sides, one after the other in `order`, or at the same time (--concurrent)."""
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        outs, res = dict(zip(order, (a, b))), {}
        if concurrent:
            started = [start(side, pythons[side], c, root, outs[side]) for side in order]
            res = {s[0]: finish(s) for s in started}
        else:
            for side in order:
                res[side] = finish(start(side, pythons[side], c, root, outs[side]))
        return res


def summary(r: dict, skip: int) -> dict:
    m = r["marks"]
    cpu, counted, tail = m[-1]["cpu"] - m[skip - 1]["cpu"], m[skip:], m[len(m) // 2:]
    wall = m[-1]["wall"] - m[skip - 1]["wall"]
    return {"sps": len(counted) / cpu, "sps_wall": len(counted) / wall, "steps": len(m),
            "cpu_per_step": cpu / len(counted), "wall_per_step": wall / len(counted),
            **{k: statistics.mean(x.get(k, float("nan")) for x in counted)
               for k in ("rollout", "update", "rollout_wall", "update_wall")},
            "reward": statistics.mean(x["reward"] for x in tail),
            "len": statistics.mean(x["len"] for x in tail)}


def check_prompt_ids(res: dict) -> str:
    """Both sides render every prompt to the same token ids, and fed generation the same ones: else exit."""
    ours, trl = res["ours"], res["trl"]
    for side, r in res.items():
        wrong = [k for k, ids in r["fed"].items() if r["rendered"].get(k) != ids]
        if wrong:
            sys.exit(f"prompt ids: {side} fed {wrong[0]} other ids than it renders for it")
    if ours["rendered"].keys() != trl["rendered"].keys():
        sys.exit("prompt ids: the two sides' training prompts differ")
    differ = [k for k in ours["rendered"] if ours["rendered"][k] != trl["rendered"][k]]
    if differ:
        k = differ[0]
        sys.exit(f"prompt ids DIFFER on {len(differ)} of {len(ours['rendered'])} prompts, e.g. {k}:\n"
                 f"  ours {ours['rendered'][k]}\n  TRL  {trl['rendered'][k]}")
    both = ours["fed"].keys() & trl["fed"].keys()
    if any(ours["fed"][k] != trl["fed"][k] for k in both):
        sys.exit("prompt ids: a prompt fed by both sides with different ids")
    lengths = sorted(len(x) for x in ours["rendered"].values())
    return (f"prompt ids identical on both sides: all {len(lengths)} training prompts ({lengths[0]}-"
            f"{lengths[-1]} tokens), {len(ours['fed'])} / {len(trl['fed'])} fed by ours / TRL, "
            f"{len(both)} by both")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trl_python", default=sys.executable, help="a Python with trl installed")
    p.add_argument("--ours_root", default=ROOT, help="the checkout of this project to time")
    p.add_argument("--model", default="tiny", help="tiny | smollm2 (built in) | a local model folder")
    p.add_argument("--task", default="addition")
    p.add_argument("--engine", default="hf", choices=["hf", "vllm"],
                   help="our rollout engine: hf (TRL's own, HF against HF) or vllm (our default on a CPU, "
                        "against TRL's default, its HF generation: the default engines side by side)")
    p.add_argument("--prompts", type=int, default=32, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    p.add_argument("--micro", type=int, default=64, help="completions per micro-batch (TRL: per device)")
    p.add_argument("--max_new_tokens", type=int, default=0, help="0: the task's default")
    p.add_argument("--lr", type=float, default=LR)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads of each side")
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the timing")
    p.add_argument("--concurrent", action="store_true",
                   help="run a pair's two sides at the same time (a busy machine: CPU-seconds still count "
                        "each side's own work, the wall clock is shorter)")
    p.add_argument("--json", help="write every measurement here (for benchmarks/flops.py)")
    p.add_argument("--worker", choices=["ours", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        res = (worker_ours if args.worker == "ours" else worker_trl)(json.loads(args.config), args.out,
                                                                      args.ours_root)
        print(json.dumps(res))
        return
    if args.prompts * args.group % args.micro or not 1 <= args.skip < args.steps:
        p.error("--micro must divide --prompts x --group, and 1 <= --skip < --steps")
    sys.path.insert(0, ROOT)
    from rlmini import models
    if args.engine == "vllm" and subprocess.run([sys.executable, "-c", "import vllm"],
                                                capture_output=True).returncode:
        sys.exit(f"--engine vllm: vLLM is not installed in {sys.executable} (pip install -r "
                 f"requirements-vllm.txt, or use --engine hf)")
    c = {"model": args.model, "task": args.task, "engine": args.engine, "prompts": args.prompts,
         "group": args.group,
         "micro": args.micro, "lr": args.lr, "threads": args.threads, "steps": args.steps,
         "style": models.prompt_style(args.model)}
    task = load_task(c, ROOT)
    c["max_new_tokens"] = args.max_new_tokens or task.max_new_tokens
    c["path"] = models.model_path(args.model, task)  # built once here (tiny, smollm2), read by both sides
    versions = ("import trl, transformers, torch; "
                "print(trl.__version__, transformers.__version__, torch.__version__)")
    trl_version = subprocess.run([args.trl_python, "-c", versions], capture_output=True, text=True)
    print(f"TRL / transformers / torch of the TRL side: "
          f"{trl_version.stdout.strip() or trl_version.stderr[-300:]}")
    print(f"model {c['path']} ({c['style']} prompts); the sides of a pair "
          f"{'at the same time' if args.concurrent else 'one after the other'}\n"
          f"ours: {' '.join(ours_args(c))}\n"
          f"TRL GRPOConfig: {trl_config(c)}\n", flush=True)
    rows, results = [], []
    for i in range(args.pairs):
        order = ["ours", "trl"] if i % 2 == 0 else ["trl", "ours"]
        res = run_pair(order, {"ours": sys.executable, "trl": args.trl_python}, c, args.ours_root,
                       args.concurrent)
        if i == 0:
            print(check_prompt_ids(res), flush=True)
        s = {side: summary(res[side], args.skip) for side in res}
        rows.append((i + 1, s["ours"], s["trl"], res["ours"]["first_step_s"], res["trl"]["first_step_s"]))
        results.append({side: {"summary": s[side], "marks": res[side]["marks"],
                               "first_step_s": res[side]["first_step_s"]} for side in res})
        print(f"pair {i + 1}: ours {s['ours']['sps']:.4f} steps/CPU-s, TRL {s['trl']['sps']:.4f}, ratio "
              f"{s['ours']['sps'] / s['trl']['sps']:.2f}; per wall second ratio "
              f"{s['ours']['sps_wall'] / s['trl']['sps_wall']:.2f}", flush=True)
        if args.json:  # after every pair: a cut-short run keeps what it measured
            with open(args.json, "w") as f:
                json.dump({"config": c, "skip": args.skip, "concurrent": args.concurrent,
                           "pairs": results}, f)
    print("\n| pair | ours steps/CPU-s | TRL steps/CPU-s | ratio | ours rollout / update CPU-s per step | "
          "TRL rollout / update | ours to step 1 (s) | TRL to step 1 (s) | ours reward / len (2nd half) | "
          "TRL reward / len |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for i, o, t, fo, ft in rows:
        print(f"| {i} | {o['sps']:.4g} | {t['sps']:.4g} | {o['sps'] / t['sps']:.2f} | {o['rollout']:.3g} / "
              f"{o['update']:.3g} | {t['rollout']:.3g} / {t['update']:.3g} | {fo:.1f} | {ft:.1f} | "
              f"{o['reward']:.3f} / {o['len']:.2f} | {t['reward']:.3f} / {t['len']:.2f} |")
    ratios = [o["sps"] / t["sps"] for _, o, t, _, _ in rows]
    walls = [o["sps_wall"] / t["sps_wall"] for _, o, t, _, _ in rows]
    print(f"\nours with --engine {args.engine} against TRL's HF generation")
    print(f"median ratio (ours / TRL steps per CPU-second): {statistics.median(ratios):.2f} (min "
          f"{min(ratios):.2f}, max {max(ratios):.2f}; {args.pairs} interleaved pairs x {args.steps} steps, "
          f"first {args.skip} left out)")
    print(f"median ratio (ours / TRL steps per wall second): {statistics.median(walls):.2f} (min "
          f"{min(walls):.2f}, max {max(walls):.2f})")
    for side, k in (("ours", 1), ("TRL", 2)):
        phases = ("rollout", "update", "cpu_per_step", "rollout_wall", "update_wall", "wall_per_step")
        med = {ph: statistics.median(r[k][ph] for r in rows) for ph in phases}
        print(f"{side}: per step (median over pairs) {med['cpu_per_step']:.3g} CPU-s (rollout "
              f"{med['rollout']:.3g}, update {med['update']:.3g}), {med['wall_per_step']:.3g} wall s "
              f"(rollout {med['rollout_wall']:.3g}, update {med['update_wall']:.3g})")


if __name__ == "__main__":
    main()
