"""Host-to-device copies: wrappers around ``Tensor.to`` and ``Tensor.cuda``.

Installed only when CUDA is available: on a CPU-only process there is no H2D
to measure and ``Tensor.to`` is far too common to wrap for nothing. The
target check looks at the arguments only (no tensor work), and tensors that
already live on the GPU go straight through.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def targets_cuda(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Does this ``Tensor.to`` call name a CUDA device (by str, device, tensor or index)?"""
    import torch

    dev = kwargs.get("device")
    if dev is None:
        if not args:
            return False
        dev = args[0]
    if isinstance(dev, str):
        return dev.startswith("cuda")
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, torch.Tensor):
        return bool(dev.is_cuda)
    if isinstance(dev, int) and not isinstance(dev, bool):
        return True  # a bare index means a CUDA device
    return False


def install(tracer: Any) -> Callable[[], None]:
    import torch

    orig_to = torch.Tensor.to
    orig_cuda = torch.Tensor.cuda

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.is_cuda or not targets_cuda(args, kwargs):
            return orig_to(self, *args, **kwargs)
        token = tracer._h2d_begin()
        try:
            return orig_to(self, *args, **kwargs)
        finally:
            tracer._h2d_end(token)

    def cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.is_cuda:
            return orig_cuda(self, *args, **kwargs)
        token = tracer._h2d_begin()
        try:
            return orig_cuda(self, *args, **kwargs)
        finally:
            tracer._h2d_end(token)

    torch.Tensor.to = to  # type: ignore[method-assign]
    torch.Tensor.cuda = cuda  # type: ignore[method-assign]

    def undo() -> None:
        if torch.Tensor.to is to:
            torch.Tensor.to = orig_to  # type: ignore[method-assign]
        if torch.Tensor.cuda is cuda:
            torch.Tensor.cuda = orig_cuda  # type: ignore[method-assign]

    return undo
