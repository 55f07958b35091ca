"""One line per config key saying what it means: the third column of docs/guide/config.md.

Only :func:`hetjax.config.markdown_table` reads this; defaults and validation stay in
``config.py``. A key of ``config.py`` without a line here, or a line for no key, fails
the table (and ``tests/test_docs.py``). Links are relative to ``docs/guide/``.
"""

HELP: dict[str, str] = {
    # -- model ------------------------------------------------------------------------
    "model.family": "model in the zoo (`models/`): `gpt`, `llama`, `t5` (encoder-decoder, "
    "[T5](models.md#t5)) or `custom` ([models](models.md#custom-blocks))",
    "model.num_layers": "shape: the number of stacked blocks (`t5`: the encoder's)",
    "model.num_decoder_layers": "`t5`: the decoder's blocks; 0 means `model.num_layers`",
    "model.d_model": "shape: the model width",
    "model.num_heads": "shape: attention heads; must divide `model.d_model`",
    "model.d_ff": "MLP width; 0 means 4 x d_model",
    "model.vocab_size": "vocabulary size; 256 = byte tokens of the embedded corpus",
    "model.max_seq_len": "longest sequence; `train.seq_len` may not exceed it",
    "model.param_dtype": "master parameters (`float32` only)",
    "model.compute_dtype": "`float32`, `bfloat16` or `float16` (fp16: dynamic loss scaling, "
    "overflowing steps skipped). fp32 is the fast path on CPU, bf16 on GPU",
    "model.init_std": "standard deviation of the normal initialisation of the weights "
    "(`t5` initialises as HF's T5)",
    "model.layer_norm_eps": "epsilon of every norm (LayerNorm for `gpt`, RMSNorm for `llama` "
    "and `t5`; T5 uses 1e-6)",
    "model.remat": "`none` mode: recompute each block in backward (`jax.checkpoint`)",
    "model.attention": "`gpt`, `llama`: `auto` (cuDNN's fused kernel on a GPU in bf16/fp16, "
    "else `blockwise`), `blockwise` (online softmax over tiles: no T x T tensor), "
    "`reference` (the whole score matrix), `fused` (cuDNN); "
    "[attention](models.md#attention). `t5`: `auto` or `reference` (its position bias is "
    "added to the whole score matrix)",
    "model.attention_block": "`blockwise` attention's tile side in tokens; 0 means 256 "
    "(at most `train.seq_len`)",
    "model.num_kv_heads": "`llama`: key/value heads of grouped-query attention; 0 means "
    "`num_heads`",
    "model.rope_theta": "`llama`: rotary embedding base",
    "model.rope_scaling_factor": "`llama`: Llama 3.1 (`llama3`) rotary rescaling, 0 = none; "
    "with `rope_low_freq_factor`, `rope_high_freq_factor`, `rope_original_max_len`",
    "model.rope_low_freq_factor": "`llama3` rotary rescaling: wavelengths above "
    "`rope_original_max_len / rope_low_freq_factor` are stretched by `rope_scaling_factor`",
    "model.rope_high_freq_factor": "`llama3` rotary rescaling: wavelengths below "
    "`rope_original_max_len / rope_high_freq_factor` are kept, those in between interpolated",
    "model.rope_original_max_len": "`llama3` rotary rescaling: the original context length "
    "the two thresholds above divide",
    "model.tie_embeddings": "output head tied to the token embedding (`gpt` always ties)",
    "model.qkv_bias": "`llama`: biases on the query, key and value projections "
    "(Qwen2/Qwen2.5; [models](models.md#llama-shaped-families))",
    "model.qk_norm": "`llama`: an RMSNorm over each query and key head before the rotary "
    "embedding (Qwen3; [models](models.md#llama-shaped-families))",
    "model.sliding_window": "`llama`: a Mistral/Mixtral checkpoint's attention window, 0 = "
    "none; hetjax's attention has no window, so `train.seq_len` and copy are "
    "refused past it ([models](models.md#llama-shaped-families))",
    "model.num_experts": "`llama`: mixture-of-experts MLP of this many SwiGLU experts "
    "(each `d_ff` wide); 0 = the dense MLP ([models](models.md#mixture-of-experts)). "
    "`t5`: Switch's experts in every other layer ([T5](models.md#t5))",
    "model.experts_per_token": "`llama` MoE: experts each token is routed to (top-k of a "
    "softmax router, weights renormalised, dropless); `t5`: 1 (Switch's top-1)",
    "model.router_aux_loss_coef": "MoE: weight of the load-balancing auxiliary loss "
    "(transformers' Mixtral formula; `t5`: Switch's, per stack) added to the training "
    "loss; 0 disables it",
    "model.feed_forward_proj": "`t5`: `gated-gelu` (T5 v1.1) or `relu` (T5 v1.0, Switch)",
    "model.relative_attention_num_buckets": "`t5`: relative position buckets of each stack",
    "model.relative_attention_max_distance": "`t5`: distance from which positions share the "
    "last bucket",
    "model.decoder_start_token": "`t5`: the decoder's first input token (T5's pad id, 0)",
    "model.init_from": "`hf:<dir>`: start from a Hugging Face checkpoint "
    "([models](models.md#hugging-face-checkpoints))",
    "model.custom": "`family=custom`: `package.module:factory` building a user-defined model "
    "([models](models.md#custom-blocks))",
    # -- train ------------------------------------------------------------------------
    "train.steps": "optimizer steps",
    "train.batch_size": "global batch per optimizer step, in sequences",
    "train.seq_len": "tokens per sequence",
    "train.grad_accum": "micro-batches per step (`batch_size` is split evenly; data order "
    "unchanged)",
    "train.eval_every": "also evaluate every N steps (`train.eval_batches` batches; the "
    "validation curve of `loss.png`); 0 = at the end only",
    "train.seed": "random seed of the initial params and of the data order (`data.shuffle`)",
    "train.log_every": (
        "log a line every N steps, with that step's loss and the mean loss since the last "
        "line (`metrics.jsonl` gets every step)"
    ),
    "train.eval_batches": "validation batches at the end of the run",
    "train.loss_scale_init": "fp16 dynamic loss scale: its initial value",
    "train.loss_scale_period": "fp16 dynamic loss scale: steps without overflow before the "
    "scale doubles",
    "train.on_nonfinite": "a step with a non-finite loss or gradient updates nothing; then "
    "`skip` it, `rollback` to the newest checkpoint (skipping the batches up to the bad "
    "one), or `stop` ([checkpoints](checkpoints.md))",
    "train.max_nonfinite": "`skip`/`rollback`: stop after this many non-finite steps in a row",
    "train.spike_factor": "loss-spike guard: a step whose loss exceeds this factor times the "
    "median loss of the last `train.spike_window` updating steps updates nothing and is "
    "handled as a non-finite one (`train.on_nonfinite`); never before the window is full; "
    "0 = off ([checkpoints](checkpoints.md))",
    "train.spike_window": "loss-spike guard: how many updating steps' losses the running "
    "median is taken over",
    "train.trace_every": "record every N-th step's timeline into `<workdir>/trace/` "
    "([timelines](timelines.md)); 0 = off",
    "train.in_memory_steps": "a run that streamed on one device: time this many steps of "
    "the in-memory runtime after it (the whole state on the device, no budgets) as the run "
    "summary's reference step ([running](running.md#the-run-summary); data-parallel runs "
    "skip it); 0 = off",
    # -- optimizer --------------------------------------------------------------------
    "optimizer.name": "`adamw`, `adam`, `lion`, `sgd` (optax)",
    "optimizer.lr": "peak learning rate (see `optimizer.schedule`)",
    "optimizer.weight_decay": "decay on weight matrices and embeddings only",
    "optimizer.b1": "`adam`, `adamw`, `lion`: first-moment decay",
    "optimizer.b2": "`adam`, `adamw`, `lion`: second-moment decay",
    "optimizer.eps": "`adam`, `adamw`: epsilon",
    "optimizer.momentum": "`sgd` only: momentum (0: none)",
    "optimizer.grad_clip": "global-norm clipping, 0 disables",
    "optimizer.warmup_steps": "linear warmup lr*(n+1)/warmup_steps, then `optimizer.schedule`",
    "optimizer.schedule": "after warmup: `constant`, or `cosine` to lr*min_lr_ratio",
    "optimizer.min_lr_ratio": "`cosine`: the final learning rate as a fraction of `lr`",
    "optimizer.mode": "`stream`: `sync` equals ordinary training; `lockfree` runs the "
    "optimizer behind the training loop ([offload](offload.md#the-host-optimizer-loop))",
    "optimizer.max_staleness": "`lockfree`: steps of gradients that may be unapplied while "
    "training goes on",
    "optimizer.speculation": "sync mode: `never` updates after backward, once the global "
    "norm is known (no update is ever dropped: NVMe state can be written in place); with "
    "clipping, `adaptive` updates during backward "
    "unless clipping bound in the step before (then once, after backward); `always` "
    "speculates every step ([offload](offload.md#the-host-optimizer-loop))",
    "optimizer.host_kernel": "the host optimizer's kernel for `adam`/`adamw`: `auto` (native "
    "when it builds, else optax with a warning), `native` (required), `optax` "
    "([offload](offload.md#native-adam-kernel))",
    "optimizer.state_dtype": "the moments' dtype in every tier: `float32`, `bfloat16` (8 "
    "bytes a parameter with the fp32 master, not 12) or `int8` (blockwise, a scale per "
    "2048 of each page: about 6; on NVMe its scales in files of their own); the master "
    "stays fp32",
    # -- offload ----------------------------------------------------------------------
    "offload.mode": "`auto`: `none` when the state fits the device, else the planner's "
    "placement ([planner](planner.md)); `none`: whole state on the device (on a mesh: "
    "replicated, or split by tensor and expert parallelism's rules, "
    "[distributed](distributed.md)), one jitted step (the reference); `stream`: params "
    "on the host, streamed a stage at a time "
    "([offload](offload.md))",
    "offload.params": "`stream`: where the compute-dtype param slabs live: `host` or `nvme`",
    "offload.optimizer": "`stream`: where fp32 master params and optimizer state live: "
    "`host`, `nvme` or `device`",
    "offload.activations": "`stream`: boundary activations on `device`, `host` or `nvme` "
    "(through a few host buffers to a TensorStore array under `memory.nvme_path`; "
    "`offload.mode=stream` only)",
    "offload.prefetch_depth": "`stream`: stages copied to the device ahead of the one computing",
    "offload.keep_blocks": "`stream`: the last N blocks keep their in-block activations on "
    "the device from forward to backward instead of recomputing them",
    "offload.keep_level": "`stream`: which in-block activations those blocks keep: `all`; "
    "`probs` (matmul outputs and attention probabilities, `model.attention=reference` "
    "only; backward recomputes the elementwise ops); `matmuls` (matmul outputs, attention "
    "output and logsumexp; backward recomputes the elementwise ops, and the softmax of "
    "the reference attention) ([offload](offload.md#activation-keeping))",
    "offload.swap_blocks": "`stream`: the N blocks before the kept ones move the in-block "
    "activations of `offload.swap_level` and their input to host memory in forward and "
    "back ahead of backward (Fuyou's activation swapping) instead of recomputing them "
    "([offload](offload.md#activation-swapping))",
    "offload.swap_level": "`stream`: which in-block activations the swapped blocks move: "
    "`matmuls` or `probs`, as `offload.keep_level`",
    "offload.swap_tier": "`stream`: where the swapped blocks' activations go: `host` "
    "(pinned RAM) or `nvme` (through a few host buffers to a TensorStore array under "
    "`memory.nvme_path`, read back ahead of backward)",
    "offload.optimizer_device_stages": "`stream` with `offload.optimizer` `host` or `nvme`: "
    "the first N stages (embed, block 0, 1, ...) keep fp32 master and optimizer state on "
    "the device, are updated there and stay resident; `auto` lets the planner choose "
    "([offload](offload.md#device-cache-of-optimizer-state))",
    "offload.expert_fetch": "`stream`, a Llama-family or T5 mixture of experts (one device, "
    "data, expert or tensor parallelism: each device its pages of them): "
    "`routed` copies a streamed block's experts only once its router has chosen them, "
    "only those with tokens (forward and backward; with `offload.mode=auto` where the "
    "planner predicts a gain); `all` copies every expert with the block "
    "([offload](offload.md#expert-aware-streaming))",
    "offload.expert_updates": "`expert_fetch=routed` with `offload.optimizer=nvme` (sync, "
    "Adam/AdamW): `deferred` leaves the optimizer state of experts without a token on "
    "disk (not read, updated or written) and catches their missed updates up, exactly, "
    "before their next use; `all` updates every expert every step "
    "([offload](offload.md#deferred-expert-updates))",
    "offload.batch_chunks": "`stream`: the recomputed blocks and the head run each "
    "micro-batch in N equal chunks of its rows, one after the other with the stage's "
    "params on the device: one chunk's working set, params still fetched once (not with "
    "kept or swapped blocks, a mixture of experts or T5; `auto` chunks only where the "
    "device needs it) ([offload](offload.md#chunks-of-rows))",
    # -- memory -----------------------------------------------------------------------
    "memory.page_size": "largest page of state slabs (sized in fp32 master elements); "
    "pages shrink to fit a block in whole pages (less padding to move every step)",
    "memory.device_budget": "`stream`: device bytes the runtime may hold, e.g. `512MiB`; "
    "0 = no limit",
    "memory.host_budget": "`stream`: host RAM the runtime's process may hold (param slabs, "
    "gradient buffers, optimizer state or its cache, boundary activations or their NVMe "
    "staging), for all the devices it drives (the planner gives each device of a machine "
    "an equal share); 0 = no limit, and with `offload.optimizer=nvme` no cache",
    "memory.nvme_path": "directory on a local SSD for NVMe state and boundary activations, "
    "or several comma-separated, one per drive (pages stripe over them); empty: "
    "`<workdir>/nvme`",
    "memory.nvme_copies": "copies of the NVMe state and params: `2` (the committed one "
    "and the one a step writes), `1` (written in place: only where no written update can be "
    "dropped, e.g. `optimizer.speculation=never`), `0` auto (1 where that holds)",
    "memory.nvme_tbw": "each drive's rated endurance in terabytes written (0 = unknown): "
    "`--plan` and the run summary give the bytes a day and the fraction of drive life a run "
    "of `train.steps` consumes",
    "memory.nvme_wear_budget": "the fraction of the drives' life a run of `train.steps` may "
    "consume (needs `memory.nvme_tbw`; 0 = no limit): the planner (`offload.mode=auto`, "
    "`--plan`) refuses a run over it and prefers placements that write less; the run "
    "summary flags a measured excess",
    "memory.device_fraction": "of each accelerator's memory JAX may take "
    "(`XLA_CLIENT_MEM_FRACTION`, set by the launcher; JAX alone takes 0.75); the "
    "planner plans within it",
    # -- data -------------------------------------------------------------------------
    "data.path": "empty: embedded corpus; else a uint16 `.bin` (nanoGPT format) or 1-D `.npy`",
    "data.shuffle": "see [data order](running.md#data-order)",
    "data.val_fraction": "held-out tail of the token stream",
    "data.corpus_bytes": "embedded corpus size",
    "data.objective": "`lm` (windows of T+1, next-token; decoder-only models), `prefix_lm` "
    "(windows of 2T: the encoder reads the first T, the decoder predicts the next T; "
    "`t5`) or `span_corruption` (T5's: the encoder reads T tokens with a sentinel per "
    "dropped span, the decoder predicts the spans; `t5`); see "
    "[data order](running.md#data-order)",
    "data.noise_density": "`span_corruption`: the share of a window's tokens dropped from "
    "the encoder's input and predicted by the decoder",
    "data.mean_noise_span": "`span_corruption`: the mean length of the dropped spans",
    "data.format": "`tokens`: `data.path` is a token file (or empty: the embedded corpus); "
    "`jsonl`: prompt/completion, chat `messages` or `text` records packed into rows, the "
    "loss on completions only (T5 with `data.objective=prefix_lm`: packed on both sides, "
    "the prompts the encoder's; [instruction data](models.md#instruction-data))",
    "data.tokenizer": "`jsonl`: a `tokenizer.json` or the checkpoint directory holding it; "
    "empty: the `model.init_from` directory's `tokenizer.json` when it has one, else bytes",
    # -- checkpoint -------------------------------------------------------------------
    "checkpoint.every_steps": "complete-state checkpoint every N steps; 0: none periodic",
    "checkpoint.every_minutes": "also a checkpoint when this many minutes have passed since "
    "the last one (checked between steps); 0: none by time",
    "checkpoint.at_end": "a checkpoint when training ends",
    "checkpoint.keep": "complete checkpoints kept",
    "checkpoint.dir": "empty: `<workdir>/checkpoints`",
    "checkpoint.resume": "`auto`: continue from the newest complete checkpoint; `never`: "
    "start fresh (refuses if checkpoints exist, unless `checkpoint.overwrite`); also "
    "`--resume=`",
    "checkpoint.overwrite": "with `resume=never`, delete existing checkpoints (also `--overwrite`)",
    "checkpoint.async_save": "persist in the background (false: the step waits for the write)",
    "checkpoint.link_nvme": (
        "hard-link the NVMe tier's committed files into checkpoints (false: copy them); a "
        "hard-linked checkpoint shares the live files' blocks on disk: no second copy"
    ),
    "checkpoint.copy_every": "with `link_nvme`: every K-th checkpoint of a run (the first, "
    "the K+1-th, ...) streams a real copy of the NVMe state, a window at a time within the "
    "host budget, each page checked against its live checksum; the others hard-link; "
    "0 = never ([checkpoints](checkpoints.md))",
    # -- distributed ------------------------------------------------------------------
    "distributed.data_parallel": "ZeRO-3 data-parallel degree (`offload.mode=stream`): "
    "devices sharing every stage's pages; 1 = none, 0 = every device of every process "
    "([distributed](distributed.md))",
    "distributed.expert_parallel": "devices a mixture-of-experts model's experts are split "
    "over (each holds `model.num_experts` / N of every block's experts; tokens move by "
    "all-to-all), times `data_parallel` devices in all; 1 = none "
    "([distributed](distributed.md#expert-parallelism))",
    "distributed.tensor_parallel": "devices each block's compute is split over (Megatron's "
    "split by heads and MLP units, from the models' logical axes; the `model` mesh axis), "
    "composed with ZeRO-3 over `distributed.data_parallel` (and `expert_parallel`: a "
    "data x expert x model mesh) ([distributed](distributed.md#tensor-parallelism))",
    "distributed.reduce_dtype": "`float32`: block gradients are reduce-scattered in fp32; "
    "`compute`: in the compute dtype where it is bf16 and the gradient leaves the device "
    "in it (one micro-batch, sync mode): half the bytes on the wire and to the host, the "
    "sum over devices rounded to bf16 ([distributed](distributed.md))",
    "distributed.coordinator": "`host:port` of process 0; empty: `HETJAX_COORDINATOR`, else "
    "the first SLURM node",
    "distributed.num_processes": "0: from `HETJAX_NUM_PROCESSES`, else `SLURM_NTASKS`, else "
    "one process",
    "distributed.process_id": "-1: from `HETJAX_PROCESS_ID`, else `SLURM_PROCID`, else one process",
    "distributed.timeout_s": "seconds to wait for every process at start-up, and after which "
    "a silent (dead) process stops the others",
}
