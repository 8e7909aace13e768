import time
import torch
from torch import nn
from driftcheck import Scenario


class Tiny(nn.Module):
    def __init__(self, hidden=3):
        super().__init__()
        self.fc1 = nn.Linear(4, hidden)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(hidden, 2)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def _sgd(p):
    return torch.optim.SGD(p, lr=0.1)


def _mse(out, batch):
    return out.pow(2).mean()


def build(seed=0):
    torch.manual_seed(seed)
    return Scenario(model=Tiny(), inputs=[torch.randn(5, 4), torch.randn(5, 4)], loss=_mse,
                    optimizer=_sgd, steps=2)


def wide(seed=0):  # the same module names, another hidden size
    torch.manual_seed(seed)
    return Scenario(model=Tiny(hidden=5), inputs=[torch.randn(5, 4), torch.randn(5, 4)],
                    loss=_mse, optimizer=_sgd, steps=2)


class Other(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(4, 6)
        self.decoder = nn.Linear(6, 2)

    def forward(self, x):
        return self.decoder(torch.tanh(self.encoder(x)))


def other(seed=0):
    torch.manual_seed(seed)
    return Scenario(model=Other(), inputs=[torch.randn(5, 4), torch.randn(5, 4)], loss=_mse,
                    optimizer=_sgd, steps=2)


class Odd(nn.Module):
    """Scalar, zero-size, integer, bool and complex tensors as params, buffers, inputs, outputs."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.tensor(1.5))               # scalar parameter
        self.empty = nn.Parameter(torch.zeros(0, 3))               # zero-size parameter
        self.rot = nn.Parameter(torch.tensor([1 + 1j, 0.5 - 2j, 1j]))  # complex parameter
        self.register_buffer("count", torch.tensor(0))              # integer scalar buffer
        self.register_buffer("mask", torch.tensor([True, False, True]))
        self.register_buffer("phase", torch.tensor([1 + 2j, 3 - 1j, 0.5j]))

    def forward(self, x, idx, flag):
        self.count += 1
        h = self.lin(x) * self.scale + self.empty.sum()
        c = torch.view_as_real(self.phase * self.rot).sum(-1)
        return {"y": h + c.to(h.dtype), "idx": idx * 2, "flag": flag & self.mask,
                "total": h.sum(), "none": h[:0], "cplx": self.rot * 2}


def odd(seed=0):
    torch.manual_seed(seed)
    batch = {"x": torch.randn(2, 4), "idx": torch.arange(3),
             "flag": torch.tensor([True, True, False])}
    return Scenario(model=Odd(), inputs=batch, loss=lambda out, b: out["y"].pow(2).mean(),
                    optimizer=_sgd, steps=2)


def nan_ref(seed=0):  # the reference input itself holds a NaN
    torch.manual_seed(seed)
    x = torch.randn(5, 4)
    x[0, 0] = float("nan")
    return Scenario(model=Tiny(), inputs=x, loss=lambda o, b: o.nansum(), optimizer=_sgd)


def empty(seed=0):
    return Scenario(model=nn.Sequential(), inputs=torch.randn(2, 3), loss=lambda o, b: o.sum())


def empty_inference(seed=0):
    return Scenario(model=nn.Sequential(), inputs=torch.randn(2, 3))


def frozen(seed=0):
    torch.manual_seed(seed)
    m = Tiny()
    m.requires_grad_(False)
    return Scenario(model=m, inputs=torch.randn(5, 4), loss=_mse, optimizer=_sgd)


def frozen_inference(seed=0):
    torch.manual_seed(seed)
    return Scenario(model=Tiny().requires_grad_(False), inputs=torch.randn(5, 4))


def raises(seed=0):
    raise RuntimeError("cannot build: config missing")


def wrong_type(seed=0):
    return {"model": Tiny()}


def not_a_module(seed=0):
    return Scenario(model="Tiny", inputs=torch.randn(5, 4))


def forward_raises(seed=0):
    class Broken(Tiny):
        def forward(self, x):
            raise ValueError("shapes do not line up")
    return Scenario(model=Broken(), inputs=torch.randn(5, 4), loss=_mse)


def loss_raises(seed=0):
    def bad_loss(out, batch):
        raise KeyError("targets")
    return Scenario(model=Tiny(), inputs=torch.randn(5, 4), loss=bad_loss)


def loss_not_scalar(seed=0):
    return Scenario(model=Tiny(), inputs=torch.randn(5, 4), loss=lambda o, b: o)


def loss_detached(seed=0):
    return Scenario(model=Tiny(), inputs=torch.randn(5, 4), loss=lambda o, b: o.detach().sum())


def kind_flip(seed=0):  # a target whose output turns complex where the reference is real
    class Flip(Tiny):
        def forward(self, x):
            y = super().forward(x)
            return y.to(torch.complex64) if y.dtype == torch.bfloat16 else y
    torch.manual_seed(seed)
    return Scenario(model=Flip(), inputs=torch.randn(5, 4))


def fails_later(seed=0):  # the forward fails at step 1, after step 0 was captured
    class Flaky(Tiny):
        def forward(self, x):
            self.calls = getattr(self, "calls", 0) + 1
            if self.calls == 2:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return super().forward(x)
    torch.manual_seed(seed)
    return Scenario(model=Flaky(), inputs=[torch.randn(5, 4), torch.randn(5, 4)], loss=_mse,
                    optimizer=_sgd, steps=2)


def slow(seed=0):  # for the interrupt tests: many slow steps
    class Slow(Tiny):
        def forward(self, x):
            time.sleep(0.05)
            return super().forward(x)
    torch.manual_seed(seed)
    return Scenario(model=Slow(), inputs=torch.randn(5, 4), loss=_mse, optimizer=_sgd, steps=400)


def hostile(seed=0):
    """Module names carrying HTML, script and terminal-markup payloads."""
    torch.manual_seed(seed)
    m = nn.Sequential()
    m.add_module("<script>alert(1)</script>", nn.Linear(4, 4))
    m.add_module("</script><script>alert(2)</script>", nn.Tanh())
    m.add_module("<img src=x onerror=alert(3)>", nn.Linear(4, 3))
    m.add_module("[/]x[bold red]y", nn.ReLU())
    m.add_module("q\"'&amp;", nn.Linear(3, 2))
    return Scenario(model=m, inputs=torch.randn(3, 4), loss=_mse, optimizer=_sgd)
