#!/usr/bin/env bash
# Wheels for a CUDA machine that cannot reach a package index but already has PyTorch (a
# cluster image, an air-gapped node): vlrft's dependencies such images usually lack, at the
# versions installed here (the ones CI tests), built or downloaded on a machine with an index.
#
#   bash tests/gpu/wheelhouse.sh [DIR] [PYTHON_VERSION]      # default: .whl 3.12
#   CUTEDSL=cu13 bash tests/gpu/wheelhouse.sh                 # with Liger's Hopper kernel (~110 MB more)
#
# On the GPU machine (tests/gpu/run_all.sh does this when it finds DIR):
#   pip install --no-index --no-deps --target /tmp/site DIR/*.whl
#   export PYTHONPATH=/tmp/site:$PWD
#   (with CUTEDSL wheels also /tmp/site/nvidia_cutlass_dsl/dsl_packages, which their .pth adds)
# Packages come without their own dependencies (`--no-deps`): the list names each one the
# image lacks. DeepSpeed publishes only a source archive; it is built here into a pure-Python
# wheel (no prebuilt ops: it picks CUDA at run time).
set -euo pipefail
dir=${1:-.whl} python_version=${2:-3.12}
cd "$(dirname "$0")/../.."
# transformers: images often hold an older one (vlrft needs >= 5.19), and regex, which its
# import checks against a recent minimum. deepspeed and its needs (hjson, pydantic and
# pydantic's own). datasets and its needs (parquet and HF data sets as training data). peft:
# LoRA policies. Images with PyTorch usually hold the rest (einops, msgpack, psutil,
# accelerate, tokenizers, huggingface-hub, safetensors, pytest); run_all.sh names any missing.
packages=(transformers regex deepspeed hjson pydantic pydantic_core annotated-types typing-inspection
          datasets dill multiprocess peft)
mkdir -p "$dir"
pinned=()
for name in "${packages[@]}"; do
    version=$(python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name") || {
        echo "wheelhouse: $name is not installed here: pip install -e '.[dev]' first" >&2; exit 1; }
    if [ "$name" = deepspeed ]; then
        DS_BUILD_OPS=0 python -m pip wheel -q --no-deps --no-build-isolation -w "$dir" "deepspeed==$version"
    else
        pinned+=("$name==$version")
    fi
done
# liger-kernel, the fused LM head (model.fused_head): pure Python on Triton, which PyTorch's CUDA
# builds bring. A GPU-only package, so not installed here: pinned to the release whose source
# vlrft's call was written against. Its Hopper kernel also needs NVIDIA's CUTLASS DSL, about 110 MB of wheels:
# CUTEDSL=cu12 or CUTEDSL=cu13 (the node's CUDA major version) adds them.
pinned+=(liger-kernel==0.8.5)
case ${CUTEDSL:-} in
    "") ;;
    cu12|cu13) pinned+=(nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1
                        "nvidia-cutlass-dsl-libs-$CUTEDSL==4.8.1" "cuda-bindings==${CUTEDSL#cu}.*" cuda-pathfinder
                        apache-tvm-ffi protobuf) ;;
    *) echo "wheelhouse: CUTEDSL is cu12 or cu13, not '$CUTEDSL'" >&2; exit 2 ;;
esac
platforms=()
for n in 17 27 28 34; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
python -m pip download -q --no-deps --only-binary=:all: --python-version "$python_version" --implementation cp \
    "${platforms[@]}" --platform manylinux2014_x86_64 -d "$dir" "${pinned[@]}"
du -sh "$dir"
ls "$dir"
