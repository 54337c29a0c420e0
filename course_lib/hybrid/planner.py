"""Planning a ~1000-GPU run: memory per GPU, traffic per GPU and the pipeline bubble of (dp, tp, pp, cp, ZeRO) layouts.

    python -m course_lib.hybrid.planner                          # 7B, 70B, 175B on 128 nodes x 8 H100 80GB
    python -m course_lib.hybrid.planner --model 70B --zero 0 1 3 --fits-only
    python -m course_lib.hybrid.planner --model 175B --recompute none
    python -m course_lib.hybrid.planner --model 70B --seq-len 131072 --global-batch 64 --cp 1 2 4 8 --fits-only
    python -m course_lib.hybrid.planner --model 8x7B --ep 1 2 4 8 --fits-only        # a mixture of experts

Formulas, not measurements (the inputs are printed with every table). For a layout, the busiest GPU holds
the first pipeline stage: ceil(L / pp) layers with their matrices split over tp, plus the embedding.
  model states   course_lib.memory.formulas.zero_memory_per_gpu over the dp group (2 + 2 + 12 bytes per parameter)
  activations    per layer and micro-batch, 16-bit, sequence parallel (Korthikanti et al. 2022, table 2):
                 s b h (34 + 5 a s / h) / tp   stored        34 s b h / tp   selective recompute (or
                 FlashAttention, which never stores the a x s x s scores)    2 s b h / tp   full recompute;
                 under 1F1B the first stage holds min(pp, micro-batches) micro-batches in flight.
                 Assumption: 34 s b h is derived for GPT-3's block, whose MLP is 4h wide with GeLU (its input
                 and output, 16 s b h) and which has dropout (2 s b h of masks). It is used unchanged for these
                 SwiGLU shapes, whose MLP saves three s x b x F tensors instead (gate, up and their product:
                 6 s b F bytes in 16-bit, with a fused SwiGLU that recomputes silu(gate) in backward;
                 course_lib.memory.activations.layer_terms counts them) and which have no dropout. With
                 F >= 8h/3, as here, that is at least GeLU's 16 s b h, so the activation figures are, if
                 anything, low: read them as a lower bound.
  DP traffic     course_lib.memory.formulas.data_parallel_traffic: 2 (n-1)/n x 2 bytes x parameters per step
                 (ZeRO-3: 3 (n-1)/n x 2 bytes x parameters per micro-batch: it gathers them again each time)
  TP traffic     4 all-reduces of b s h per layer and micro-batch (2 forward, 2 backward; sequence parallel
                 replaces each by an all-gather + reduce-scatter of the same volume), 2 (t-1)/t of it sent
  PP traffic     per micro-batch, b s h activations forward and their gradients backward, 1/tp per GPU
  CP             context parallelism over cp GPUs (ring attention, course_lib.context_parallel): each GPU holds s/cp
                 positions, so its activations, its TP and PP messages are 1/cp; it sends per layer and micro-batch
                 (cp - 1) key/value blocks of b (s/cp) (h/tp) forward and 2 (cp - 1) + 1 blocks of k, v, dk, dv
                 backward (each block two tensors); the weights are replicated over dp x cp GPUs, whose gradients
                 (and ZeRO's shards) span dp x cp. Rank order (dp, pp, cp, tp): cp next to tp, inside a node when
                 tp x cp fits in one
  EP             a MoE model (n_experts MLPs of ffn_hidden, top_k of them per token, a capacity factor) splits its
                 experts over ep of the dp x cp GPUs, whole (not split by tp); per MoE layer and micro-batch 4
                 all-to-alls of the E x C x h buffer, C = capacity factor x tokens x k / E, (ep-1)/ep sent; the
                 experts' gradients sync over dp x cp / ep GPUs; FLOPs count the active parameters (top_k experts).
                 The activation formula counts one MLP per token: low for MoE (a token passes k experts)
  bubble         (pp - 1) / (m + pp - 1) of the step, m = global batch / (dp x micro-batch) micro-batches
  step time      compute at a fraction of peak, stretched by the bubble, plus the TP and PP transfer times at
                 the assumed bandwidths, plus the DP time that overlap cannot hide (the last micro-batch's
                 backward for ZeRO-0/1/2, all the compute for ZeRO-3's prefetched gathers);
                 MFU = (6 N + 12 L h s) FLOPs per token x tokens / (step time x GPUs x peak)
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from course_lib.core.checks import positive_ints
from course_lib.core.model import GPTConfig
from course_lib.hybrid.layout import nodes_spanned, parallel_sizes
from course_lib.memory.accounting import GPU_80GB, count_parameters, format_bytes
from course_lib.memory.activations import RECOMPUTE, korthikanti_bytes_per_layer
from course_lib.memory.formulas import ZeroMemory, data_parallel_traffic, zero_memory_per_gpu

ACT_BYTES = 2  # bf16 activations and gradients


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer in the course model's family (SwiGLU MLP, tied embeddings, no biases)."""

    name: str
    n_layer: int
    n_embd: int
    n_head: int
    ffn_hidden: int
    vocab_size: int
    n_experts: int = 0
    """0: a dense MLP per layer. Otherwise a mixture of experts: n_experts MLPs of ffn_hidden and a router."""
    top_k: int = 2
    capacity_factor: float = 1.25

    def config(self, seq_len: int) -> GPTConfig:
        return GPTConfig(vocab_size=self.vocab_size, block_size=seq_len, n_layer=self.n_layer, n_head=self.n_head,
                         n_embd=self.n_embd, ffn_hidden=self.ffn_hidden)

    @property
    def expert_params(self) -> int:
        """One expert: a SwiGLU MLP, 3 h F."""
        return 3 * self.n_embd * self.ffn_hidden

    def _moe_extra(self, experts: int) -> int:
        """Parameters of a model whose layers run `experts` MLPs, beyond the dense model's one, router included."""
        return self.n_layer * ((experts - 1) * self.expert_params + self.n_embd * self.n_experts) if self.n_experts else 0

    @property
    def n_params(self) -> int:
        return count_parameters(self.config(1)) + self._moe_extra(self.n_experts)

    @property
    def active_params(self) -> int:
        """Parameters one token goes through (a MoE token sees top_k experts): what its FLOPs count."""
        return count_parameters(self.config(1)) + self._moe_extra(self.top_k)


