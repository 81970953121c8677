"""One weight update: forward and backward over the micro-batches, then the optimiser.

Everything option-dependent (precision, loss scaling, gradient accumulation dtype, label smoothing,
mixing) was resolved into objects before the loop; the step only calls them. It returns tensors, so the
updates between the host's syncs (`cnns.engine.cadence`) run without one, with two exceptions the user asked
for: `--auto-loss-scaling` reads one overflow flag back per update (it decides whether the update is applied),
and `--fp-exceptions` checks the loss and gradients on the host after every backward.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from cnns import profiling
from cnns.errors import CnnsError
from cnns.optim import HalfPrecisionOptimiser, in_layout_of, set_lr
from cnns.precision import LossScaler, PrecisionPolicy

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class StepMetrics:
    loss_sum: torch.Tensor  # sum over micro-batches of the mean micro-batch loss
    correct: torch.Tensor  # top-1 hits over the whole update
    samples: int
    # Dynamic loss scaling found an overflow, skipped the update and halved the scale (a host value its
    # check read back anyway): the training loop does not take this update's non-finite loss for divergence.
    backed_off: bool = False


class FloatGradientAccumulator:
    """Sums half-precision micro-batch gradients in float32: added up in half precision, each micro-batch's
    gradient would be rounded to the spacing of the growing sum, and small contributions would be lost.

    With replicas the sum is also all-reduced in float32: `reduce_hook` is DDP's communication hook
    for the update's last micro-batch, which adds that micro-batch's half gradients to the float32
    sum of the others and all-reduces the float32 sum (DDP's default would reduce the half
    gradients of the last micro-batch alone, in half precision). With one micro-batch per update
    on one process, or float32 parameters, the autograd `.grad` is used directly.
    """

    def __init__(self, params: Sequence[nn.Parameter], enabled: bool):
        self.params = list(params)
        self.enabled = enabled
        self.buffers: list[torch.Tensor] | None = None
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._mean: list[torch.Tensor | None] | None = None  # reduce_hook's result, bucket by bucket

    def accumulate_as_computed(self) -> None:
        """For backward passes run by someone else (a pipeline schedule): each parameter's half
        gradient joins the float32 sum as soon as autograd has accumulated it, and `.grad` is freed."""
        if not self.enabled:
            return
        for index, param in enumerate(self.params):
            param.register_post_accumulate_grad_hook(functools.partial(self._add, index))

    def _add(self, index: int, param: nn.Parameter) -> None:
        if self.buffers is None:
            self.buffers = [None] * len(self.params)
        current = self.buffers[index]
        self.buffers[index] = _owned_float32(param.grad) if current is None else current.add_(param.grad)
        param.grad = None

    def after_backward(self) -> None:
        if not self.enabled:
            return
        if self._mean is not None:  # the synchronised micro-batch: the replicas' mean replaces the sum
            self.buffers, self._mean = self._mean, None
        else:
            grads = [p.grad for p in self.params]
            if self.buffers is None:
                self.buffers = [_owned_float32(g) for g in grads]
            else:
                torch._foreach_add_(self.buffers, [g.float() for g in grads])
        for p in self.params:
            p.grad = None

    def gradients(self, to_float32: bool = True) -> list[torch.Tensor]:
        """The update's gradients; half ones converted to float32 only when asked (loss scaling needs
        float32 to unscale in). Otherwise the optimiser converts them into its flat buffer."""
        if self.enabled:
            grads, self.buffers = self.buffers, None
            return grads
        if not to_float32:
            return [p.grad for p in self.params]
        return [p.grad if p.grad is None or p.grad.dtype == torch.float32 else p.grad.float() for p in self.params]

    def reduce_hook(self, group, world_size: int):
        """A DDP communication hook: float32 sum of the update, all-reduced, mean over the replicas.

        The bucket is read in DDP's own memory order (`bucket_gradients`), and the float32 sum is laid out
        the same way, so the all-reduce is one pass over memory and each mean is the parameter's own layout."""
        import torch.distributed as dist

        def hook(_state, bucket):
            params, grads = bucket.parameters(), bucket_gradients(bucket)
            indices = [self._index[id(p)] for p in params]
            flat = torch.empty(bucket.buffer().numel(), dtype=torch.float32, device=bucket.buffer().device)
            sums = [in_layout_of(piece, p) for piece, p in zip(flat.split([p.numel() for p in params]), params)]
            for total, i, g in zip(sums, indices, grads):
                total.copy_(g)
                if self.buffers is not None:
                    total.add_(self.buffers[i])
            reduced = dist.all_reduce(flat, group=group, async_op=True).get_future()

            def store(_future):
                flat.div_(world_size)  # reduced in place: `sums` are its views
                if self._mean is None:
                    self._mean = [None] * len(self.params)
                for i, total in zip(indices, sums):
                    self._mean[i] = total
                return bucket.buffer()  # what DDP writes into .grad: discarded by after_backward

            return reduced.then(store)

        return hook


