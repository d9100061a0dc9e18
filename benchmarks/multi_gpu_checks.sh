#!/usr/bin/env bash
# The checks only NCCL and several GPUs show (#33), for the first multi-GPU node, in order of risk. Each step runs
# under its own time limit and logs to $OUT (default multi_gpu_out/), one file per step; the comment above each
# step says the output that passes (#33 item 9's list: group timeouts, 2BW's clipping and 128 MB messages, the
# sync-debug audits, the recipe on every GPU, CP in bf16, async TP's fused kernels, a named tp hang; on two nodes
# flat against hierarchical all-reduce and an async save with its resume). Steps that need 2 GPUs are skipped on a
# one-GPU node (sync_moe_ep runs there with ep=1). Two-node steps run only when named, on both nodes at once
# (allreduce_2nodes, async_save_2nodes).
#   bash benchmarks/multi_gpu_checks.sh                    # every step, on the GPUs of this node
#   bash benchmarks/multi_gpu_checks.sh timeouts clip_2bw  # the named steps only
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-multi_gpu_out}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
wanted=" ${*:-env timeouts clip_2bw p2p_2bw_128mb sync_moe_ep sync_ddp_onebit sync_ddp_powersgd recipe_all_gpus cp_bf16 async_tp tp_hang} "

source benchmarks/_steps.sh  # step NAME SECONDS COMMAND...

step env 30 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python -c "import torch, lightning; print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version(), lightning.__version__)"'

# Item 1: every group of the mesh (dims, flattened views, hsdp and expert views) carries the strategy's timeout on
# NCCL, and shared members get one communicator. Passes with rc=0 and, on rank 0, the line
#   timeouts: N groups, every one 0:00:42 (distinct communicators: M)
cat >"$out/timeouts.py" <<'PY'
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from lit_mesh.mesh import MeshLayout, build_device_mesh

torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl", timeout=timedelta(seconds=42), device_id=torch.device("cuda", torch.cuda.current_device()))
world = dist.get_world_size()
views = build_device_mesh(MeshLayout(dp_shard=world // 2 if world > 1 else 1, tp=2 if world > 1 else 1), "cuda", timedelta(seconds=42))
groups = {name: views.root.get_group(name) for name in views.root.mesh_dim_names}
groups.update({name: views[name].get_group() for name in ("dp", "dp_shard_cp", "dp_cp", "data_parallel", "tensor_parallel")})
groups.update({f"hsdp.{n}": views.hsdp.get_group(n) for n in views.hsdp.mesh_dim_names})
timeouts = {name: g._get_backend(torch.device("cuda")).options._timeout for name, g in groups.items()}
wrong = {name: t for name, t in timeouts.items() if t != timedelta(seconds=42)}
assert not wrong, f"groups without the strategy's timeout: {wrong}"
value = torch.ones((), device="cuda")
dist.all_reduce(value, group=views.dp_cp.get_group())  # a shared group works as each view's
if dist.get_rank() == 0:
    print(f"timeouts: {len(groups)} groups, every one 0:00:42 (distinct communicators: {len({id(g) for g in groups.values()})})")
dist.destroy_process_group()
PY
step timeouts 180 torchrun --standalone --nproc_per_node="$gpus" "$out/timeouts.py"

# Item 2: 2BW with clipping on 2 GPUs; its first step has no gradients on any stage, whose zero norm went to the
# all-reduce over the stages as a host tensor ("No backend type associated with device type cpu" before the fix).
# Passes with rc=0 and Lightning's "`Trainer.fit` stopped: `max_steps=4` reached."
((gpus > 1)) && step clip_2bw 300 python -m lit_mesh.cli fit -c configs/gpt.yaml --trainer.accelerator=gpu --trainer.devices=2 \
    --trainer.max_steps=4 --trainer.gradient_clip_val=1.0 --trainer.limit_val_batches=0 --trainer.logger=false \
    --trainer.strategy.init_args.pp=2 --trainer.strategy.init_args.pp_schedule=2bw \
    --trainer.strategy.init_args.pp_microbatches=4

# Item 3: 2BW's point-to-point at 128 MiB per activation (micro-batch 2 x 4096 tokens x dim 4096 in fp32), over
# every GPU as one stage each: batched sends and receives must not deadlock once messages outgrow NCCL's buffers.
# Passes with rc=0 and "`Trainer.fit` stopped: `max_steps=3` reached." well inside the limit (a deadlock ends in
# the strategy's timeout, 300 s here, with a CollectiveHangError).
((gpus > 1)) && step p2p_2bw_128mb 600 python -m lit_mesh.cli fit -c configs/gpt.yaml --trainer.accelerator=gpu --trainer.devices="$gpus" \
    --trainer.max_steps=3 --trainer.limit_val_batches=0 --trainer.logger=false --trainer.callbacks=[] \
    --trainer.strategy.init_args.pp="$gpus" --trainer.strategy.init_args.pp_schedule=2bw \
    --trainer.strategy.init_args.pp_microbatches="$gpus" --trainer.strategy.init_args.timeout=0:05:00 \
    --data.init_args.seq_len=4096 --data.init_args.global_batch_size=$((2 * gpus)) \
    "--model.init_args.config_overrides={dim: 4096, n_heads: 32, n_kv_heads: 8, ffn_hidden: 8192, n_layers: $gpus, max_seq_len: 4096}"

# Items 4-5: torch.cuda.set_sync_debug_mode("warn") over step 2 of a 4-step run (log_every_n_steps=2: step 2 logs
# nothing), every rank printing the synchronizing CUDA calls it warned of (tests/integration/test_host_sync.py is
# the CPU proxy of the same counts). The zoo MoE "small" preset (4 MoE layers, 8 experts) in bf16 with ep = every GPU
# (1 on a one-GPU node: it runs there too): passes with rc=0 and, on every rank, the line
#   sync_debug: rank R step 2: N synchronizing CUDA calls
# with N = 4 under ep > 1 (the one declared read per MoE layer: its all-to-all split sizes) and N = 0 with ep = 1
# (grouped GEMMs take their offsets on the device). DDP over every GPU with 1-bit, then PowerSGD, compression
# (needs 2 GPUs or more): N = 0 on every rank. A line "first: ..." names the first call's warning where N > 0.
cat >"$out/sync_debug.py" <<'PY'
import warnings

import torch
from lightning.pytorch.callbacks import Callback


class SyncDebug(Callback):
    def __init__(self, step: int = 2) -> None:
        self.step, self.seen, self.catch = step, [], None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            torch.cuda.synchronize()  # before the mode: earlier steps' work is not this step's
            self.catch = warnings.catch_warnings(record=True)
            self.seen = self.catch.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.catch is not None:
            torch.cuda.set_sync_debug_mode(0)
            self.catch.__exit__(None, None, None)
            self.catch = None
            syncs = [w for w in self.seen if "synchroniz" in str(w.message)]
            print(f"sync_debug: rank {trainer.global_rank} step {self.step}: {len(syncs)} synchronizing CUDA calls", flush=True)
            if syncs:
                print(f"first: {syncs[0].filename}:{syncs[0].lineno} {syncs[0].message}", flush=True)
PY
sync_args=(--trainer.accelerator=gpu --trainer.devices="$gpus" --trainer.max_steps=4 --trainer.log_every_n_steps=2
    --trainer.limit_val_batches=0 --trainer.logger=false --trainer.enable_checkpointing=false
    --trainer.callbacks+=sync_debug.SyncDebug)
step sync_moe_ep 300 env PYTHONPATH="$out:$PYTHONPATH" python -m lit_mesh.cli fit -c configs/moe.yaml "${sync_args[@]}" \
    --trainer.precision=bf16-mixed --trainer.strategy.init_args.ep="$gpus" --model.init_args.preset=small \
    --data.init_args.global_batch_size=$((2 * gpus))
for mode in onebit powersgd; do
    if ((gpus > 1)); then
        step "sync_ddp_$mode" 300 env PYTHONPATH="$out:$PYTHONPATH" python -m lit_mesh.cli fit -c configs/gpt.yaml \
            "${sync_args[@]}" --trainer.strategy.init_args.dp_replicate="$gpus" \
            --trainer.strategy.init_args.grad_compression="$mode" --data.init_args.global_batch_size=$((2 * gpus))
    fi
done

# Item 6, two nodes: NCCL's own all-reduce (allreduce="flat", the default) against the hierarchical one over the
# DDP group of every GPU, fp32 tensors of 4 B to 1 GiB, the median of 10 timed calls each, next to the times the
# model behind allreduce="auto" predicts (lit_mesh/comm/allreduce_cost.py; NVLS=1 for an HGX node with NVLink SHARP).
# Run the same command on both nodes, MASTER_ADDR = node 0's address, NODE_RANK 0 and 1:
#   MASTER_ADDR=node0 NODE_RANK=0 bash benchmarks/multi_gpu_checks.sh allreduce_2nodes
# Passes with rc=0 and, on rank 0, one line per size, e.g. on 2 x 8 H100 with 8 x 400 Gb/s rails (the model's
# figures; the measured ones are what this records):
#   allreduce 1073741824 B: flat 6.3 ms, hierarchical 8.5 ms (results equal); model flat 6.3, hierarchical 8.5 ms: auto flat, measured faster flat
# then "auto agrees with the measured faster one on K of 9 sizes": K >= 7 expected; a lower K means the model's
# constants need this cluster's figures (give them with Topology(...)).
cat >"$out/allreduce_2nodes.py" <<'PY'
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from lit_mesh import Topology
from lit_mesh.comm import hierarchical
from lit_mesh.mesh import MeshLayout, build_device_mesh

cuda = torch.cuda.is_available()  # without GPUs (SIMULATED_NODES on one host, gloo): a dry run of the script
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=5))
world, rank = dist.get_world_size(), dist.get_rank()
nodes = int(os.environ.get("SIMULATED_NODES", world // int(os.environ["LOCAL_WORLD_SIZE"])))
topology = Topology(nodes=nodes, devices_per_node=world // nodes, nvls=os.environ.get("NVLS") == "1")
views = build_device_mesh(MeshLayout(dp_replicate=world), device.type, timedelta(minutes=5))
group = views["dp_replicate"].get_group()
h = hierarchical.build_hierarchy(views.root, views.axes_of("dp_replicate"), group, topology, "hierarchical", "ddp")
assert h is not None, f"no hierarchy on {nodes} node(s) x {world // nodes}: run on two nodes"
sync = torch.cuda.synchronize if cuda else (lambda: None)


def median_ms(run) -> float:
    run()
    times = []
    for _ in range(10):
        sync()
        start = time.perf_counter()
        run()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


agree, sizes = 0, [s for s in [4 * 32**k for k in range(7)] + [2**28, 2**30] if s <= int(os.environ.get("MAX_BYTES", 2**30))]
for nbytes in sizes:
    values = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(rank)).to(device)
    flat, hier = values.clone(), values.clone()
    dist.all_reduce(flat, group=group)
    hierarchical.all_reduce(hier, h, average=False)
    equal = torch.allclose(flat, hier, rtol=1e-5, atol=1e-5 * world)
    t_flat = median_ms(lambda: dist.all_reduce(values, group=group))
    t_hier = median_ms(lambda: hierarchical.all_reduce(values, h, average=False))
    m_flat = hierarchical.flat_time(nbytes, h.nodes, h.per_node, topology) * 1e3
    m_hier = hierarchical.hierarchical_time(nbytes, h.nodes, h.per_node, topology) * 1e3
    auto, faster = ("hierarchical" if m_hier < m_flat else "flat"), ("hierarchical" if t_hier < t_flat else "flat")
    agree += auto == faster
    if rank == 0:
        print(
            f"allreduce {nbytes} B: flat {t_flat:.3g} ms, hierarchical {t_hier:.3g} ms (results {'equal' if equal else 'DIFFER'});"
            f" model flat {m_flat:.3g}, hierarchical {m_hier:.3g} ms: auto {auto}, measured faster {faster}"
        )
    assert equal, f"hierarchical differs from flat at {nbytes} B"
if rank == 0:
    print(f"auto agrees with the measured faster one on {agree} of {len(sizes)} sizes")
dist.destroy_process_group()
PY
step allreduce_2nodes 600 torchrun --nnodes=2 --nproc_per_node="$gpus" --node_rank="${NODE_RANK:-0}" \
    --master_addr="${MASTER_ADDR:-127.0.0.1}" --master_port="${MASTER_PORT:-29511}" "$out/allreduce_2nodes.py"

# The 8-GPU recipe as users run it (configs/gpu.yaml: FSDP over every GPU, compiled blocks, fused AdamW, clipping,
# bf16-mixed, MeshMonitor), one process per GPU, 60 steps. Passes with rc=0, "`max_steps=60` reached", and a last
# line "recipe: mfu M at step S (tokens/s per GPU T)" read from MeshMonitor's own logs (CSV): M near the one-GPU
# recipe's figure in benchmarks/README.md (FSDP's collectives overlap the blocks: within 10% of it expected).
cat >"$out/last_mfu.py" <<'PY'
import csv
import pathlib
import sys

rows = [r for p in pathlib.Path(sys.argv[1]).rglob("metrics.csv") for r in csv.DictReader(open(p)) if r.get("monitor/mfu")]
last = rows[-1]
print(f"recipe: mfu {float(last['monitor/mfu']):.3f} at step {last['step']} (tokens/s per GPU {float(last['monitor/tokens_per_s_per_device']):.0f})")
PY
step recipe_all_gpus 900 bash -c "python -m lit_mesh.cli fit -c configs/gpu.yaml --trainer.devices=$gpus \
    --trainer.max_steps=60 --trainer.limit_val_batches=0 --trainer.logger=CSVLogger \
    --trainer.logger.save_dir=$out/recipe_all_gpus && python $out/last_mfu.py $out/recipe_all_gpus"

# Context parallel on NCCL in bf16 (2 GPUs): ring, Ulysses and all-gather each against cp=1, the zoo GPT (small,
# seq 4096), 20 steps. Passes with rc=0 and "cp STYLE: largest relative loss gap L over 20 steps" for each style,
# L <= 0.02 (bf16 rounding moves the curve a little, a wrong shard or mask moves it by far more).
cat >"$out/loss_gap.py" <<'PY'
import csv
import pathlib
import sys


def losses(d):
    rows = [r for p in pathlib.Path(d).rglob("metrics.csv") for r in csv.DictReader(open(p)) if r.get("train_loss")]
    return [float(r["train_loss"]) for r in sorted(rows, key=lambda r: int(r["step"]))]


ref, got = losses(sys.argv[1]), losses(sys.argv[2])
assert len(ref) == len(got) > 0, (len(ref), len(got))
gap = max(abs(a - b) / abs(a) for a, b in zip(ref, got))
print(f"cp {sys.argv[3]}: largest relative loss gap {gap:.4f} over {len(ref)} steps")
assert gap <= 0.02, gap
PY
cp_run() {  # NAME EXTRA...: 2 GPUs, bf16-mixed, CSV metrics under $out/NAME
    local name=$1
    shift
    python -m lit_mesh.cli fit -c configs/gpt.yaml --trainer.accelerator=gpu --trainer.devices=2 \
        --trainer.precision=bf16-mixed --trainer.max_steps=20 --trainer.log_every_n_steps=1 \
        --trainer.limit_val_batches=0 --trainer.callbacks=[] --trainer.logger=CSVLogger \
        --trainer.logger.save_dir="$out/$name" --model.init_args.preset=small --data.init_args.seq_len=4096 \
        --data.init_args.global_batch_size=2 "$@"
}
if ((gpus > 1)); then
    export -f cp_run
    export out
    step cp_bf16 900 bash -c 'cp_run cp1 --trainer.strategy.init_args.dp=2 &&
        for style in ring ulysses allgather; do
            cp_run "cp_$style" --trainer.strategy.init_args.cp=2 --trainer.strategy.init_args.cp_style=$style &&
            python "$out/loss_gap.py" "$out/cp1" "$out/cp_$style" $style || exit 1
        done'
fi

# Async TP (torch's micro-pipeline TP) on 2 GPUs, compiled with inductor: its fused kernels are in the generated
# code. Passes with rc=0, "`max_steps=10` reached" and "async tp: fused_all_gather_matmul N, fused_matmul_reduce_scatter M"
# with N > 0 and M > 0.
if ((gpus > 1)); then
    step async_tp 600 bash -c "TORCH_LOGS=output_code python -m lit_mesh.cli fit -c configs/gpt.yaml \
        --trainer.accelerator=gpu --trainer.devices=2 --trainer.max_steps=10 --trainer.limit_val_batches=0 \
        --trainer.logger=false --trainer.callbacks=[] --trainer.strategy.init_args.tp=2 \
        --trainer.strategy.init_args.compile_blocks=true --trainer.strategy.init_args.async_tp=true \
        >$out/async_tp_code.log 2>&1; rc=\$?; tail -n 3 $out/async_tp_code.log;
        echo \"async tp: fused_all_gather_matmul \$(grep -c fused_all_gather_matmul $out/async_tp_code.log),\" \
            \"fused_matmul_reduce_scatter \$(grep -c fused_matmul_reduce_scatter $out/async_tp_code.log)\"; exit \$rc"
fi

# A rank hung before a tp collective (FaultInjector "hang" on rank 1 at step 2), strategy timeout 30 s, 2 GPUs:
# the hang is named rather than waited on. Passes when the step ends (rc != 0 from the hung run is expected) within
# 90 s with "tp hang reported after S s" and both ranks' logs naming CollectiveHangError with the dim tp (or, on
# rank 0, torch's NCCL watchdog timeout).
if ((gpus > 1)); then
    step tp_hang 180 bash -c "start=\$SECONDS; python -m lit_mesh.cli fit -c configs/gpt.yaml --trainer.accelerator=gpu \
        --trainer.devices=2 --trainer.max_steps=6 --trainer.limit_val_batches=0 --trainer.logger=false \
        --trainer.strategy.init_args.tp=2 --trainer.strategy.init_args.timeout=0:00:30 \
        --trainer.callbacks+=lit_mesh.FaultInjector --trainer.callbacks.fault=hang --trainer.callbacks.step=2 \
        --trainer.callbacks.rank=1 >$out/tp_hang_run.log 2>&1;
        echo \"tp hang reported after \$((SECONDS - start)) s\"; grep -m 2 -o 'CollectiveHangError.*' $out/tp_hang_run.log"
fi

# Two nodes: an asynchronous sharded save at step 20 and a resume from it on the same ranks (the zoo GPT small,
# fsdp over both nodes). Run on both nodes as allreduce_2nodes. Passes with rc=0, "`max_steps=20` reached", then
# the resumed run's "Restoring states from the checkpoint path at .../async_ckpt/..." and "`max_steps=30` reached".
two_node_fit() {  # MAX_STEPS EXTRA...
    local steps=$1
    shift
    torchrun --nnodes=2 --nproc_per_node="$gpus" --node_rank="${NODE_RANK:-0}" --master_addr="${MASTER_ADDR:-127.0.0.1}" \
        --master_port="${MASTER_PORT:-29512}" -m lit_mesh.cli fit -c configs/gpt.yaml --trainer.accelerator=gpu \
        --trainer.devices="$gpus" --trainer.num_nodes=2 --trainer.max_steps="$steps" --trainer.limit_val_batches=0 \
        --trainer.logger=false --model.init_args.preset=small --trainer.strategy.init_args.async_save=true \
        --trainer.callbacks+=ModelCheckpoint --trainer.callbacks.dirpath="$out/async_ckpt" \
        --trainer.callbacks.every_n_train_steps=20 "$@"
}
export -f two_node_fit
export out gpus
step async_save_2nodes 900 bash -c 'two_node_fit 20 && two_node_fit 30 --ckpt_path=last'