# LLaMA-7B's shape, a 70B and GPT-3 175B's shape with a SwiGLU MLP. A SwiGLU MLP has three h x F matrices,
# 3 h F parameters per layer: about 8 h^2 for the 7B (F = 11008 ~ 8h/3) and for the 175B (F = 8h/3, the size of
# GPT-3's 4h GeLU MLP), 9 h^2 for the 70B (F = 3h).
MODELS = {
    "7B": ModelShape("7B", n_layer=32, n_embd=4096, n_head=32, ffn_hidden=11008, vocab_size=32000),
    "70B": ModelShape("70B", n_layer=80, n_embd=8192, n_head=64, ffn_hidden=24576, vocab_size=32000),
    "175B": ModelShape("175B", n_layer=96, n_embd=12288, n_head=96, ffn_hidden=32768, vocab_size=50304),
}
MOE_MODELS = {
    # Mixtral 8x7B's shape (8 experts of F = 14336, top-2), with full multi-head attention where Mixtral has 8 k/v heads
    "8x7B": ModelShape("8x7B", n_layer=32, n_embd=4096, n_head=32, ffn_hidden=14336, vocab_size=32000, n_experts=8,
                       top_k=2),
}


@dataclass(frozen=True)
class Cluster:
    """The machine. Bandwidths are nccl-tests style bus bandwidths per GPU: assumptions, replace with yours."""

    n_nodes: int = 128
    gpus_per_node: int = 8
    gpu_memory: float = GPU_80GB
    usable_fraction: float = 0.9
    """Share of memory a plan may fill: the rest goes to the CUDA context, NCCL buffers, logits, fragmentation."""
    peak_flops: float = 989e12
    """Dense bf16 peak of one H100 SXM."""
    compute_efficiency: float = 0.5
    """Fraction of peak the matmuls reach when nothing waits for communication."""
    intra_node_busbw: float = 360e9
    """NVLink inside a node."""
    inter_node_busbw: float = 40e9
    """Network between nodes per GPU (one 400 Gb/s NIC per GPU)."""

    @property
    def n_gpus(self) -> int:
        return self.n_nodes * self.gpus_per_node


H100_CLUSTER = Cluster()


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    zero_stage: int = 1
    micro_batch: int = 1
    cp: int = 1
    """Context parallelism: GPUs that split each sequence (ring attention)."""
    ep: int = 1
    """Expert parallelism: GPUs of the dp x cp ranks over which a MoE model's experts are split."""

    @property
    def sizes(self) -> dict[str, int]:
        return {"dp": self.dp, "pp": self.pp, "cp": self.cp, "tp": self.tp}