def bucket_gradients(bucket) -> list[torch.Tensor]:
    """The local gradients of a DDP bucket, one per `bucket.parameters()`, each with its parameter's layout.

    DDP copies each gradient into the bucket's flat buffer in its parameter's memory order (channels_last
    convolution weights stay channels_last), one after the other; torch's own ``bucket.gradients()``
    (torch 2.14.1) views those stretches as contiguous, which permutes the elements of every channels_last
    weight's gradient: a float32 all-reduce built on it trained 16.16 replicas on scrambled convolution
    gradients (docs/performance.md, "Precision x parallelism").
    """
    buffer, params = bucket.buffer(), bucket.parameters()
    sizes = [p.numel() for p in params]
    if sum(sizes) != buffer.numel():
        raise RuntimeError(f"a DDP bucket of {buffer.numel()} elements holds parameters of {sum(sizes)}: "
                           "its layout is not the packed one this reads")
    return [in_layout_of(piece, p) for piece, p in zip(buffer.split(sizes), params)]


def _owned_float32(grad: torch.Tensor) -> torch.Tensor:
    """A float32 copy of a gradient in memory of the accumulator's own. ``.float()`` alone returns a float32
    gradient itself (16.16 keeps its norm parameters in float32), and a model that replays CUDA graphs
    (--compile on a GPU) returns gradients in the graph's memory, which the next micro-batch's replay
    rewrites: a sum started on it would hold the next micro-batch's gradient, not this one's."""
    return grad.float() if grad.dtype != torch.float32 else grad.clone()


class _OptimiserStep:
    """How every step ends: the optimiser step on the update's gradients. Subclasses set `optimiser`,
    `scaler`, `fp_exceptions` and `param_names` (the parameters' names in the optimiser's order)."""

    def _update(self, grads: list[torch.Tensor | None], loss_sum: torch.Tensor,
                all_finite: Callable[[bool], bool] | None = None) -> bool:
        """The optimiser step on the update's gradients: checked (--fp-exceptions), unscaled, and
        skipped when dynamic loss scaling found an overflow (everywhere, with `all_finite`). True when
        it was skipped and the scale backed off; at a scale of 1 there is nothing left to back off, and
        the same overflow is the run's divergence."""
        with profiling.marked(profiling.OPTIMISER):
            if self.fp_exceptions:
                self._raise_on_non_finite(loss_sum, grads, self.param_names)
            present = [g for g in grads if g is not None]
            scale = self.scaler.scale
            if self.scaler.unscale_(present, all_finite=all_finite):
                self.optimiser.step(grads)
                return False
            return scale > 1.0

    @staticmethod
    def _raise_on_non_finite(loss: torch.Tensor, grads: Sequence[torch.Tensor | None], names: Sequence[str]) -> None:
        """--fp-exceptions: the first tensor that is not finite, by name (reads values back: a debug mode)."""
        if not torch.isfinite(loss):
            raise NonFiniteError("the loss is NaN or Inf")
        for name, g in zip(names, grads):
            if g is not None and not torch.isfinite(g).all():
                raise NonFiniteError(f"the gradient of {name} is NaN or Inf")


