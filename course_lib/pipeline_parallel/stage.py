"""Pipeline parallelism from scratch: cut the GPT into stages and stream micro-batches through them.

Stage s (one rank each) holds a contiguous run of blocks; stage 0 also the token embedding, the last stage
also norm_f, lm_head and the loss. A micro-batch's activations go forward with dist.send/recv, their
gradients come back the same way. Two schedules order the work on each stage: GPipe (every forward, then
every backward) and 1F1B (warm-up, then one forward one backward, then cool-down). Both compute the same
gradients as one process; 1F1B keeps at most n_stages micro-batches of activations alive instead of all m.

    python -m course_lib.pipeline_parallel.stage --stages 4 --micro-batches 8     # schedules, ideal timeline, bubble

The schedules themselves, the bubble and the traffic are in course_lib.pipeline_parallel.schedules (re-exported here).
Ranks run it through course_lib.pipeline_parallel.workers (launch(pipeline_train, world_size=2, ...)).
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from course_lib.core.checks import positive_int
from course_lib.core.model import GPT, next_token_loss
from course_lib.memory.activations import count_saved_bytes
from course_lib.pipeline_parallel.schedules import (
    SCHEDULES,
    max_in_flight,
    measured_bubble_fraction,
    predicted_bubble_fraction,
    schedule_actions,
    simulate_schedule,
)


# ------------------------------------------------------------------------------------------ the stages
def split_layers(n_layer: int, n_stages: int) -> list[range]:
    """Contiguous blocks per stage, as even as possible; the first stages take the remainder."""
    positive_int("n_stages", n_stages)
    if n_stages > n_layer:
        raise ValueError(f"cannot cut GPTConfig.n_layer={n_layer} blocks into {n_stages} pipeline stages: every "
                         f"stage needs at least one block (use at most {n_layer} stages or a deeper model)")
    sizes = [n_layer // n_stages + (s < n_layer % n_stages) for s in range(n_stages)]
    starts = [sum(sizes[:s]) for s in range(n_stages)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


class GPTStage(nn.Module):
    """Stage `stage` of `n_stages` of a GPT, built from copies of the full model's submodules.

    forward(x): stage 0 takes token ids (B, T); the others take hidden states (B, T, n_embd). The last stage
    returns logits (B, T, vocab_size), the others hidden states. Parameter names match the full model's
    (blocks keep their global index), except that the last stage's copy of the tied embedding is
    `lm_head.weight`.
    """

    def __init__(self, model: GPT, stage: int, n_stages: int):
        super().__init__()
        self.layers = split_layers(model.config.n_layer, n_stages)[stage] if 0 <= stage < n_stages else None
        if self.layers is None:
            raise ValueError(f"stage must be in 0..{n_stages - 1}, got {stage!r}")
        self.config, self.stage, self.n_stages = model.config, stage, n_stages
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        self.rope = copy.deepcopy(model.rope)  # buffers only: every stage rebuilds cos/sin locally
        if self.is_first:
            self.tok_emb = copy.deepcopy(model.tok_emb)
            self.emb_dropout = copy.deepcopy(model.emb_dropout)
        self.blocks = nn.ModuleDict({str(i): copy.deepcopy(model.blocks[i]) for i in self.layers})
        if self.is_last:
            self.norm_f = copy.deepcopy(model.norm_f)
            self.lm_head = copy.deepcopy(model.lm_head)  # its own Parameter: a copy of the tied matrix
            if self.is_first:
                self.lm_head.weight = self.tok_emb.weight  # one stage holds both ends: keep the tie

    @property
    def tied_weight(self) -> nn.Parameter | None:
        """This stage's copy of the embedding matrix that the full model ties to lm_head (None in between)."""
        return self.tok_emb.weight if self.is_first else self.lm_head.weight if self.is_last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            if x.dim() != 2 or x.dtype != torch.long:
                raise ValueError(f"stage 0 takes (batch, seq_len) token ids, got {tuple(x.shape)} {x.dtype}")
            x = self.emb_dropout(self.tok_emb(x))  # (B, T, n_embd)
        cos, sin = self.rope(x.shape[1])
        for block in self.blocks.values():
            if self.config.activation_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, cos, sin, use_reentrant=False)
            else:
                x = block(x, cos, sin)
        return self.lm_head(self.norm_f(x)) if self.is_last else x


def full_model_name(name: str) -> str:
    """The full model's name of a stage parameter (the last stage's lm_head is the tied embedding)."""
    return "tok_emb.weight" if name == "lm_head.weight" else name


def shifted_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """GPT.forward's loss: position t predicts token t+1 (mean over the micro-batch's tokens)."""
    return next_token_loss(logits, targets)