def check_layout(model: ModelShape, layout: Layout, cluster: Cluster, global_batch: int) -> None:
    """Raise ValueError naming what makes a layout impossible (sizes that do not divide or multiply out)."""
    if layout.cp == 1:
        parallel_sizes(cluster.n_gpus, layout.tp, layout.pp, layout.dp)  # dp * tp * pp == number of GPUs
    elif layout.dp * layout.tp * layout.pp * layout.cp != cluster.n_gpus or min(layout.sizes.values()) < 1:
        raise ValueError(f"dp * tp * pp * cp = {layout.dp} * {layout.tp} * {layout.pp} * {layout.cp} must equal the "
                         f"cluster's {cluster.n_gpus} GPUs")
    if model.n_head % layout.tp or model.ffn_hidden % layout.tp:
        raise ValueError(f"tp ({layout.tp}) must divide n_head ({model.n_head}) and ffn_hidden ({model.ffn_hidden})")
    if layout.pp > model.n_layer:
        raise ValueError(f"pp ({layout.pp}) cannot exceed n_layer ({model.n_layer}): a stage needs a layer")
    if layout.micro_batch < 1 or global_batch % (layout.dp * layout.micro_batch):
        raise ValueError(f"global_batch ({global_batch}) must be divisible by dp x micro_batch = "
                         f"{layout.dp} x {layout.micro_batch}")
    if layout.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {layout.zero_stage!r}")
    if layout.ep > 1 and not model.n_experts:
        raise ValueError(f"ep ({layout.ep}) splits experts, and {model.name} has none (n_experts = 0)")
    if layout.ep < 1 or (model.n_experts and model.n_experts % layout.ep) or (layout.dp * layout.cp) % layout.ep:
        raise ValueError(f"ep ({layout.ep}) must divide n_experts ({model.n_experts}) and dp x cp = "
                         f"{layout.dp} x {layout.cp}: the experts are split over the data and context ranks")


def check_sequence(seq_len: int, cp: int) -> None:
    if cp > 1 and seq_len % (2 * cp):
        raise ValueError(f"seq_len ({seq_len}) must split into 2 x cp = {2 * cp} equal chunks (zigzag context "
                         "parallelism)")


def cp_bytes_per_gpu(n_layers: int, n_micro: int, micro_batch: int, seq_len: int, n_embd: int, tp: int,
                     cp: int) -> float:
    """Bytes a GPU sends per step for ring attention: per layer and micro-batch, (cp - 1) k/v blocks forward and
    2 (cp - 1) + 1 blocks of (k, v) or (dk, dv) backward, a block being 2 tensors of b (s/cp) (h/tp) values."""
    if cp == 1:
        return 0.0
    pair = 2 * micro_batch * (seq_len / cp) * (n_embd / tp) * ACT_BYTES  # one block of k and v
    return n_layers * n_micro * ((cp - 1) + 2 * (cp - 1) + 1) * pair


def pipeline_bubble(pp: int, n_micro: int) -> float:
    """Idle fraction of a GPipe / 1F1B step: (p - 1) / (m + p - 1)."""
    positive_ints(pp=pp, n_micro=n_micro)
    return (pp - 1) / (n_micro + pp - 1)


def tp_bytes_per_gpu(n_layers: int, n_micro: int, micro_batch: int, seq_len: int, n_embd: int, tp: int) -> float:
    """Bytes a GPU sends per step for tensor parallelism: 4 ring all-reduces of b s h per layer and micro-batch."""
    return n_layers * n_micro * 4 * 2 * (tp - 1) / tp * micro_batch * seq_len * n_embd * ACT_BYTES


def pp_bytes_per_gpu(n_micro: int, micro_batch: int, seq_len: int, n_embd: int, tp: int, pp: int) -> float:
    """Bytes a middle stage's GPU sends per step: activations forward and gradients backward, 1/tp each."""
    return 0.0 if pp == 1 else n_micro * 2 * micro_batch * seq_len * n_embd * ACT_BYTES / tp


