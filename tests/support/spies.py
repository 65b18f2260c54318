"""Spies on what torch runs (a support module): how many softmaxes a forward dispatched, so a test can say that
attention stayed fused (a pattern is a softmax; the fused kernel dispatches none)."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class Softmaxes(TorchDispatchMode):
    """`with Softmaxes() as spy: ...`, then `spy.n`: the softmax ops dispatched inside."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += "softmax" in str(func)
        return func(*args, **(kwargs or {}))


def refuse_loading(monkeypatch) -> None:
    """Make every way a command loads a model (interp.load, a checkpoint's files) fail the test: what is checked
    must be checked before any model is loaded."""
    import interp
    import interp.loading
    import interp.models.formats.checkpoint

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the settings were checked")

    monkeypatch.setattr(interp, "load", refuse)
    monkeypatch.setattr(interp.loading, "load_checkpoint", refuse)
    monkeypatch.setattr(interp.models.formats.checkpoint, "load_checkpoint", refuse)