# ---------------------------------------------------------------------- the tied embedding (Megatron)
def tied_weight_group(n_stages: int):
    """Process group of the first and last stage (every rank must call this, in the same order)."""
    return dist.new_group([0, n_stages - 1]) if n_stages > 1 else None


def broadcast_tied_weight(stage: GPTStage, group) -> None:
    """Start both copies of the tied matrix equal: the last stage takes the first stage's values."""
    if stage.n_stages > 1 and stage.tied_weight is not None:
        first = 0 if group is None else dist.get_global_rank(group, 0)  # the first stage: group rank 0
        dist.broadcast(stage.tied_weight.data, src=first, group=group)


def allreduce_tied_grad(stage: GPTStage, group) -> int:
    """Sum the two copies' gradients so both hold the full model's gradient; returns the bytes reduced.

    The tied matrix gets gradient from two places: the embedding lookup (stage 0) and the output projection
    (last stage). In one process autograd adds them into one .grad; here each stage sees only its part, so
    the two add them with an all-reduce over their own two-rank group, as Megatron-LM does. Same gradient,
    same optimizer, same update: the copies stay equal without ever sending the weights again.
    """
    if stage.n_stages == 1 or stage.tied_weight is None:
        return 0
    grad = stage.tied_weight.grad
    dist.all_reduce(grad, group=group)
    return grad.numel() * grad.element_size()


# ----------------------------------------------------------------------------------------- execution
def apply_pipeline(model: GPT, stage: int, n_stages: int, tied_group=None) -> GPTStage:
    """The pipeline split, spelled like the other apply_* functions: this rank's stage of `model` (a GPTStage),
    with the tied embedding's copy on the last stage set equal to the first stage's over `tied_group` (the
    group of the first and last stage; default: tied_weight_group(n_stages) when every rank is one stage).
    Run it with PipelineRunner(stage, schedule, micro_batches, group)."""
    part = GPTStage(model, stage, n_stages)
    if n_stages > 1 and tied_group is None:
        if dist.get_world_size() != n_stages:
            raise ValueError(f"{dist.get_world_size()} ranks hold more than one pipeline of {n_stages} stages: pass "
                             "tied_group, the group of this pipeline's first and last stage")
        tied_group = tied_weight_group(n_stages)
    broadcast_tied_weight(part, tied_group)
    return part