def stage_params(model: ModelShape, tp: int, pp: int, ep: int = 1) -> float:
    """Parameters on one GPU of the first pipeline stage: its layers' share plus the embedding's share (a MoE
    model's experts included: stage_expert_params)."""
    h, layers = model.n_embd, math.ceil(model.n_layer / pp)
    mlp = 0 if model.n_experts else 3 * h * model.ffn_hidden
    matrices = 4 * h * h + mlp  # split over tp; the two norms (2 h) are replicated
    last_stage_norm = h if pp == 1 else 0  # with one stage the final norm sits here too
    router = h * model.n_experts  # replicated
    dense = layers * (matrices / tp + 2 * h + router) + model.vocab_size * h / tp + last_stage_norm
    return dense + stage_expert_params(model, pp, ep)


def stage_expert_params(model: ModelShape, pp: int, ep: int) -> float:
    """A MoE model's expert parameters on one GPU of the first stage: n_experts / ep experts per layer, whole (not
    split by tensor parallelism, as in course_lib.hybrid.four_d)."""
    return math.ceil(model.n_layer / pp) * model.n_experts / ep * model.expert_params if model.n_experts else 0.0


def ep_bytes_per_gpu(model: ModelShape, n_layers: int, n_micro: int, micro_batch: int, seq_len: int, cp: int,
                     ep: int) -> float:
    """Bytes a GPU sends per step for expert parallelism: per MoE layer and micro-batch 4 all-to-alls (dispatch and
    combine, forward and backward) of its E x C x h buffer, C = capacity factor x tokens x k / E, (ep-1)/ep of it
    to other GPUs."""
    if not model.n_experts or ep == 1:
        return 0.0
    buffer = model.capacity_factor * model.top_k * micro_batch * (seq_len / cp) * model.n_embd  # E x C x h
    return n_layers * n_micro * 4 * buffer * ACT_BYTES * (ep - 1) / ep


PLAN_ORDER = ("dp", "pp", "cp", "tp")
"""Rank order of a plan, slowest to fastest: cp next to tp (DEFAULT_ORDER with cp inserted before tp)."""


