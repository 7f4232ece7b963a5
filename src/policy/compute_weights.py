"""The update's forward and backward passes on low-precision copies of fp32 weights (`hardware.autocast`).

Under torch.autocast every forward pass casts each fp32 weight again: autocast keeps a cast only while its
region lasts (torch/amp/autocast_mode.py:348, `__exit__` clears the cache once the outermost region ends), and
each micro-batch is a region of its own, so a 32-micro-batch update made every cast 32 times (forward and
backward). Here the parameters hold `dtype` copies of their fp32 weights for the whole update, made once and
refreshed once after each optimizer step (one foreach copy); the micro-batches' gradients are added into
fp32 gradients as each parameter's arrives (a post-accumulate hook), and the optimizer steps the fp32
weights with them, so AdamW's state and lr-1e-5 updates stay fp32 (bf16 weights would round them away).

Off by default (no autocast: the CPU and the float64 golden runs are unchanged), and not for a model sharded
by FSDP2 (DTensor parameters), whose own mixed-precision policy casts per gathered unit.
"""

from __future__ import annotations

import torch


def sharded(model: torch.nn.Module) -> bool:
    """Whether `model`'s parameters are FSDP2's DTensors."""
    return any(hasattr(parameter, "device_mesh") for parameter in model.parameters())


class ComputeWeights:
    """The `dtype` weights of `trained` (with fp32 gradients) and of `frozen` (the reference) while the context
    lasts; `step` runs the optimizer step on the fp32 weights. With `dtype` None: the models as they are."""

    def __init__(self, dtype: torch.dtype | None, trained: torch.nn.Module, frozen: torch.nn.Module | None = None):
        models = [trained] + ([frozen] if frozen is not None and frozen is not trained else [])
        unique = {id(p): p for model in models for p in model.parameters()}
        self.parameters = list(unique.values())
        self.refreshed = len({id(p) for p in trained.parameters()})  # the trained model's come first
        fp32 = all(p.dtype == torch.float32 for p in self.parameters)
        self.on = dtype is not None and dtype != torch.float32 and fp32 and not any(map(sharded, models))
        self.dtype = dtype
        self.trained = [p for p in trained.parameters() if p.requires_grad]
        self.grads: list[torch.Tensor | None] = [None] * len(self.trained)
        self.stepped = False  # the fp32 weights (and gradients) in the parameters since the last step

    def __enter__(self) -> "ComputeWeights":
        if not self.on:
            return self
        self.masters = [p.data for p in self.parameters]
        self.copies = [master.to(self.dtype) for master in self.masters]  # one cast a parameter per update
        self._swap(self.copies)
        self.hooks = [p.register_post_accumulate_grad_hook(self._accumulate(i)) for i, p in enumerate(self.trained)]
        return self

    def _swap(self, tensors: list[torch.Tensor]) -> None:
        """`tensors` as the parameters' data: gradients are fp32 on the masters only, none on the copies."""
        on_masters = tensors is self.masters
        for parameter, tensor in zip(self.parameters, tensors):
            parameter.grad = None
            parameter.data = tensor
        if on_masters:
            for parameter, grad in zip(self.trained, self.grads):
                parameter.grad = grad

    def _accumulate(self, i: int):
        def hook(parameter: torch.Tensor) -> None:  # the micro-batch's gradient into the fp32 one, then freed
            if self.grads[i] is None:
                self.grads[i] = parameter.grad.to(torch.float32)
            else:
                self.grads[i].add_(parameter.grad)
            parameter.grad = None
        return hook

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """No gradients for the next optimizer step (`optimizer.zero_grad(set_to_none=True)`, the fp32 ones too);
        after a step, the copies take the stepped weights first (one foreach copy)."""
        optimizer.zero_grad(set_to_none=True)
        self.grads = [None] * len(self.trained)
        if self.on and self.stepped:
            # One multi-tensor copy (fp32 -> dtype) of the trained model's parameters (as torch/optim/asgd.py:399).
            torch._foreach_copy_(self.copies[: self.refreshed], self.masters[: self.refreshed])
            self._swap(self.copies)
            self.stepped = False

    def step(self, optimizer_step) -> None:
        """`optimizer_step()` (clipping, the optimizer) on the fp32 weights and gradients: they stay in the
        parameters until the next `zero_grad` (no copy is refreshed after the update's last step)."""
        if self.on and not self.stepped:
            self._swap(self.masters)
            self.stepped = True
        optimizer_step()

    def __exit__(self, *failure) -> None:
        if not self.on:
            return
        for hook in self.hooks:
            hook.remove()
        if not self.stepped:  # after a step the fp32 weights and gradients are in place already
            self._swap(self.masters)