class PipelineRunner:
    """Runs one stage's schedule on this rank (stage index = rank, one rank per stage).

    step(tokens) splits the (B, T) global batch into micro-batches; stage 0 feeds them in, the last stage
    uses them as targets, stages in between only read the shape. After step(): `timeline` (forward and
    backward intervals), `micro_batch_ids`, `bytes_sent`, `peak_in_flight` and `peak_activation_bytes`
    (saved tensors of the micro-batches alive at once, counted with saved_tensors_hooks).
    """

    def __init__(self, stage: GPTStage, schedule: str, micro_batches: int, group=None):
        self.stage, self.micro_batches = stage, micro_batches
        self.actions = schedule_actions(schedule, stage.n_stages, stage.stage, micro_batches)
        world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        if world_size != stage.n_stages or (dist.is_initialized() and dist.get_rank(group) != stage.stage):
            where = "WORLD_SIZE" if group is None else "the pipeline group's size"
            raise ValueError(f"the pipeline has {stage.n_stages} stages but {where} is {world_size}: "
                             "run one rank per stage, stage index = rank in the group")
        # The global rank of each stage: with a group (the 'pp' dimension of a larger mesh) stage s is not rank s.
        self.peers = ([dist.get_global_rank(group, s) for s in range(stage.n_stages)] if group is not None
                      else list(range(stage.n_stages)))
        # Weights and rope tables are saved for backward too, but they are not activations: skip their storage.
        self.state = [*stage.parameters(), *stage.buffers()]
        self.device = next(stage.parameters()).device

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # kernels run asynchronously: wait for them before reading the clock
        return time.monotonic()

    def _p2p(self, send=None, recv=None):
        """Post a send (tensor, peer, tag, kind) and/or a receive (shape, peer, tag) as one batch; wait for the
        receive and return its buffer. A send posted with the next receive from the same neighbour is Megatron's
        send_forward_recv_backward: two neighbours that send to each other at the same moment then never both
        wait for the other to receive first (a blocking send waits for its receiver, with NCCL and gloo alike)."""
        ops, buffer = [], None
        if send is not None:
            tensor, peer, tag, kind = send
            self.bytes_sent[kind] += tensor.numel() * tensor.element_size()
            ops.append(dist.P2POp(dist.isend, tensor.contiguous(), self.peers[peer], tag=tag))
        if recv is not None:
            buffer = torch.empty(recv[0], device=self.device)
            ops.append(dist.P2POp(dist.irecv, buffer, self.peers[recv[1]], tag=recv[2]))
        works = dist.batch_isend_irecv(ops)
        if recv is None:
            self.pending_works += works  # a lone send completes in the background; waited for at the end
        else:
            for work in works:
                work.wait()
        return buffer

    def step(self, tokens: torch.Tensor) -> float | None:
        """One forward + backward of the global batch (gradients accumulate in .grad); the last stage
        returns the batch loss, the others None."""
        stage, m, rank = self.stage, self.micro_batches, self.stage.stage
        if tokens.shape[0] % m:
            raise ValueError(f"a global batch of {tokens.shape[0]} sequences cannot be split into {m} equal "
                             "micro-batches: choose micro_batches dividing the batch size")
        b, T = tokens.shape[0] // m, tokens.shape[1]
        tokens = tokens.to(self.device)
        hidden_shape = (b, T, stage.config.n_embd)
        self.timeline, self.micro_batch_ids, self.pending_works = [], [], []
        self.bytes_sent = {"activations": 0, "activation_grads": 0}
        inputs, outputs, saved, losses = {}, {}, {}, []
        self.peak_in_flight = self.peak_activation_bytes = 0
        pending = None  # the last send, held back in case the next action receives from the same neighbour
        for kind, i in self.actions:
            peer = rank - 1 if kind == "F" else rank + 1  # forwards receive from the left, backwards from the right
            receives = not (stage.is_first if kind == "F" else stage.is_last)
            if pending is not None and not (receives and pending[1] == peer):
                self._p2p(send=pending)
                pending = None
            received = self._p2p(send=pending, recv=(hidden_shape, peer, i)) if receives else None
            pending = None
            if kind == "F":
                x = received.requires_grad_() if receives else tokens[i * b:(i + 1) * b]
                start = self._now()
                with count_saved_bytes(exclude=self.state) as counter:
                    y = stage(x)
                    if stage.is_last:  # each micro-batch loss is a mean: scale by 1/m so the grads sum to the mean
                        y = shifted_cross_entropy(y, tokens[i * b:(i + 1) * b]) / m
                self.timeline.append(("forward", start, self._now()))
                if stage.is_last:
                    losses.append(y.item() * m)
                else:
                    pending = (y.detach(), rank + 1, i, "activations")
                inputs[i], outputs[i], saved[i] = x, y, counter["bytes"]
            else:
                start = self._now()
                torch.autograd.backward(outputs.pop(i), received)  # the last stage starts from its loss (None)
                self.timeline.append(("backward", start, self._now()))
                x = inputs.pop(i)
                del saved[i]
                if not stage.is_first:
                    pending = (x.grad, rank - 1, i, "activation_grads")
            self.micro_batch_ids.append(i)
            self.peak_in_flight = max(self.peak_in_flight, len(inputs))
            self.peak_activation_bytes = max(self.peak_activation_bytes, sum(saved.values()))
        if pending is not None:
            self._p2p(send=pending)
        for work in self.pending_works:
            work.wait()
        return sum(losses) / m if stage.is_last else None

    @torch.no_grad()
    def forward_loss(self, tokens: torch.Tensor) -> float | None:
        """The loss of the (B, T) batch without backward (evaluation): the whole batch goes through the stages
        in order, one message per boundary. The last stage returns the loss, the others None."""
        stage, s = self.stage, self.stage.stage
        tokens = tokens.to(self.device)
        if stage.is_first:
            x = tokens
        else:
            x = torch.empty((*tokens.shape, stage.config.n_embd), device=self.device)
            dist.recv(x, src=self.peers[s - 1])
        y = stage(x)
        if not stage.is_last:
            dist.send(y.contiguous(), dst=self.peers[s + 1])
            return None
        return shifted_cross_entropy(y, tokens).item()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=8)
    args = parser.parse_args(argv)
    p, m = args.stages, args.micro_batches
    for name in SCHEDULES:
        print(f"{name} (F/B = forward/backward of micro-batch i; ideal bubble "
              f"{measured_bubble_fraction(simulate_schedule(name, p, m)[0]):.4f})")
        for s in range(p):
            actions = schedule_actions(name, p, s, m)
            print(f"  stage {s}: {' '.join(k + str(i) for k, i in actions)}  (in flight <= {max_in_flight(actions)})")
    print(f"predicted bubble (p-1)/(m+p-1) = {predicted_bubble_fraction(p, m):.4f}")


if __name__ == "__main__":
    main()
