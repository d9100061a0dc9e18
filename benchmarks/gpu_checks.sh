#!/usr/bin/env bash
# The one-GPU checks of benchmarks/README.md ("One GPU", "GPU checks") in one run, each step under its own time
# limit so one slow or failing step leaves the others' figures. Logs go to $OUT (default gpu_out/), one per step.
#   bash benchmarks/gpu_checks.sh                 # all steps
#   bash benchmarks/gpu_checks.sh gpu recipe      # the named steps only
# Without `pip install -e .` (a bare GPU host): the repository is put on PYTHONPATH and `lit-mesh` is run as
# `python -m lit_mesh.cli`.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_out}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
wanted=" ${*:-env kernels gpu recipe memory_loss gpu_ac own_model_offload float8_1b float8_wide} "

source benchmarks/_steps.sh  # step NAME SECONDS COMMAND...

step env 30 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python -c "import torch, lightning; print(torch.__version__, torch.version.cuda, lightning.__version__, torch.cuda.get_device_name())"'
step kernels 90 python -m pytest -q -p no:cacheprovider tests/unit/test_kernels.py -k "cuda or kernel_is_chosen or adamw"
step gpu 200 python benchmarks/gpu.py --rounds 2
# the recipe on one GPU, with gpu.py's batch (4 x 2048) so the 1B model fits without activation checkpointing
step recipe 160 bash -c "python -m lit_mesh.cli fit -c configs/gpu.yaml --trainer.devices=1 --trainer.max_steps=50 \
    --data.init_args.global_batch_size=4 --trainer.logger.init_args.save_dir=$out/logs && python benchmarks/tensorboard_scalars.py $out/logs"
step memory_loss 60 python benchmarks/memory.py --loss-only
step gpu_ac 100 python benchmarks/gpu.py --activation-checkpointing full --rounds 1
# CPU offload's device bytes (parameters, gradients, AdamW state) against the same run without it; FSDP needs 2 or
# more GPUs, so on a one-GPU host this step stops at once, saying so
step own_model_offload 240 python benchmarks/own_model_memory.py --offload-only
# float8 linears (torchao, pip install -e '.[fp8]') against bf16-mixed, tokens/s: the 1B preset, then 8 blocks of
# llama3-8b's width (dim 4096, ffn 14336), where the matmuls are large enough for float8 to pay
step float8_1b 240 python benchmarks/gpu.py --float8 tensorwise --rounds 2
step float8_wide 300 python benchmarks/gpu.py --float8 tensorwise --preset llama3-8b --n-layers 8 --batch-size 2 --rounds 2
