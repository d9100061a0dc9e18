"""`lit-mesh plan`: which mesh (ep too, for an MoE), checkpointing and precision to train a model of a registered
family (the zoo GPT or MoE) with on a given cluster.

families.py     the model families it plans for (the zoo's gpt and moe register themselves): configs, presets, FLOPs
shapes.py       the model's parameters by role, from its ParallelPlan
memory.py       per-rank bytes: exact parameter/gradient/AdamW shards, activations and FSDP buffers by formula
options.py      the vocabularies (dims, precisions, AC modes), free of torch for a fast --help
cost.py         step time in parts: GEMMs by shape, attention, memory-bound ops, recompute, exposed collectives, bubble
calibration.py  the published runs of calibration.yaml against cost.py's one set of kernel constants
search.py       enumerate meshes x AC x precision x micro-batch, keep the valid and fitting, rank, explain
simulate.py     the real plan on meta tensors over torch's fake process group: the bytes one rank truly holds
config_yaml.py  the best plan as a `lit-mesh fit` config
plot.py         the mesh on the nodes and the memory breakdown, as PNGs
command.py      the command line
"""
