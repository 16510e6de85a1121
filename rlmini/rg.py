"""reasoning-gym (--task rg:NAME[=WEIGHT][,...]): procedural generators with their own verifiers, offline
(docs/tasks.md). rewards.py::load_task dispatches rg: specs here."""
import difflib
import hashlib
import math
import os
import random
import sys

from rlmini.task import Score, Task


# generators over 2 s per 1,000 items here: CPU seconds, "> N" where stopped (benchmarks/rg_generators.py)
RG_SLOW = {
    "advanced_geometry": "4", "codeio": "2.7", "countdown": "> 10", "futoshiki": "> 10",
    "game_of_life": "5.3", "game_of_life_halting": "2.7", "intermediate_integration": "> 10", "jugs": "3.7",
    "knight_swap": "> 4", "number_sequence": "> 4", "polynomial_equations": "> 4",
    "polynomial_multiplication": "> 4", "puzzle24": "> 4", "quantum_lock": "> 4", "rearc": "> 4",
    "rubiks_cube": "> 4", "simple_integration": "3.7", "sokoban": "> 4", "sudoku": "> 4",
    "word_ladder": "3.5", "zebra_puzzles": "> 4"}
RG_INSTRUCTION = "Give only the final answer between <answer> and </answer> tags."
RG_TAGS = ("<answer>", "</answer>")


def rg_registry() -> dict:
    """{name: (dataset class, config class)} of reasoning-gym's generators (its `composite` is our mix)."""
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise SystemExit("--task rg:...: reasoning-gym is not installed (pip install -r "
                         "requirements-common.txt)") from None
    return {k: v for k, v in DATASETS.items() if k != "composite"}


def rg_mix(spec: str, allow_slow: bool = False) -> dict:
    """{generator: weight} of `chain_sum=2,leg_counting=1` (weight 1 if none); one line on a bad name."""
    registry, mix = rg_registry(), {}
    for item in [x.strip() for x in spec.split(",") if x.strip()] or [""]:
        name, eq, weight = item.partition("=")
        name = name.strip()
        if name not in registry:
            close = difflib.get_close_matches(name, list(registry), n=5, cutoff=0.5)
            hint = f"close names: {', '.join(close)}" if close else "the names are listed in docs/tasks.md"
            raise SystemExit(f"--task rg:{spec}: no reasoning-gym generator {name!r}; {hint}")
        try:
            w = float(weight) if eq else 1.0
        except ValueError:
            w = float("nan")
        if not (math.isfinite(w) and w > 0) or name in mix:
            raise SystemExit(f"--task rg:{spec}: {item!r}: each generator once, with a weight > 0 "
                             f"(rg:chain_sum=2,leg_counting=1)")
        if name in RG_SLOW and not allow_slow:
            raise SystemExit(f"--task rg:{spec}: {name} took {RG_SLOW[name]} CPU s per 1,000 items here "
                             f"(supported: under 2 s); --rg_allow_slow true uses it anyway")
        mix[name] = w
    return mix


def rg_configs(path: str, mix: dict) -> dict:
    """{generator: config} from --task_config (YAML or JSON, {name: {key: value}}), each key checked against
    the generator's config class; seed and size are the run's (--seed, --rg_size)."""
    if not path:
        return {name: {} for name in mix}
    if not os.path.isfile(path):
        raise SystemExit(f"--task_config {path}: file not found")
    import yaml  # YAML is a superset of JSON: one reader for both
    try:
        with open(path) as f:
            cfg = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        raise SystemExit(f"--task_config {path}: not valid YAML/JSON: {' '.join(str(e).split())}") from None
    if not isinstance(cfg, dict) or not all(isinstance(v, dict) for v in cfg.values()):
        raise SystemExit(f"--task_config {path}: expected {{generator: {{key: value}}}}, e.g. chain_sum: "
                         f"{{max_terms: 2}}")
    extra = sorted(set(cfg) - set(mix))
    if extra:
        raise SystemExit(f"--task_config {path}: {extra[0]} is not in --task rg:{','.join(mix)}")
    registry = rg_registry()
    for name, keys in cfg.items():
        fields = [f for f in registry[name][1].__dataclass_fields__ if f not in ("seed", "size")]
        for key in keys:
            if key not in fields:
                why = ("set by --seed and --rg_size" if key in ("seed", "size") else
                       f"it has: {', '.join(fields)}")
                raise SystemExit(f"--task_config {path}: {name}: no config key {key!r} ({why})")
    return {name: dict(cfg.get(name, {})) for name in mix}


