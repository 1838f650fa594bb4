"""A grouped-experts MoE layer's backward (full fine-tuning): its candidate peaks, and the weight gradients each
moment holds as `.grad`s (for --grad-accum's later micro-steps and --optimizer-in-backward). Split from
`llmem.components.gradients`, which re-exports them."""

from llmem.components import activations as act
from llmem.plan import GradCkpt, TrainingPlan
from llmem.spec import ModelSpec


def moe_layer_backward_moments(spec: ModelSpec, plan: TrainingPlan) -> dict[str, int]:
    """The candidate peaks of a grouped-experts MoE layer's backward (transformers 5.23 `MixtralSparseMoeBlock` /
    `Qwen2MoeSparseMoeBlock` with `integrations/moe.py: grouped_mm_experts_forward`), each as bytes beyond the
    layer's saved tensors (`activations.moe_saved`) plus the gradient of the layer output (tokens × h, the residual
    branch holds it through the layer's backward).

    T tokens, r = T × top_k expert rows, E experts, i the expert width; eb: bytes of the expert tensors (the grouped
    mm runs in the weights' dtype: `input.to(weight.dtype)`); wb: bytes of the routing weights
    (`activations.moe_routing_weight_bytes`); ob: bytes of `proj_out * weights` (type promotion of eb and wb — fp32
    for mixtral in half precision).

    - recompute end (full checkpointing only): the recomputed forward reaches the routing-weight mul, just before
      the last saved tensor (the inverse permutation). Live besides the saved tensors recomputed so far: the
      forward's locals (the decoder layer's `residual`, saved only when fp32; the router logits held by `_`; the
      topk routing weights; `expert_ids_g` from sort; the histc input `expert_ids_g.float()` (`.int()` on CUDA) and
      `tokens_per_expert`), the product (r × h × ob; the CPU's TensorIterator also makes a promoted copy of the
      down output when eb != ob, inside the mul: kernel scratch, not in the CUDA program), and — mixtral, where the
      routed experts' `IndexBackward0` is the layer's first node to unpack a saved tensor — its input that
      triggered the recompute (the reshaped sum gradient, r × h × ob). qwen2_moe's recompute is triggered by the
      shared-expert gate's mul instead (its sigmoid is not yet recomputed).
    - routing-weight mul backward (`MulBackward0` of `proj_out * weights`): `IndexBackward0`'s output (r × h × ob,
      the inverse permutation freed), grad × proj_out (the routing weights' gradient before its sum) and
      grad × weights (r × h × ob each); then the engine's `validate_outputs` converts the first output — the
      cast of grad × weights to eb (r × h × eb) when eb != ob, else the sum of grad × proj_out (r × ob) — before
      the node's saved tensors are released (with checkpointing the unpacked recomputed tensors are freed first).
    - down grouped mm backward: the routing weights' gradient (r × wb) waits for its `IndexBackward0`; the saved
      down output and gathered weights are freed; the incoming gradient (r × h × eb), grad_input (r × i × eb) and
      grad_weight (E × h × i, the `.grad` of experts.down_proj).
    - silu(gate) * up backward: the down mm's saved input freed, its grad_input (r × i × eb) and the products
      grad × up, grad × silu(gate) (r × i × eb each).
    - gate_up grouped mm backward: silu, silu*up, gate_up output freed; the `SplitBackward0` cat of the gate and
      up gradients (r × 2i × eb), grad_weight (E × 2i × h) and grad_input (r × h × eb).
    qwen2_moe: the shared-expert gate branch runs backward before the routed experts and leaves the gradient of
    `shared_expert_output` (grad × sigmoid, T × h × cb, pending for the shared expert), the shared_expert_gate
    weight gradient (h) and the block input's gradient from its Linear (T × h × rb, the residual stream's dtype: under
    autocast `ToCopyBackward0` casts the Linear's half input gradient to fp32, the half one freed; the other branches
    accumulate into it); its mul's saved shared expert output (T × h × cb) and sigmoid (T × cb) are freed, and under
    autocast the gate Linear's saved half input (T × h × 2). The shared expert runs backward last, after every
    expert and router gradient exists and the routed part's saved tensors are freed (under autocast the router's
    half input cast too): the dense MLP transient of width shared_expert_intermediate_size (its largest weight
    gradient and two intermediate-sized gradients)."""
    moments = _moe_backward_moments(spec, plan)
    return {name: extra + plan.batch_size * plan.seq_len * spec.hidden_size * plan.precision.param_bytes
            for name, extra in moments.items()}


