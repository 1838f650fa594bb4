"""Every option of a plan and of the app, once: its name (the `TrainingPlan` field; `--name` on the command line and
`name` in a share link, with dashes), type, default, bounds, help text (what it does to memory), where it has a
meaning, how a link carries it and the app's widget for it.

Made from `OPTIONS`: `TrainingPlan`'s fields and their checks (`llmem.plan`), the command line (`llmem.cli`), the
share-link codec and its repair (`llmem.share`), the app's widgets and their link sync (`llmem.widgets`, `app.py`),
the help texts (`llmem.help`), the validation suite's plan fields (`llmem.measure.validate`) and the sweep's choices
(`llmem.sweep.draw`). A new option is one row here plus its formula.
"""

from __future__ import annotations

from llmem import choices as c
from llmem.optiontypes import (
    ALL_LINEAR,
    ARGUMENT,
    CHECK,
    COMMAND,
    NEVER,
    NO_CLI,
    NUMBER,
    SELECT,
    SPECIAL,
    TEXT,
    WHEN_SET,
    Needs,
    Option,
    Widget,
    link_gpu,
    link_methods,
    link_model,
    link_upload,
    parse_lora_targets,
    parse_modules_to_save,
)

ALL = "all"  # the app's zero=all: compare every strategy for the GPU count and show the recommended one
MAX_TOKENS = 1 << 24
MAX_APP_GPUS = 4096
MAX_APP_BATCH = 4096
MAX_APP_CKPT_EVERY = 1024
MAX_APP_LORA_RANK = 4096
MAX_APP_LORA_ALPHA = 1 << 16
MAX_APP_GRAD_ACCUM = 1024
MAX_APP_LOSS_CHUNKS = 1024
DS_REDUCE_BUCKET = 500_000_000  # DeepSpeed's reduce_bucket_size default (runtime/zero/config.py)
MAX_DS_BUCKET = 1 << 40
DS_PREFETCH_BUCKET = 50_000_000  # stage3_prefetch_bucket_size (runtime/zero/config.py:215)
DS_PERSISTENCE_THRESHOLD = 100_000  # stage3_param_persistence_threshold (runtime/zero/config.py:221)

_LORA = Needs("method", ("lora", "qlora"))

# The app's sidebar groups, in order (`Widget.group`; `llmem.ui.edits.GROUPS` lists each one's options in table order)
G_MODEL, G_HARDWARE, G_BATCH, G_PRECISION, G_METHOD, G_SAVERS = GROUP_TITLES = (
    "Model", "Hardware", "Batch", "Precision & optimizer", "Method", "Memory savers")