def rg_seed(seed: int, name: str) -> int:
    """A generator's base seed from --seed: its items draw from seed + index (reasoning-gym's convention)."""
    digest = hashlib.sha256(f"rg/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x3FFF_FFFF  # room above it for both splits' indices


def rg_dataset(name: str, config: dict, seed: int, size: int, path: str = ""):
    """reasoning_gym.create_dataset with an explicit seed (None would draw a new one per instance)."""
    import reasoning_gym
    try:
        return reasoning_gym.create_dataset(name, seed=seed, size=max(size, 1), **config)
    except (AssertionError, ValueError, TypeError) as e:  # the config's own validate()
        where = f"--task_config {path}: " if path else "--task rg:"
        raise SystemExit(f"{where}{name}: bad config {config}: {type(e).__name__}: {e}") from None


def rg_extract(completion: str, style: str, finished: bool) -> str | None:
    """The answer by the documented rule (docs/tasks.md): chat, the last <answer>...</answer> (reasoning_gym.
    utils.extract_answer, stripped); tiny, whose prompt ends with <answer>, the completion up to its first
    </answer>, or all of it when it ended with EOS, stripped. None: no answer (a format failure); "" is an
    answer (some gold answers are empty)."""
    if style != "tiny":
        from reasoning_gym.utils import extract_answer
        return extract_answer(completion)
    if RG_TAGS[1] not in completion and not finished:
        return None
    return completion.split(RG_TAGS[1], 1)[0].strip()


def rg_level_config(name: str, curriculum, level: int) -> dict:
    """The config of a generator's reasoning-gym curriculum at a global level (seed and size left out)."""
    curriculum.set_global_level(level)
    config = curriculum.generate_configuration({})
    return {k: v for k, v in vars(config).items() if k not in ("seed", "size")}


def rg_task(spec: str, style: str, seed: int, size: int = 1000, task_config: str = "",
            allow_slow: bool = False, curriculum: float = 0.0) -> Task:
    """Examples of each generator of the mix (`spec` as rg_mix), drawn by weight, `size` for training and a
    tenth (at least 1) held out: the held-out items draw from seeds just past the training ones (disjoint
    ranges), and training items whose question is also held out are dropped (disjoint by content). Each
    example keeps reasoning-gym's entry (question, answer, metadata) and its generator's name ("rg"). The
    reward is the generator's score_answer on the extracted answer (partial credit kept); correct means 1.0;
    a scorer that raises scores 0 and is counted (task/scorer_errors). curriculum > 0: each generator's
    reasoning-gym curriculum, from level 0; Task.on_eval raises the level (all generators, new examples)
    after an evaluation whose pass@1 reaches it, Task.state holds it for the checkpoint, Task.restore puts a
    resumed run back at it."""
    mix = rg_mix(spec, allow_slow)
    user, names, weights = rg_configs(task_config, mix), list(mix), list(mix.values())
    curricula = {}
    if curriculum:
        from reasoning_gym.factory import create_curriculum, has_curriculum
        missing = [n for n in names if not has_curriculum(n)]
        if missing:
            raise SystemExit(f"--rg_curriculum: {', '.join(missing)} has no reasoning-gym curriculum")
        curricula = {n: create_curriculum(n) for n in names}
    datasets = {}  # the current level's, which the scorer asks

    def build(level: int, size: int, note: bool = True) -> tuple:
        n_test = max(1, size // 10)
        rng = random.Random(f"rg/{seed}/mix")  # which generator each example comes from
        draws = {"train": rng.choices(names, weights, k=size), "test": rng.choices(names, weights, k=n_test)}
        items = {"train": {}, "test": {}}
        for name in names:  # --task_config's keys override the curriculum level's
            config = {**(rg_level_config(name, curricula[name], level) if curricula else {}), **user[name]}
            n_train, base = draws["train"].count(name), rg_seed(seed, name)
            datasets[name] = rg_dataset(name, config, base, n_train, task_config)
            held = rg_dataset(name, config, base + n_train, draws["test"].count(name), task_config)
            items["train"][name] = iter([datasets[name][i] for i in range(n_train)])
            items["test"][name] = iter([held[i] for i in range(draws["test"].count(name))])
        train, test = ([example(next(items[s][n]), n) for n in draws[s]] for s in ("train", "test"))
        held_out = {e["question"] for e in test}
        kept = [e for e in train if e["question"] not in held_out]
        if not kept:
            raise SystemExit(f"--task rg:{spec}: every training question is also held out (the config allows "
                             f"few distinct questions); widen it in --task_config")
        if len(kept) < len(train) and note:
            print(f"--task rg:{spec}: dropped {len(train) - len(kept)} of {len(train)} training examples "
                  f"whose question is held out", file=sys.stderr)
        return kept, test

    def example(entry: dict, name: str) -> dict:
        q = entry["question"]
        prompt = f"{q}\n{RG_TAGS[0]}" if style == "tiny" else f"{q}\n\n{RG_INSTRUCTION}"
        return {"prompt": prompt, "answer": entry["answer"], "question": q, "metadata": entry["metadata"],
                "rg": name}

    stats, state = {"task/scorer_errors": 0}, {"level": 0}

    def score(completion: str, ex: dict, finished: bool) -> Score:
        pred = rg_extract(completion, style, finished)
        if pred is None:
            return Score(0.0, 0.0, 0.0)
        try:
            value = float(datasets[ex["rg"]].score_answer(pred, ex))
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"score {value} outside [0, 1]")
        except Exception as e:  # a scorer that raises on odd input: the worst score, counted, never a stop
            stats["task/scorer_errors"] += 1
            return Score(0.0, 0.0, 1.0, pred=pred, error=f"{ex['rg']}: {type(e).__name__}: {e}"[:200])
        return Score(value, float(value >= 1.0), 1.0, pred=pred)

    def go_to(task: Task, level: int) -> None:
        """Both splits generated anew at `level`; the new examples take the current ones' system message,
        if any (--system_prompt)."""
        state["level"] = level
        first = task.train[0]["prompt"]
        opening = first[:-1] if isinstance(first, list) else None
        task.train, task.test = ([{**e, "prompt": opening + [{"role": "user", "content": e["prompt"]}]}
                                  if opening else e for e in split] for split in build(level, size))

    def on_eval(task: Task, metrics: dict) -> dict:
        """--rg_curriculum: one level up when the held-out pass@1 reaches the threshold."""
        if metrics["eval/pass@1"] >= curriculum and state["level"] < top:
            go_to(task, state["level"] + 1)
        return {"task/rg_level": state["level"]}

    def restore(task: Task, saved: dict) -> None:
        """--resume: the checkpoint's level, with the examples the run had at it (level 0: those loaded)."""
        if "level" not in saved:  # written before the level was saved: level 0 would train on other examples
            raise SystemExit(f"--resume: the checkpoint holds no --rg_curriculum level (written by an older "
                             f"version); start the run again")
        level = saved["level"]
        if not 0 <= level <= top:  # a checkpoint of another --task (--allow_option_changes)
            raise SystemExit(f"--resume: the checkpoint's --rg_curriculum level {level} is not one of "
                             f"rg:{spec}'s (0 to {top})")
        if level:
            go_to(task, level)

    # with a curriculum the tokenizer and the generation budget are sized for its top level too
    top = max((len(a.levels) - 1 for c in curricula.values() for a in c.attributes.values()), default=0)
    sizing = sum(build(top, 50, note=False), []) if curricula else []  # a sample of the top level
    train, test = build(0, size)
    texts = [e["prompt"] + str(e["answer"] or "") for e in train + test + sizing]
    answers = [len(str(e["answer"])) for e in train + test + sizing if e["answer"] is not None] or [30]
    return Task("rg", "binary", train, test, score, pass_threshold=1.0,
                alphabet=sorted(set("".join(texts))) + list(RG_TAGS),
                max_new_tokens=max(answers) + 2 if style == "tiny" else 512, stats=stats,
                on_eval=on_eval if curricula else None, state=state if curricula else {},
                restore=restore if curricula else None)