def _moe_backward_moments(spec: ModelSpec, plan: TrainingPlan) -> dict[str, int]:
    """`moe_layer_backward_moments` without the layer output's gradient: each moment's bytes, in the order they
    happen (symbols as there)."""
    T = plan.batch_size * plan.seq_len
    h, e, k = spec.hidden_size, spec.num_experts, spec.experts_per_token
    i = spec.moe_intermediate_size or spec.intermediate_size
    r = T * k
    cb, rb = act._bytes(plan)
    pb = plan.precision.param_bytes
    eb = pb
    wb = act.moe_routing_weight_bytes(spec, plan)
    ob = max(eb, wb)
    ckpt = plan.grad_ckpt is GradCkpt.FULL
    inverse_permutation, down_output, gathered_weights = r * 8, r * h * eb, r * wb
    silu_times_up, silu_gate, gate_up_output = r * i * eb, r * i * eb, r * 2 * i * eb
    # gradients
    routed_output_grad = r * h * ob  # IndexBackward0's input (reshaped sum gradient) or output
    routing_weights_grad = r * wb
    down_grad_weight, gate_up_grad_weight = e * h * i * pb, e * 2 * i * h * pb
    shared = spec.family.shared_expert and spec.shared_expert_intermediate_size
    shared_gate = 0
    if shared:  # left by the shared-expert gate branch's backward, which runs first
        shared_output_grad = shared_output_saved = T * h * cb
        block_input_grad = T * h * rb  # under autocast ToCopyBackward0 casts the Linear's half one to fp32
        gate_input_cast = T * h * 2 if plan.precision.is_mixed else 0  # its Linear's saved half input, freed
        shared_gate = (shared_output_grad + h * pb + block_input_grad - shared_output_saved
                       - T * cb - gate_input_cast)  # gate weight grad; the freed sigmoid
    moments = {}
    if ckpt:
        residual_local = T * h * rb if rb == 2 else 0
        router_logits, topk_weights, sorted_ids = T * e * cb, r * wb, r * 8
        histc_input, tokens_per_expert = r * 4, e * 4
        forward_locals = residual_local + router_logits + topk_weights + sorted_ids + histc_input + tokens_per_expert
        trigger = routed_output_grad if not shared else -T * cb  # qwen2_moe: the gate sigmoid not yet recomputed
        weighted_product = r * h * ob
        moments["recompute end (routing-weight mul)"] = (forward_locals - inverse_permutation + trigger
                                                         + weighted_product)
    converted = 0 if ckpt else (r * h * eb if eb != ob else r * ob)
    moments["routing-weight mul backward"] = (shared_gate + routed_output_grad - inverse_permutation
                                              + 2 * r * h * ob + converted)
    freed = inverse_permutation + down_output + gathered_weights
    moments["down grouped mm backward"] = (shared_gate + routing_weights_grad - freed + r * h * eb + r * i * eb
                                           + down_grad_weight)
    freed += silu_times_up
    moments["silu(gate) * up backward"] = (shared_gate + routing_weights_grad - freed + down_grad_weight
                                           + 3 * r * i * eb)
    freed += silu_gate + gate_up_output
    moments["gate_up grouped mm backward"] = (shared_gate + routing_weights_grad - freed + down_grad_weight
                                              + r * 2 * i * eb + gate_up_grad_weight + r * h * eb)
    if shared:
        si = spec.shared_expert_intermediate_size
        routed_saved = sum(s.bytes for s in act.moe_saved(spec, plan, T))
        routed_saved += T * h * 2 if plan.precision.is_mixed else 0  # the router's half input cast, freed by its mm
        router_grad = e * h * pb
        moments["shared expert backward"] = (shared_gate + down_grad_weight + gate_up_grad_weight + router_grad
                                             - routed_saved + si * h * pb + 2 * T * si * cb)
    return moments


def moe_layer_backward_peak_extra_bytes(spec: ModelSpec, plan: TrainingPlan, accumulating: bool = False) -> int:
    """The largest of `moe_layer_backward_moments`; `accumulating` (micro-steps 2..K of `--grad-accum`; and under
    `--optimizer-in-backward`, stepped and freed): each less the weight gradients AccumulateGrad has already taken."""
    moments = moe_layer_backward_moments(spec, plan)
    held = moe_held_gradient_bytes(spec, plan) if accumulating or plan.optimizer_in_backward else {}
    return max(v - held.get(name, 0) for name, v in moments.items())


def moe_held_gradient_bytes(spec: ModelSpec, plan: TrainingPlan) -> dict[str, int]:
    """At each of `moe_layer_backward_moments`, the layer's weight gradients made by an earlier node: `.grad`s in
    micro-step 1, added in place and freed by their AccumulateGrad in micro-step 2 — which the engine runs right
    after the node that made them (an AccumulateGrad's sequence number is the highest, ready queue order:
    torch/csrc/autograd/engine.cpp `CompareNodeTaskTime`). A gradient the moment's own node just returned is
    transient in both (down's at the down mm backward, gate_up's at the gate_up one, the shared expert's largest).
    Symbols as in `moe_layer_backward_moments`: the shared-expert gate weight's (h), experts.down_proj's (E × h × i),
    experts.gate_up_proj's (E × 2i × h), the router's (E × h), in the parameters' dtype."""
    h, e = spec.hidden_size, spec.num_experts
    i = spec.moe_intermediate_size or spec.intermediate_size
    pb = plan.precision.param_bytes
    gate = h * pb if spec.family.shared_expert and spec.shared_expert_intermediate_size else 0
    down, gate_up, router = e * h * i * pb, e * 2 * i * h * pb, e * h * pb
    return {"routing-weight mul backward": gate, "down grouped mm backward": gate,
            "silu(gate) * up backward": gate + down, "gate_up grouped mm backward": gate + down,
            "shared expert backward": gate + down + gate_up + router}