def _link(dim: str, layout: Layout, cluster: Cluster) -> float:
    """Bandwidth of a group: NVLink if rank 0's group of that kind sits in one node, the network otherwise."""
    sizes, stride, step = layout.sizes, {}, 1
    for name in reversed(PLAN_ORDER):
        stride[name] = step
        step *= sizes[name]
    if dim == "ep":  # the first ep of the dp x cp ranks that share rank 0's pipeline and tensor coordinates
        group = [(i % layout.cp) * stride["cp"] + (i // layout.cp) * stride["dp"] for i in range(layout.ep)]
    else:
        group = [i * stride[dim] for i in range(sizes[dim])]
    inside = len(nodes_spanned(group, cluster.gpus_per_node)) == 1
    return cluster.intra_node_busbw if inside else cluster.inter_node_busbw


@dataclass(frozen=True)
class Plan:
    model: ModelShape
    layout: Layout
    n_micro: int
    params_per_gpu: float
    model_states: ZeroMemory
    activations: float
    fits: bool
    tp_crosses_nodes: bool
    bubble: float
    traffic: dict
    """Bytes sent per GPU per step: {'dp': ..., 'tp': ..., 'pp': ..., 'cp': ..., 'ep': ...}."""
    seconds: dict
    """{'compute': incl. the bubble, 'dp', 'tp', 'pp', 'cp', 'ep': transfer times, 'dp_exposed', 'step'}."""
    mfu: float

    @property
    def total(self) -> float:
        return self.model_states.total + self.activations


def plan(model: ModelShape, layout: Layout, cluster: Cluster = H100_CLUSTER, seq_len: int = 4096,
         global_batch: int = 1024, recompute: str = "selective") -> Plan:
    """Memory, traffic and an estimated step time for one layout (global_batch in sequences of seq_len)."""
    check_layout(model, layout, cluster, global_batch)
    check_sequence(seq_len, layout.cp)
    dp, tp, pp, cp, b = layout.dp, layout.tp, layout.pp, layout.cp, layout.micro_batch
    n_micro, layers = global_batch // (dp * b), math.ceil(model.n_layer / pp)
    ep = layout.ep
    params = stage_params(model, tp, pp, ep)
    experts = stage_expert_params(model, pp, ep)
    dense = params - experts
    # The weights are replicated over dp x cp GPUs, an expert's over dp x cp / ep: ZeRO shards each over its own
    states = zero_memory_per_gpu(dense, dp * cp, layout.zero_stage)
    if experts:
        more = zero_memory_per_gpu(experts, dp * cp // ep, layout.zero_stage)
        states = ZeroMemory(states.stage, states.params + more.params, states.grads + more.grads,
                            states.optimizer_states + more.optimizer_states)
    in_flight = min(pp, n_micro)  # 1F1B: stage 0 starts pp micro-batches before its first backward
    # s/cp queries per GPU, each against all s keys: the formula's s b h (34 + 5 a s / h) / cp
    per_layer = korthikanti_bytes_per_layer(seq_len, b, model.n_embd, model.n_head, tp=tp, sequence_parallel=True,
                                            recompute=recompute) / cp
    activations = layers * in_flight * per_layer
    zero3 = layout.zero_stage == 3
    strategy = "zero3" if zero3 else "ddp"
    dp_per_pass = data_parallel_traffic(dense, dp * cp, strategy=strategy)
    if experts and dp * cp // ep > 1:
        dp_per_pass += data_parallel_traffic(experts, dp * cp // ep, strategy=strategy)
    local_seq = seq_len / cp
    traffic = {"dp": dp_per_pass * (n_micro if zero3 else 1),  # ZeRO-3 gathers the weights for every micro-batch
               "tp": tp_bytes_per_gpu(layers, n_micro, b, local_seq, model.n_embd, tp),
               "pp": pp_bytes_per_gpu(n_micro, b, local_seq, model.n_embd, tp, pp),
               "cp": cp_bytes_per_gpu(layers, n_micro, b, seq_len, model.n_embd, tp, cp),
               "ep": ep_bytes_per_gpu(model, layers, n_micro, b, seq_len, cp, ep)}
    tokens = global_batch * seq_len
    # PaLM's, as GPT.flops_per_token; a MoE token goes through top_k experts: its active parameters
    flops_per_token = 6 * model.active_params + 12 * model.n_layer * model.n_embd * seq_len
    work = flops_per_token * (4 / 3 if recompute == "full" else 1)  # full recompute: one more forward
    compute = work * tokens / (cluster.n_gpus * cluster.peak_flops * cluster.compute_efficiency)
    bubble = pipeline_bubble(pp, n_micro)
    seconds = {"compute": compute / (1 - bubble)}
    seconds.update({dim: traffic[dim] / _link(dim, layout, cluster) for dim in ("dp", "tp", "pp", "cp", "ep")})
    # Gradients are final only in the last micro-batch's backward (2/3 of its compute): DP traffic hides there,
    # as DDP's buckets do; ZeRO-3 prefetches parameters during all the compute. TP and PP transfers sit between
    # dependent computations: counted in full.
    hidden = compute if zero3 else 2 / 3 * compute / n_micro
    seconds["dp_exposed"] = max(0.0, seconds["dp"] - hidden)
    # Ring attention overlaps each pass with the block computed meanwhile; counted in full here, an upper bound.
    seconds["step"] = (seconds["compute"] + seconds["tp"] + seconds["pp"] + seconds["cp"] + seconds["ep"]
                       + seconds["dp_exposed"])
    mfu = flops_per_token * tokens / (seconds["step"] * cluster.n_gpus * cluster.peak_flops)
    fits = states.total + activations <= cluster.gpu_memory * cluster.usable_fraction
    return Plan(model, layout, n_micro, params, states, activations, fits, tp > cluster.gpus_per_node, bubble,
                traffic, seconds, mfu)


def candidate_layouts(model: ModelShape, cluster: Cluster = H100_CLUSTER, global_batch: int = 1024,
                      zero_stages=(1,), tps=(1, 2, 4, 8, 16), pps=(1, 2, 4, 8, 16), micro_batch: int = 1, cps=(1,),
                      eps=(1,)):
    """Every valid (dp, tp, pp, cp, ep, zero) layout of the cluster's GPUs from these choices."""
    layouts = []
    for zero in zero_stages:
        for cp in cps:
            for ep in eps:
                for tp in tps:
                    for pp in pps:
                        if cluster.n_gpus % (tp * pp * cp):
                            continue
                        layout = Layout(cluster.n_gpus // (tp * pp * cp), tp, pp, zero, micro_batch, cp, ep)
                        try:
                            check_layout(model, layout, cluster, global_batch)
                        except ValueError:
                            continue
                        layouts.append(layout)
    return layouts


def best(plans: list[Plan]) -> Plan | None:
    """The plan that fits with the shortest estimated step (None if none fits)."""
    fitting = [p for p in plans if p.fits and not p.tp_crosses_nodes]
    return min(fitting, key=lambda p: p.seconds["step"]) if fitting else None


def plan_table(plans: list[Plan]) -> str:
    head = (f"{'tp':>3}{'pp':>4}{'cp':>4}{'ep':>4}{'dp':>6}{'zero':>5}{'micro':>6}{'params/GPU':>11}{'states':>9}"
            f"{'activ.':>9}{'total':>9}  fits{'bubble':>8}{'TP sent':>9}{'PP sent':>9}{'CP sent':>9}{'EP sent':>9}"
            f"{'DP sent':>9}{'step s':>8}{'MFU':>6}")
    lines = [head]
    for p in plans:
        l, gb = p.layout, lambda x: f"{x / 1e9:.1f}G"
        fits = "yes " if p.fits else "no  "
        fits = "x-node" if p.tp_crosses_nodes else fits
        lines.append(f"{l.tp:>3}{l.pp:>4}{l.cp:>4}{l.ep:>4}{l.dp:>6}{l.zero_stage:>5}{p.n_micro:>6}"
                     f"{p.params_per_gpu / 1e9:>10.2f}B{gb(p.model_states.total):>9}{gb(p.activations):>9}"
                     f"{gb(p.total):>9}  {fits:<6}{p.bubble:>6.1%}{gb(p.traffic['tp']):>9}{gb(p.traffic['pp']):>9}"
                     f"{gb(p.traffic['cp']):>9}{gb(p.traffic['ep']):>9}{gb(p.traffic['dp']):>9}"
                     f"{p.seconds['step']:>8.2f}{p.mfu:>6.0%}")
    return "\n".join(lines)


def describe(model: ModelShape, cluster: Cluster, seq_len: int, global_batch: int, recompute: str) -> str:
    return (f"{model.name}: {model.n_params / 1e9:.1f}B parameters, {model.n_layer} layers, h={model.n_embd}, "
            f"{model.n_head} heads | seq {seq_len}, global batch {global_batch} sequences "
            f"({global_batch * seq_len / 1e6:.2f}M tokens), recompute={recompute} | {cluster.n_nodes} nodes x "
            f"{cluster.gpus_per_node} GPUs of {format_bytes(cluster.gpu_memory)} (plans may use "
            f"{cluster.usable_fraction:.0%}), assumed {cluster.compute_efficiency:.0%} of "
            f"{cluster.peak_flops / 1e12:g} TFLOP/s, busbw {cluster.intra_node_busbw / 1e9:g} GB/s in a node, "
            f"{cluster.inter_node_busbw / 1e9:g} GB/s between nodes")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=list(MODELS), choices=[*MODELS, *MOE_MODELS])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--global-batch", type=int, default=1024, help="sequences per optimizer step")
    parser.add_argument("--zero", type=int, nargs="+", default=[1], choices=[0, 1, 2, 3])
    parser.add_argument("--recompute", default="selective", choices=RECOMPUTE)
    parser.add_argument("--cp", type=int, nargs="+", default=[1], help="context-parallel sizes to try")
    parser.add_argument("--ep", type=int, nargs="+", default=[1], help="expert-parallel sizes to try (MoE models)")
    parser.add_argument("--nodes", type=int, default=128)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--fits-only", action="store_true", help="list only the layouts that fit")
    args = parser.parse_args(argv)
    cluster = Cluster(n_nodes=args.nodes, gpus_per_node=args.gpus_per_node)
    for name in args.model:
        model = {**MODELS, **MOE_MODELS}[name]
        plans = [plan(model, layout, cluster, args.seq_len, args.global_batch, args.recompute)
                 for layout in candidate_layouts(model, cluster, args.global_batch, tuple(args.zero),
                                                 cps=tuple(args.cp), eps=tuple(args.ep))]
        shown = [p for p in plans if p.fits and not p.tp_crosses_nodes] if args.fits_only else plans
        print(describe(model, cluster, args.seq_len, args.global_batch, args.recompute))
        print(plan_table(shown))
        choice = best(plans)
        if choice is None:
            print("no layout fits: more pipeline stages, ZeRO-3, full recompute or a smaller micro-batch\n")
        else:
            l = choice.layout
            print(f"best estimate: tp={l.tp} pp={l.pp} cp={l.cp} ep={l.ep} dp={l.dp} ZeRO-{l.zero_stage}, {format_bytes(choice.total)} "
                  f"per GPU, bubble {choice.bubble:.1%}, step {choice.seconds['step']:.2f} s, MFU {choice.mfu:.0%}\n")


if __name__ == "__main__":
    main()
