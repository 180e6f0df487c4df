"""hpcdl.optim_state against torch's own optimizers: the groups numbered as torch numbers
them, a saved state read back per parameter, and the flat form of an element-wise
optimizer's state equal to the state of the same optimizer stepping the flat run itself."""

from __future__ import annotations

import pytest
import torch

from hpcdl.optim_state import (
    copy_value,
    flatten_state,
    hyperparameters,
    in_parameter_order,
    is_per_element,
    numbered_groups,
    unflatten_state,
)

SHAPES = [(), (3, 4), (5,), (2, 2, 2)]  # a scalar parameter first: its moments are per element too
PAD = 3  # elements of padding after the parameters


def params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=torch.float64)) for s in SHAPES]


def offsets(ps: list[torch.Tensor]) -> list[int]:
    out, total = [], 0
    for p in ps:
        out.append(total)
        total += p.numel()
    return out


def grads(step: int, ps: list[torch.Tensor]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in ps]


def stepped(make, steps: int = 3) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer, torch.optim.Optimizer]:
    """The parameters with an optimizer over them, and the same optimizer over one flat
    parameter holding them end to end (then padding), after the same ``steps`` steps."""
    ps = params()
    n = sum(p.numel() for p in ps)
    flat = torch.nn.Parameter(torch.cat([p.detach().reshape(-1) for p in ps] + [torch.zeros(PAD, dtype=torch.float64)]))
    per, whole = make(ps), make([flat])
    for k in range(steps):
        gs = grads(k, ps)
        for p, g in zip(ps, gs, strict=True):
            p.grad = g
        flat.grad = torch.cat([g.reshape(-1) for g in gs] + [torch.zeros(PAD, dtype=torch.float64)])
        per.step()
        whole.step()
    assert torch.equal(flat.detach()[:n], torch.cat([p.detach().reshape(-1) for p in ps]))  # element-wise, so alike
    return ps, per, whole


OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5, centered=True),
}


def test_numbered_groups_are_torchs_param_groups():
    ps = params()
    opt = torch.optim.Adam([{"params": ps[:2], "lr": 0.5}, {"params": ps[2:], "betas": (0.8, 0.9)}], lr=0.01)
    for p, g in zip(ps, grads(0, ps), strict=True):
        p.grad = g
    opt.step()
    assert numbered_groups(opt.param_groups) == opt.state_dict()["param_groups"]
    assert [hyperparameters(g) for g in opt.param_groups] == [
        {k: v for k, v in g.items() if k != "params"} for g in opt.state_dict()["param_groups"]
    ]


def test_in_parameter_order_reads_each_parameters_state_whatever_the_ids():
    ps = params()
    opt = torch.optim.Adam([{"params": ps[:2]}, {"params": ps[2:]}], lr=0.01)
    for p, g in zip(ps[1:], grads(0, ps[1:]), strict=True):  # the first parameter has no gradient, so no state
        p.grad = g
    opt.step()
    sd = opt.state_dict()
    renumber = {i: 10 * (len(ps) - i) for i in range(len(ps))}  # ids need not count up from 0
    saved = {
        "state": {renumber[i]: st for i, st in sd["state"].items()},
        "param_groups": [{**g, "params": [renumber[i] for i in g["params"]]} for g in sd["param_groups"]],
    }
    got = in_parameter_order(saved["state"], saved["param_groups"])
    assert got[0] is None
    for p, st in zip(ps[1:], got[1:], strict=True):
        assert set(st) == set(opt.state[p])
        assert all(torch.equal(st[k], opt.state[p][k]) for k in st)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_flat_form_is_the_state_of_the_optimizer_stepping_the_flat_run(name):
    ps, per, whole = stepped(OPTIMIZERS[name])
    length = sum(p.numel() for p in ps) + PAD
    want = whole.state[whole.param_groups[0]["params"][0]]
    states = [per.state[p] for p in ps]
    got = flatten_state(states, ps, offsets(ps), length)
    assert list(got) == list(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
        if is_per_element(k, v, (length,)):
            assert got[k] is not states[0][k] and got[k].dtype == ps[0].dtype
    back = unflatten_state(want, ps, offsets(ps), length)
    for p, st, ref in zip(ps, back, states, strict=True):
        assert list(st) == list(ref)
        for k, v in ref.items():
            assert torch.equal(st[k], v), (k, p.shape)
            assert st[k].data_ptr() != want[k].data_ptr()  # copies, not views of the flat run


def test_a_parameter_without_state_reads_as_zeros_and_the_round_trip_copies():
    ps, per, _ = stepped(OPTIMIZERS["adam"])
    states = [per.state[p] for p in ps]
    states[1] = None
    length = sum(p.numel() for p in ps) + PAD
    o = offsets(ps)
    flat = flatten_state(states, ps, o, length)
    assert torch.equal(flat["exp_avg"][o[1] : o[1] + ps[1].numel()], torch.zeros(ps[1].numel(), dtype=torch.float64))
    assert torch.equal(flat["exp_avg"][-PAD:], torch.zeros(PAD, dtype=torch.float64))
    assert flat["step"] is states[0]["step"]  # per tensor: the first parameter's, not copied
    back = unflatten_state(flat, ps, o, length)
    for st, ref in zip(back, states, strict=True):
        if ref is None:
            continue
        assert all(torch.equal(st[k], ref[k]) and st[k] is not ref[k] for k in ref)


def test_is_per_element_and_copy_value():
    p = torch.zeros(3, 2)
    assert is_per_element("exp_avg", torch.ones(3, 2), p.shape)
    assert not is_per_element("exp_avg", torch.ones(6), p.shape)
    assert not is_per_element("step", torch.ones(3, 2), p.shape)  # step is per tensor whatever its shape
    assert not is_per_element("step", torch.tensor(1.0), ())
    assert is_per_element("momentum_buffer", torch.tensor(1.0), ())  # a scalar parameter's momentum
    assert is_per_element("exp_avg", torch.ones(6), (6,)) and not is_per_element("lr", 0.1, (6,))
    t = torch.ones(2)
    assert copy_value(0.5) == 0.5 and torch.equal(copy_value(t), t) and copy_value(t) is not t