class TrainStep(_OptimiserStep):
    def __init__(self, model: nn.Module, optimiser: HalfPrecisionOptimiser, policy: PrecisionPolicy,
                 scaler: LossScaler, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 grad_accum: int, accumulate_in_float32: bool, fp_exceptions: bool = False,
                 mix: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
                 replicated: DistributedDataParallel | None = None, replicas: int = 1,
                 keep_gradient_buffers: bool = False):
        self.model = model
        self.optimiser = optimiser
        self.policy = policy
        self.scaler = scaler
        self.loss_fn = loss_fn
        self.grad_accum = grad_accum
        self.params = optimiser.params
        self.accumulator = FloatGradientAccumulator(
            self.params,
            enabled=accumulate_in_float32 and policy.half_weights and (grad_accum > 1 or replicated is not None))
        # Replicas (`replicated`, the DDP wrapper of `model`): no gradient all-reduce but for the update's last
        # micro-batch, and with the float32 sum that reduction is of the sum, in float32 (DDP's communication
        # hook), instead of the last micro-batch's half gradients.
        self.no_sync = replicated.no_sync if replicated is not None else contextlib.nullcontext
        if replicated is not None and self.accumulator.enabled:
            replicated.register_comm_hook(None, self.accumulator.reduce_hook(None, replicas))
        # A model that replays CUDA graphs (--compile on a GPU) returns its gradients in the graph's own
        # memory, which the next micro-batch's replay writes again; autograd would take such a gradient
        # as `.grad` when none is there, and a second micro-batch would then add into overwritten memory.
        # So where `.grad` is summed across micro-batches (the float32 accumulator copies it out after each
        # backward instead), it lives in buffers made outside any graph and zeroed in place each update.
        keep = keep_gradient_buffers and not self.accumulator.enabled
        self._clear_gradients = (self._zero_gradient_buffers if keep
                                 else functools.partial(optimiser.zero_grad, set_to_none=True))
        self.fp_exceptions = fp_exceptions
        self.mix = mix
        # Parameter names in the optimiser's order, for --fp-exceptions messages.
        names = {id(p): name for name, p in model.named_parameters()}
        self.param_names = [names.get(id(p), f"parameter {i}") for i, p in enumerate(self.params)]

    def _zero_gradient_buffers(self) -> None:
        for param in self.params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)  # in the parameter's layout (channels_last weights)
            else:
                param.grad.zero_()

    def __call__(self, micro_batches: Sequence[Batch], lr: float) -> StepMetrics:
        set_lr(self.optimiser, lr)
        self._clear_gradients()
        loss_sum = torch.zeros((), device=micro_batches[0][0].device)
        correct = torch.zeros((), dtype=torch.int64, device=loss_sum.device)
        samples = 0
        last = len(micro_batches) - 1
        for index, (images, labels) in enumerate(micro_batches):
            targets = labels
            if self.mix is not None:
                images, targets = self.mix(images, labels)
            with self.no_sync() if index < last else contextlib.nullcontext():
                with self.policy.autocast():
                    logits = self.model(images)
                # The loss is computed in float32 whatever the compute precision.
                loss = self.loss_fn(logits.float(), targets)
                # Each micro-batch contributes 1/A of the update, so the gradient is the global-batch
                # mean whatever the accumulation count (and equal across replicas x accumulation splits).
                self.scaler.scale_loss(loss / self.grad_accum).backward()
            self.accumulator.after_backward()
            loss_sum += loss.detach()
            correct += (logits.detach().argmax(dim=1) == labels).sum()
            samples += labels.shape[0]
        grads = self.accumulator.gradients(to_float32=self.scaler.active)
        backed_off = self._update(grads, loss_sum)
        return StepMetrics(loss_sum, correct, samples, backed_off)


