"""What things cost: the measured rates and shares the pool and its planner price their choices with.

One value per quantity, each with where it was measured. Tuning limits (sample counts, caches, scan
lengths) stay beside the code they limit; what is here is a price someone measured, and the place to
change it when a card measures otherwise.
"""

# ---------------------------------------------------------------- copies

# Device to pinned host memory where the probe cannot run (treatments.link_rate probes the link once a
# process). H100/H200 links measured 54-55 GB/s; a plan made before any copy priced them at this.
GPU_LINK_BYTES_PER_S = 25e9
CPU_COPY_BYTES_PER_S = 5e9  # host memcpy (the CPU device's "offload")
GPU_MEMORY_BYTES_PER_S = 2e12  # device-to-device copies (H200: 4.2 TB/s read+write)

# What a copy running beside compute costs the step, as a share of the copy's own seconds, as the planner
# prices it. A first H100 run measured 8% (docs/design.md#copy-interference); bench train on an H100 (GPT-24
# at 75% of native's peak, planned) measured about 35%: 2.52 GiB out and back per step (100 ms of copies at
# 54 GB/s, 17 ms of it waited for) cost about 50 ms more than recomputing the same bytes would have
# (cost_aware, same run). Plain copies beside the same step cost it far less (tools/diag/copy_interference.py,
# H100: 0.5 and 1 GiB out during the forward, and back during the backward, 0.03-0.06 of their seconds): the
# rest is the pool's own work around its copies. Planned at 0.05 instead (H100, one process, each plan's
# steps interleaved with native's), ResNet-152 offloaded more and lost: at 75% 1.21x against 1.13x, at 50%
# 1.95x against 1.34x; GPT-24 at 75% and 60% made the same plans.
COPY_INTERFERENCE = 0.35
# The same quantity as the reactive policies (cost_aware) price an offload with: the first H100 run's 8%
# (docs/design.md#copy-interference), where a step slowed that much with copies running beside it. Kept
# apart from the planner's: the reactive choices were measured with it, and raising it moves cost_aware
# toward recompute.
REACTIVE_COPY_INTERFERENCE = 0.08

# ---------------------------------------------------------------- the host's side of a step

# The share of the backward's device seconds the host is free (GPU): a region's replay there is priced
# by its kernels' seconds until the host seconds of the replays pass that slack. Its timed replay, the
# larger of its kernels and its launches, overprices a block replayed in backward, whose launches run
# ahead of the backward's kernels: on an H100 (reentrant checkpoint of every block, against native)
# ResNet-152's 51 blocks were priced at 64 ms and cost 25-37 ms (their forward's kernels: 28), GPT-24's
# 24 at 30 ms and cost 16-21 (kernels: 19-21).
BACKWARD_HOST_FREE = 0.5

# What a save the plan keeps costs the host through the pool (its save, unpack and release), as a share
# of what making an entry took in the recorded step (Profile.entry_s): tiny GPT-24 on a CPU 6.5 + 1.8 +
# 1.25 us against 7.8.
KEPT_SHARE = 1.2

# What a saved tensor costs the host through the pool (its entry, unpack and release) where no pool ran to
# measure it: `report --budget` plans from a step traced without one. The live pool's own measure of an
# entry's making (Profile.entry_s), H200 host, autocast bf16: 39 us on timm ResNet-50, 45 us on an HF
# Llama; times KEPT_SHARE for the rest.
SAVE_HOST_PRIOR_S = KEPT_SHARE * 40e-6

# What a drop and its rebuild cost the host in a lean call (lean_call.py), as a share of what they cost
# through the pool (an entry, a pool rebuild): tiny GPT-24 on a CPU, a plan's drops run either way, 41
# and 60 us a drop against 78 and 104 (kernels included).
LEAN_SHARE = 0.5

# What each save of a call run lean costs the host, its pack and unpack hooks, as a share of a kept
# save's through the pool (Profile.kept_s); a bypassed call's saves cost none. On an H100 a plan running
# 24 GPT-24 blocks lean to drop their GELU outputs was priced at +2.5 ms without it and took +12.2
# (1.17x native at 13.67 GiB, where checkpointing the first 6 blocks took 1.08x at 13.52): ~15 saves a
# block, ~27 us each against kept_s's 53.
LEAN_KEPT_SHARE = 0.5

# ---------------------------------------------------------------- light calls' CUDA graphs

# Modules of one structure run light before their backward is graphed (light_graphs.py). On H100s,
# ResNet-152 with 7 a step (at 75% of its peak) gained nothing (1.21x and 1.25x native against 1.22x
# eager), and the graphs' static tensors (162 or 312 MB), which the plan does not hold, took the step
# over its budget: the shape was planned again 0.15 and 0.30 GiB lower. With 22 and 35 (50%,
# checkpoint's peak) the graphs gained 0.08-0.36x.
LIGHT_GRAPHS_MIN_CALLS = 16
# Of the budget (of the device without one): the graphed structures' static tensors.
LIGHT_GRAPHS_MAX_SHARE = 0.05

# ---------------------------------------------------------------- ReLU compression, before it is timed

PACKED_RATIO_PRIOR = 0.55  # packed / tensor bytes before any pack: half zeros, plus the bitmap
PRIOR_PASSES = 4  # pack reads the tensor twice and unpack writes it: about 4 passes over its bytes
# Host seconds of an exact pack on a GPU before one was measured: it reads its count back, a host sync
# that drains the GPU's queue. On an H100 a plan packing ~30 of ResNet-152's ReLU outputs a step ran
# ~1.6 ms a pack slower than one that packed none (a replan included: a rough prior, not a measurement).
EXACT_PACK_PRIOR_S = 1e-3