OPTIONS: tuple[Option, ...] = (
    Option("model", str, None,
           "A preset name (e.g. llama-3.1-8b), a path to a config.json, or a Hugging Face model id (online).",
           plan=False, cli=ARGUMENT, parse=link_model, app_default="llama-3.1-8b",
           widget=Widget("Model", "w_source", SPECIAL, group=G_MODEL)),
    Option("gpu_type", str, None,
           "GPU model: sets the memory capacity for the fits/OOM verdict.",
           plan=False, cli=COMMAND, parse=link_gpu, app_default="a100-80gb",
           widget=Widget("GPU type", "w_gpu", SPECIAL, group=G_HARDWARE)),
    Option("gpus", int, 1,
           "GPUs in the job. Data parallelism replicates the model; ZeRO/TP divide parts of it by this count.",
           low=1, high=MAX_APP_GPUS, widget=Widget("GPU count", "w_gpus", NUMBER, group=G_HARDWARE)),
    Option("tp", int, 1,
           "Tensor-parallel degree: splits attention heads and the MLP width over this many GPUs, dividing the "
           "layers' weights, gradients, optimizer states and most activations. Must divide the GPU count and heads.",
           low=1, high=MAX_APP_GPUS, widget=Widget("Strategy", "w_strategy", SPECIAL)),
    Option("zero", int, 0,
           "ZeRO stage. 0: DDP (full replica + gradient buckets). 1: shards optimizer states. 2: FSDP2 (FSDP1's "
           "SHARD_GRAD_OP with --engine fsdp1) shards parameters, gradients and states, keeps gathered layers until "
           "backward. 3: re-gathers each layer (FSDP1: FULL_SHARD). With "
           "lora/qlora there is little to shard (a frozen base, small adapters), so ZeRO-2 — the base's shards plus "
           "every layer kept gathered until backward — can sit above ZeRO-0/1's one whole copy.",
           app_default=ALL, widget=Widget("Strategy", "w_strategy", SPECIAL, group=G_HARDWARE)),
    Option("pp", int, 1,
           "Pipeline-parallel degree (torch.distributed.pipelining, one stage per GPU; --gpus a multiple of it puts "
           "DDP, or FSDP2 with --zero 3, over each stage's gpus / pp GPUs, torchtitan's 2-D layout): each GPU "
           "holds only its stage's layers (stage 0 also the embedding, the last the final norm, lm_head and loss) "
           "with their gradients and optimizer states, but keeps the activations of every microbatch in flight: "
           "GPipe all of them, 1F1B pp - stage; the first stage is usually the worst.",
           low=1, high=MAX_APP_GPUS, link=WHEN_SET, compared=False,
           widget=Widget("Pipeline stages (pp)", "w_pp", NUMBER, group=G_HARDWARE)),
    Option("pp_schedule", c.PpSchedule, c.PpSchedule.ONE_F_ONE_B,
           "With --pp: gpipe (ScheduleGPipe) runs every microbatch's forward before any backward, so each stage "
           "holds all --microbatches sets of activations; 1f1b (Schedule1F1B, torchtitan's default) holds at most "
           "pp - stage of them (needs --microbatches >= pp); interleaved-1f1b (ScheduleInterleaved1F1B) gives each "
           "GPU --pp-stages-per-rank smaller stages, so more microbatches are in flight (2 per hop to the last GPU, "
           "plus a round per extra stage) and every send is held until the step ends.",
           link=WHEN_SET, compared=False,
           widget=Widget("Pipeline schedule", "w_pp_schedule", SELECT, group=G_HARDWARE)),
    Option("pp_stages_per_rank", int, 2,
           "With --pp-schedule interleaved-1f1b: pipeline stages per GPU (torchtitan's default for a looped schedule, "
           "2, when pipeline_parallel_layers_per_stage is unset): the layers are split into pp × this stages, GPU i "
           "runs stages i, i + pp, ...; each holds the parameters, gradients and states of its own stages.",
           low=2, high=MAX_APP_GPUS, link=WHEN_SET, compared=False,
           needs=Needs("pp_schedule", ("interleaved-1f1b",), "{value} stages per GPU go with --pp-schedule "
                       "interleaved-1f1b"),
           widget=Widget("Pipeline stages per GPU", "w_pp_stages_per_rank", NUMBER, group=G_HARDWARE)),
    Option("microbatches", int, 1,
           "With --pp: the microbatches the schedule splits --batch-size into (torchtitan's local_batch_size / "
           "pipeline_parallel_microbatch_size); activations in flight are counted per microbatch, and each stage "
           "after the first keeps a receive buffer and an input gradient per microbatch.",
           low=1, high=MAX_APP_BATCH, link=WHEN_SET, compared=False,
           widget=Widget("Pipeline microbatches", "w_microbatches", NUMBER, group=G_HARDWARE)),
    Option("cp", int, 1,
           "Context-parallel degree (PyTorch's ring attention, torch.distributed.tensor.experimental.context_parallel,"
           " as torchtitan and the HF Trainer run it, with FSDP2 --zero 2/3 sharding over all --gpus): each group "
           "of cp GPUs splits every sequence into cp shards, so every activation, the logits and the loss hold "
           "seq_len / cp tokens per GPU; attention all-gathers the group's keys and values (cp shards of them) for "
           "the layer running, and its backward adds fp32 query/key/value gradient accumulators.",
           low=1, high=MAX_APP_GPUS, link=WHEN_SET, compared=False,
           widget=Widget("Context parallelism (cp)", "w_cp", NUMBER, group=G_HARDWARE)),
    Option("batch_size", int, 1,
           "Micro-batch per GPU. Activations and logits grow linearly with it. With --pp: the step's batch of the "
           "pipeline, split into --microbatches.",
           low=1, high=MAX_APP_BATCH, widget=Widget("Micro-batch per GPU", "w_batch", NUMBER, group=G_BATCH)),
    Option("seq_len", int, 2048,
           "Tokens per sequence. Activations and logits grow linearly (eager attention: quadratically).",
           low=1, high=MAX_TOKENS, widget=Widget("Sequence length (tokens)", "w_seq", NUMBER, step=256, group=G_BATCH)),
    Option("precision", c.Precision, c.Precision.BF16_MIXED,
           "fp32: 4-byte everything. bf16/fp16: pure half (2-byte weights, gradients, optimizer states). "
           "bf16-mixed/fp16-mixed: fp32 weights and optimizer states, half-precision activations (autocast); "
           "with --method qlora the 4-bit Linears compute in the half dtype and return their input's fp32.",
           widget=Widget("Precision", "w_precision", SELECT, group=G_PRECISION)),
    Option("optimizer", c.Optimizer, c.Optimizer.ADAMW,
           "adamw keeps two states per parameter (2× weights); sgd with momentum keeps one. adafactor (torch) keeps "
           "only a row and a column vector per weight matrix (a full vector for 1-D weights), no first moment; its "
           "default for-loop step briefly holds two weight-sized temporaries. adamw8bit (bitsandbytes) keeps both "
           "states in 1 byte per parameter plus an fp32 scale per 256 (tensors under 4096 elements: fp32 states). "
           "paged-adamw8bit: the same, but on CUDA states of tensors with at least 100k elements live in unified "
           "memory outside PyTorch's allocator (shown apart; the driver can page them to host RAM). The three run on "
           "one GPU, DDP and ZeRO-1.",
           fallback=True, widget=Widget("Optimizer", "w_optimizer", SELECT, group=G_PRECISION)),
    Option("optimizer_impl", c.OptimizerImpl, c.OptimizerImpl.DEFAULT,
           "default = what torch picks (foreach on CUDA, for-loop on CPU). foreach adds one temporary copy of all "
           "parameters during step(); for-loop two copies of one tensor beside the previous one's denominator; "
           "fused none.",
           fallback=True, widget=Widget("Optimizer implementation", "w_impl", SELECT, group=G_PRECISION)),
    Option("grad_ckpt", c.GradCkpt, c.GradCkpt.NONE,
           "full: keep only each layer's input and recompute the layer in backward (activations shrink to one "
           "hidden-size tensor per layer, at about one extra forward of compute). selective: torchtitan's op-level "
           "policy, each layer keeps its input, every other matmul's output and the attention output and recomputes "
           "the rest (between none and full).",
           widget=Widget("Activation checkpointing", "w_ckpt", SELECT, group=G_SAVERS)),
    Option("ckpt_every", int, 1,
           "With --grad-ckpt full: checkpoint only every K-th decoder layer (layers 0, K, 2K, …); the others keep all"
           " their activations. K = 1 checkpoints every layer. Larger K: more memory, less recompute.",
           low=1, high=MAX_APP_CKPT_EVERY, link=WHEN_SET,
           needs=Needs("grad_ckpt", ("full",), "{value} needs grad-ckpt full"),
           widget=Widget("Checkpoint every K-th layer", "w_ckpt_every", NUMBER, group=G_SAVERS)),
    Option("attn", c.Attention, c.Attention.SDPA,
           "sdpa: fused attention keeps no seq×seq matrices. eager: keeps scores and probabilities, heads × seq² per "
           "sequence per layer.",
           widget=Widget("Attention", "w_attn", SELECT, group=G_SAVERS)),
    Option("device", c.Device, c.Device.CUDA,
           "Kernel profile the estimate follows: cuda (default) or cpu (to check against CPU measurements).",
           link=NEVER),
    Option("method", c.Method, c.Method.FULL,
           "full: train every weight. lora: PEFT LoRA adapters on a frozen base — no gradients or optimizer states "
           "for the base, fp32 adapters get both. Not fewer activations: the layers save about what full fine-tuning "
           "saves, and each adapted Linear keeps its own copy of its input for lora_A (fp32 under pure bf16/fp16, as "
           "PEFT keeps adapters in fp32; a half cast under autocast; its dropout output with --lora-dropout), so "
           "where activations dominate (long sequences, small models, sgd) lora can sit above full. qlora: the same "
           "adapters over a base whose Linears are stored 4-bit or 8-bit by bitsandbytes (choose --quant); 4-bit on "
           "one GPU, DDP (--zero 0) or ZeRO-1 (--zero 1), every GPU holding the whole base, or FSDP2 (--zero 2/3), "
           "which shards the packed 4-bit codes and all-gathers them as bytes with the adapters (the fp32 scales stay"
           " whole on every GPU); int8 on one GPU (TP with a quantized base is not modelled).",
           link=WHEN_SET, widget=Widget("Fine-tuning method", "w_method", SELECT, group=G_METHOD)),
    Option("lora_rank", int, 16,
           "LoRA rank r: each adapted Linear (in → out) adds r × (in + out) trainable parameters.",
           low=1, high=MAX_APP_LORA_RANK, link=WHEN_SET,
           needs=_LORA,
           widget=Widget("LoRA rank", "w_lora_rank", NUMBER, group=G_METHOD)),
    Option("lora_alpha", int, 32,
           "LoRA alpha (scaling = alpha / r); no effect on memory.",
           low=1, high=MAX_APP_LORA_ALPHA, link=WHEN_SET,
           needs=_LORA,
           widget=Widget("LoRA alpha", "w_lora_alpha", NUMBER, group=G_METHOD)),
    Option("lora_dropout", float, 0.05,
           "Dropout on each adapted Linear's input: with p > 0 each keeps its own dropout output and mask for "
           "backward.",
           low=0.0, high=0.99, link=WHEN_SET,
           needs=_LORA,
           widget=Widget("LoRA dropout", "w_lora_dropout", NUMBER, step=0.05, group=G_METHOD)),
    Option("lora_targets", str, ALL_LINEAR,
           "all-linear (every Linear but the output layer) or PEFT module names, e.g. q_proj,v_proj or "
           "gate_proj,up_proj,down_proj (the same Linears in every layer). Layer 0 saves activations only from its "
           "first adapted Linear on.",
           parse=parse_lora_targets, link=WHEN_SET,
           needs=_LORA,
           widget=Widget("LoRA target modules", "w_lora_targets", TEXT, group=G_METHOD)),
    Option("lora_modules_to_save", str, "",
           "PEFT modules_to_save with lora/qlora: comma-separated module names (lm_head, embed_tokens) trained in "
           "full beside the adapters. Each gets a trainable copy in the model's dtype (the frozen original stays) "
           "with its own gradient and optimizer states; a trainable lm_head keeps its input for the weight gradient, "
           "a trainable embedding makes a dense vocab × hidden gradient. Empty = none. Not with tied embeddings or "
           "FSDP2.",
           parse=parse_modules_to_save, link=WHEN_SET, fallback=True,
           needs=Needs("method", ("lora", "qlora"), "trainable module copies go with --method lora/qlora"),
           widget=Widget("LoRA modules to save (trained in full)", "w_lora_mts", TEXT, group=G_METHOD)),
    Option("lora_adapter_dtype", c.LoraAdapterDtype, c.LoraAdapterDtype.FP32,
           "With lora on a pure bf16/fp16 base: fp32 (PEFT's default, autocast_adapter_dtype=True) upcasts the "
           "adapters, so they, their gradients and optimizer states take 4 bytes per element; base "
           "(autocast_adapter_dtype=False, as torchtune and FSDP-QLoRA run) leaves them in the base's 2-byte dtype, "
           "and lora_A saves the shared half input instead of an fp32 copy per Linear. No effect under fp32 or "
           "mixed precision (an fp32 base).",
           link=WHEN_SET, needs=_LORA,
           widget=Widget("LoRA adapter dtype", "w_lora_dtype", SELECT, group=G_METHOD)),
    Option("quant", c.Quant, c.Quant.NONE,
           "Storage of the frozen base under --method qlora (bitsandbytes): nf4 or fp4 = 4-bit codes (half a byte per"
           " weight) plus one fp32 scale per 64 weights; each Linear is dequantized to the compute dtype while it "
           "runs. int8 = LLM.int8 (load_in_8bit): 1 byte per weight plus one fp32 scale per output row; each 8-bit "
           "Linear also keeps its input until the step ends (more activation memory in backward), and on CUDA "
           "quantizes its input to int8 with an int32 product. none for full/lora.",
           needs=Needs("method", ("qlora",), "{value} is the quantized base of --method qlora, not of {other}"),
           widget=Widget("QLoRA quantized base", "w_quant", SELECT, group=G_METHOD)),
    Option("double_quant", bool, False,
           "With --method qlora --quant nf4/fp4: bitsandbytes' double quantization (bnb_4bit_use_double_quant): each "
           "block of 64 weights keeps a 1-byte scale instead of a 4-byte one (plus one fp32 scale per 256 blocks): "
           "about 0.37 bits less per weight.",
           link=WHEN_SET,
           needs=Needs("quant", ("nf4", "fp4"), "double quantization goes with a 4-bit qlora base (--quant nf4/fp4)"),
           widget=Widget("Double quantization (4-bit base)", "w_dq", CHECK, group=G_METHOD)),
    Option("grad_accum", int, 1,
           "Micro-steps per optimizer step: gradients stay alive through the later micro-steps' forward and backward,"
           " so the peak grows by about one gradient copy (per GPU: its share of them). On more GPUs every micro-step"
           " synchronizes (DDP/ZeRO-1 all-reduce, ZeRO-2/3 reduce-scatter into the sharded gradients) unless "
           "--no-sync.",
           low=1, high=MAX_APP_GRAD_ACCUM, link=WHEN_SET,
           widget=Widget("Gradient accumulation (micro-steps)", "w_grad_accum", NUMBER, group=G_BATCH)),
    Option("no_sync", bool, False,
           "With --grad-accum > 1 on several GPUs (DDP, ZeRO-1, FSDP2 ZeRO-2/3, --engine fsdp1): the first K-1 "
           "micro-steps run without synchronizing, as accelerate's accumulate() and the HF Trainer do (DDP/FSDP1 "
           "no_sync(), FSDP2 set_requires_gradient_sync(False)); under FSDP each GPU then keeps every layer's "
           "unsharded gradient (FSDP2 in the reduce dtype) until the last micro-step, a whole model's gradients "
           "instead of its share.",
           link=WHEN_SET,
           needs=Needs("gpus", repair="on one GPU there is nothing to synchronize", at_least=2),
           widget=Widget("Accumulate without syncing (no_sync)", "w_no_sync", CHECK, group=G_BATCH)),
    Option("offload", c.Offload, c.Offload.NONE,
           "optimizer+params: FSDP2 CPUOffloadPolicy (--zero 2/3) keeps sharded weights, gradients and optimizer "
           "states in pinned host memory and steps the optimizer on the CPU; the GPU keeps only gathered layers, "
           "unsharded gradients, buffers and activations. Host RAM is shown separately. optimizer (one GPU): "
           "torchao's CPUOffloadOptimizer, the single-GPU form of DeepSpeed's ZeRO-Offload: AdamW/SGD states and a "
           "pinned copy of each weight and gradient live on the host and the step runs on the CPU; gradients leave "
           "the GPU as they are made (with --grad-accum 1). Tensors under 4096 elements stay on the GPU.",
           fallback=True, compared=False, cuda_only=True,
           widget=Widget("Offload to host memory", "w_offload", SELECT, group=G_SAVERS)),
    Option("loss", c.Loss, c.Loss.STANDARD,
           "fused-linear-ce: Liger-Kernel's fused linear cross-entropy (CUDA only) never materializes the logits: "
           "chunks of tokens compute logits, loss and gradients in the forward, keeping the hidden gradient and an "
           "lm_head-sized weight gradient instead of tokens × vocab logits. chunked-ce: torchtune's "
           "CEWithChunkedOutputLoss in eager mode (no torch.compile, which would fuse each chunk's fp32 upcast and "
           "log_softmax): the lm_head and the fp32 cross-entropy run per chunk of the sequence (--loss-chunks), so "
           "only one chunk's fp32 upcast exists at a time and the logits are freed before backward; every chunk's "
           "fp32 log_softmax output is still saved for backward.",
           fallback=True, compared=("standard", "chunked-ce"),
           widget=Widget("Loss", "w_loss", SELECT, group=G_SAVERS)),
    Option("loss_chunks", int, 8,
           "With --loss chunked-ce: the chunks of the sequence (torchtune's num_output_chunks); more chunks shrink "
           "the one chunk's fp32 upcast and loss gradients alive at a time, but summing the chunks' lm_head weight "
           "gradients briefly holds two more copies of it (2+ chunks).",
           low=1, high=MAX_APP_LOSS_CHUNKS, link=WHEN_SET,
           needs=Needs("loss", ("chunked-ce",), "{value} loss chunks go with --loss chunked-ce"),
           widget=Widget("Loss chunks (chunked-ce)", "w_loss_chunks", NUMBER, group=G_SAVERS)),
    Option("fsdp_shard", c.FsdpShard, c.FsdpShard.DIM0,
           "Which dim FSDP2 (--zero 2/3) shards each tensor on. dim0 (FSDP2's default) pads dim 0 to a multiple of "
           "the GPUs, so a tensor with fewer rows than GPUs (a MoE's stacked experts: one row per expert) is stored "
           "at 1/rows instead of 1/GPUs and gathered padded. dim1-if-short passes fully_shard(shard_placement_fn=...)"
           " returning Shard(1) for such tensors when dim 1 divides evenly (FSDP2 requires it): exact 1/GPUs shards, "
           "at the cost of a copy of those tensors in each all-gather's copy-out. No effect on DDP, ZeRO-1 or TP.",
           link=WHEN_SET, widget=Widget("FSDP2 shard dim (ZeRO-2/3)", "w_fsdp_shard", SELECT, group=G_SAVERS)),
    Option("ddp_bucket_view", bool, False,
           "DDP and ZeRO-1 (--zero 0/1 on several GPUs): DistributedDataParallel(gradient_as_bucket_view=True). Each "
           ".grad becomes a view into the Reducer's gradient buckets instead of a tensor of its own, so the "
           "gradients stop costing a second copy beside the buckets. No effect on one GPU, ZeRO-2/3 or TP.",
           link=WHEN_SET, widget=Widget("DDP gradients as bucket views", "w_bucket_view", CHECK, group=G_SAVERS)),
    Option("keep_grads", bool, False,
           "optimizer.zero_grad(set_to_none=False) (torch's default before 2.0): the gradients are zeroed in place "
           "instead of freed, so they stay allocated through the next forward and backward, as in the later "
           "micro-steps of --grad-accum; the peak grows by about one gradient copy (per GPU: its share of them).",
           link=WHEN_SET,
           widget=Widget("Keep gradients between steps (set_to_none=False)", "w_keep_grads", CHECK, group=G_SAVERS)),
    Option("alloc_conf", c.AllocConf, c.AllocConf.DEFAULT,
           "The CUDA caching allocator's setting (PYTORCH_CUDA_ALLOC_CONF): default segments, or expandable-segments "
           "(expandable_segments:True: each stream's pool is one segment growing by 20 MiB pages, any freed page "
           "serves any later request), which lowers the high end of reserved memory and the device total. No effect "
           "on the peak (max_memory_allocated) or on the CPU profile.",
           link=WHEN_SET,
           widget=Widget("CUDA allocator (PYTORCH_CUDA_ALLOC_CONF)", "w_alloc_conf", SELECT, group=G_SAVERS)),
    Option("optimizer_in_backward", bool, False,
           "torchtune's optimizer-in-backward: one optimizer per parameter, stepped by its post-accumulate-grad hook "
           "during backward and its gradient freed right after, so the gradients never coexist (the peak loses about "
           "the gradients made before it) while one tensor's step temporaries join backward's peak.",
           link=WHEN_SET,
           widget=Widget("Optimizer step in backward (per-parameter)", "w_optim_bwd", CHECK, group=G_PRECISION)),
    Option("float8", c.Float8, c.Float8.NONE,
           "torchao float8 training of the decoder layers' Linears (torchtitan's filter: not lm_head, both dims "
           "divisible by 16), bf16 compute: the weights, gradients, states and saved activations stay bf16 (torchao "
           "saves each Linear's bf16 input, not an fp8 cast), but every cast of an input, weight or output gradient to "
           "fp8 briefly holds two fp32 copies of it, so the peak rises by about 9 bytes per element of the largest "
           "Linear input (the MLP's down projection in backward), without torch.compile, which fuses those casts.",
           link=WHEN_SET, fallback=True,
           widget=Widget("Float8 Linears (torchao)", "w_float8", SELECT, group=G_PRECISION)),
    Option("activation_offload", bool, False,
           "torchtune's activation offloading (OffloadActivations around the model's forward, the output projection "
           "opted out by NoOpManager): every saved activation of 1 KiB or more is copied to pinned host memory, so the "
           "GPU keeps only the small ones, the last five copied still in flight, the lm_head's input and the loss's, "
           "and in backward the tensors of the node running and the one before it (host RAM shown separately).",
           link=WHEN_SET, cuda_only=True,
           widget=Widget("Offload activations to host memory (torchtune)", "w_act_offload", CHECK, group=G_SAVERS)),
    Option("upload", str, "",
           "Display name of an uploaded config.json; the file itself never travels in a link.",
           plan=False, cli=NO_CLI, parse=link_upload, link=WHEN_SET),
    Option("methods", str, "",
           "Other fine-tuning methods to show beside the chosen one, comma-separated (lora, qlora, full, "
           "offload-optimizer, offload-params): each runs on the same GPU count where it can (qlora: DDP, ZeRO-1 and "
           "FSDP2 ZeRO-2/3), else on one GPU (qlora: nf4 base in bf16; offload-optimizer: full fine-tuning with "
           "torchao's optimizer offload on one GPU; offload-params: full fine-tuning with FSDP2 CPU offload, ZeRO-2/3"
           " on 2+ GPUs; chunked-ce and optimizer-in-backward: the plan with that memory saver on, beside it "
           "without). The recommendation stays with the chosen method.",
           plan=False, cli=COMMAND, parse=link_methods, link=WHEN_SET,
           widget=Widget("Also compare methods", "w_methods", SPECIAL, group=G_METHOD)),
    Option("engine", c.Engine, c.Engine.TORCH,
           "The training engine whose program is estimated. torch: PyTorch's DDP, ZeroRedundancyOptimizer, FSDP2 "
           "(fully_shard), DTensor TP. fsdp1: PyTorch's FullyShardedDataParallel as accelerate and the HF Trainer "
           "configure it (each decoder layer and the root one FlatParameter, use_orig_params, limit_all_gathers, "
           "BACKWARD_PRE prefetch; --zero 0 = NO_SHARD, 2 = SHARD_GRAD_OP, 3 = FULL_SHARD, one GPU = NO_SHARD; "
           "mixed precision = "
           "MixedPrecision with half params, reduce and buffers, no autocast): flat shards padded to the GPUs, the "
           "root kept gathered through forward and backward, a layer's whole unsharded gradient reduce-scattered at "
           "once. With LoRA a layer's frozen base shares the adapters' FlatParameter, so its weight gradients are "
           "computed and reduce-scattered as in full fine-tuning; only the adapters get optimizer states. "
           "deepspeed: DeepSpeed 0.19's engine as the HF Trainer builds it (--zero 1/2: DeepSpeedZeroOptimizer "
           "with the torch optimizer as client; bf16-mixed = its bf16 section: bf16 weights, no autocast, fp32 master "
           "partition), stepped by engine.backward/engine.step: one flat parameter tensor, this GPU's fp32 master "
           "partition and its states, a contiguous gradient bucket of --ds-reduce-bucket elements through backward, "
           "the partition's gradients; --zero 0: no ZeRO optimizer, the engine all-reduces the whole gradients in "
           "flattened buckets of 5e8 elements after backward, and bf16 wraps the torch optimizer in "
           "FP16_UnfusedOptimizer (an fp32 master copy of every parameter, fp32 gradients made at the step); "
           "--zero 3: DeepSpeedZeroOptimizer_Stage3, every tensor split evenly, those above "
           "--ds-persistence-threshold gathered as their module runs and kept from forward to their backward (the "
           "default stage3_max_reuse_distance), one persistent bucket and this GPU's partition gradients.",
           link=WHEN_SET, fallback=True, widget=Widget("Training engine", "w_engine", SELECT, group=G_HARDWARE)),
    Option("fsdp1_wrap", c.Fsdp1Wrap, c.Fsdp1Wrap.LAYERS,
           "With --engine fsdp1 and lora: layers = accelerate's wrap (the adapters in their layer's FlatParameter, "
           "so the frozen base's gradients are computed and reduce-scattered too); adapters = the FSDP-LoRA recipes' "
           "(Answer.AI's train.py, PEFT's fsdp_auto_wrap_policy, torchtune): each lora_A / lora_B its own unit, "
           "use_orig_params=False, so the layers' units are frozen and only the adapters' small gradients are made.",
           link=WHEN_SET, needs=Needs("engine", ("fsdp1",)),
           widget=Widget("FSDP1 wrap policy", "w_fsdp1_wrap", SELECT, group=G_HARDWARE)),
    Option("ds_reduce_bucket", int, DS_REDUCE_BUCKET,
           "With --engine deepspeed: ZeRO's reduce_bucket_size, in elements (DeepSpeed's default 5e8). ZeRO-1/2 "
           "allocate one contiguous gradient bucket of this many elements in the gradient dtype for the whole "
           "backward (2 GB in fp32 at the default, whatever the model's size), copy each gradient into it and "
           "reduce it when full; the HF Trainer's \"auto\" sets hidden_size² (--from fills it from the model). ZeRO-0 "
           "does not read it: its engine all-reduces in buckets of 5e8 elements.",
           low=1, high=MAX_DS_BUCKET, link=WHEN_SET,
           needs=Needs("engine", ("deepspeed",), "a reduce bucket of {value} elements goes with --engine deepspeed"),
           widget=Widget("DeepSpeed reduce_bucket_size (elements)", "w_ds_bucket", NUMBER, group=G_SAVERS)),
    Option("ds_overlap_comm", bool, False,
           "With --engine deepspeed: ZeRO's overlap_comm (DeepSpeed's default for stages 1-2: off). On, "
           "the contiguous gradient bucket is doubled (a second --ds-reduce-bucket buffer, so one fills while the "
           "other is reduced), and ZeRO-1 reduces the gradients in backward's hooks as ZeRO-2 does instead of all "
           "at once after backward: 4 GB of buckets in fp32 at the default size, whatever the model's size. ZeRO-0 "
           "builds no ZeRO optimizer and reads neither this nor --ds-reduce-bucket; ZeRO-3 (whose default is on) "
           "keeps one bucket either way: the flag only picks the stream the reduce runs on.",
           link=WHEN_SET,
           needs=Needs("engine", ("deepspeed",), "overlap_comm goes with --engine deepspeed"),
           widget=Widget("DeepSpeed overlap_comm (double gradient buckets)", "w_ds_overlap", CHECK,
                         group=G_SAVERS)),
    Option("ds_prefetch_bucket", int, DS_PREFETCH_BUCKET,
           "With --engine deepspeed --zero 3: stage3_prefetch_bucket_size, in elements (DeepSpeed's default 5e7; "
           "the HF Trainer's \"auto\" is 0.9 x hidden_size²). After a module's parameters are gathered, the "
           "coordinator all-gathers the next ones of the recorded trace until this many elements are in flight.",
           low=0, high=MAX_DS_BUCKET, link=WHEN_SET,
           needs=Needs("engine", ("deepspeed",), "a prefetch bucket of {value} elements goes with --engine deepspeed"),
           widget=Widget("DeepSpeed stage3_prefetch_bucket_size (elements)", "w_ds_prefetch", NUMBER,
                         group=G_SAVERS)),
    Option("ds_persistence_threshold", int, DS_PERSISTENCE_THRESHOLD,
           "With --engine deepspeed --zero 3: stage3_param_persistence_threshold, in elements (DeepSpeed's "
           "default 1e5; the HF Trainer's \"auto\" is 10 x hidden_size). A parameter of at most this many elements "
           "is never partitioned: every GPU keeps it whole, as ZeRO-2 does.",
           low=0, high=MAX_DS_BUCKET, link=WHEN_SET,
           needs=Needs("engine", ("deepspeed",), "a persistence threshold of {value} elements goes with --engine "
                       "deepspeed"),
           widget=Widget("DeepSpeed stage3_param_persistence_threshold (elements)", "w_ds_persist", NUMBER,
                         group=G_SAVERS)),
)

BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}
PLAN_OPTIONS: tuple[Option, ...] = tuple(o for o in OPTIONS if o.plan)
LINK_OPTIONS: tuple[Option, ...] = tuple(o for o in OPTIONS if o.link != NEVER)  # the app's inputs, link order