class PipelinedTrainStep(_OptimiserStep):
    """One weight update of one pipeline stage.

    The schedule (`cnns.parallel.pipeline_schedules.build_pipeline_schedule`) runs the update's micro-batches through the
    stages: the first stage feeds the images, the last computes the loss (in float32, divided by the
    micro-batch count as one process's accumulation does) and the metrics; gradients accumulate in each
    stage. Then each stage averages its gradients over its replicas (one all-reduce of the update's sum,
    float32 with half weights) and steps its own optimiser. Every stage process reads the same
    micro-batches (the mixing draws stay in step on all of them).
    """

    def __init__(self, stage, optimiser: HalfPrecisionOptimiser, policy: PrecisionPolicy, scaler: LossScaler,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], grad_accum: int,
                 accumulate_in_float32: bool, world, fp_exceptions: bool = False,
                 mix: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None):
        from cnns.parallel.pipeline_schedules import StageClock, build_pipeline_schedule

        self.optimiser = optimiser
        self.scaler = scaler
        self.loss_fn = loss_fn
        self.grad_accum = grad_accum
        self.world = world
        self.fp_exceptions = fp_exceptions
        self.mix = mix
        self.params = optimiser.params
        self.accumulator = FloatGradientAccumulator(
            self.params, enabled=accumulate_in_float32 and policy.half_weights and grad_accum > 1)
        self.accumulator.accumulate_as_computed()
        self.schedule = build_pipeline_schedule(stage.schedule, stage.pipeline_stage, grad_accum, self._loss)
        self.clock = StageClock(stage.pipeline_stage, stage.pipeline_stage.device)
        names = dict(zip(map(id, stage.module.model.parameters()),
                         (name for name, _ in stage.module.model.named_parameters())))
        self.param_names = [names.get(id(p), f"parameter {i}") for i, p in enumerate(self.params)]
        self._losses: list[torch.Tensor] = []

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(logits.float(), targets)
        self._losses.append(loss.detach())
        return self.scaler.scale_loss(loss / self.grad_accum)

    def __call__(self, micro_batches: Sequence[Batch], lr: float) -> StepMetrics:
        from cnns.parallel.replicas import averaged_gradients

        world = self.world
        set_lr(self.optimiser, lr)
        self.optimiser.zero_grad(set_to_none=True)
        images, targets = [], []
        for x, y in micro_batches:
            images.append(x)
            targets.append(y)
            if self.mix is not None:
                images[-1], targets[-1] = self.mix(x, y)
        inputs = {"arg_mbs": [(x,) for x in images]} if world.is_first_stage else {}
        if world.is_last_stage:
            inputs["target_mbs"] = targets
        with self.clock.measure("schedule"):
            logits = self.schedule.step(**inputs, return_outputs=world.is_last_stage)
        self.clock.updates += 1
        device = micro_batches[0][0].device
        loss_sum = torch.zeros((), device=device)
        correct = torch.zeros((), dtype=torch.int64, device=device)
        if world.is_last_stage:
            loss_sum = torch.stack(self._losses).sum()
            correct = (logits.detach().argmax(dim=1) == torch.cat([y for _, y in micro_batches])).sum()
        self._losses.clear()
        grads = self.accumulator.gradients(to_float32=self.scaler.active)
        if world.replicas > 1:
            grads = averaged_gradients(grads, world.replica_group, world.replicas)
        # With dynamic loss scaling every stage skips the update when any stage overflowed.
        backed_off = self._update(grads, loss_sum, all_finite=lambda finite: not world.any(not finite))
        return StepMetrics(loss_sum, correct, sum(y.shape[0] for _, y in micro_batches), backed_off)


class NonFiniteError(CnnsError):
    """--fp-exceptions found a NaN or Inf; the training loop adds the iteration to the message."""


def cross_entropy_loss(label_smoothing: float) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Cross entropy with Graphcore's application's label smoothing: 1-e on the true class, e spread over the others.

    torch's label_smoothing spreads e over all K classes (true class gets 1-e+e/K); Graphcore's application spreads
    it over the K-1 others, which is torch's rule with e' = e*K/(K-1). Soft targets (from mixing)
    are used as given.
    """

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if targets.dtype.is_floating_point:
            return torch.sum(-targets * torch.log_softmax(logits, dim=1), dim=1).mean()
        classes = logits.shape[1]
        smoothing = label_smoothing * classes / (classes - 1) if classes > 1 else 0.0
        return nn.functional.cross_entropy(logits, targets, label_smoothing=smoothing)

    return loss
