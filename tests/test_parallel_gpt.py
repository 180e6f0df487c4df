"""The GPT over a DP x TP x PP grid in hpcdl.train: a few float64 steps on every grid of the
job's ranks equal one process training the dense GPT on the replicas' batches at once (to
1e-9), and a checkpoint written on one grid resumes on another or without a grid."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hpcdl as hvd
from hpcdl.parallel import Grid, Pipeline
from hpcdl.parallel.dense import gather_dense, load_dense, model_slices
from hpcdl.train import TrainConfig
from hpcdl.train.data import ShardedOrder, corpus
from hpcdl.train.loop import Trainer
from hpcdl.train.models import GPT, parallel_gpt

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(240), pytest.mark.usefixtures("shutdown_after")]

SMALL = dict(model="gpt", n_layer=2, n_head=4, d_model=16, block_size=8, batch_size=6, device="cpu")


def grids(n: int) -> list[tuple[int, int]]:
    """Every (tp, pp) of n ranks that the small GPT allows (tp divides its 4 heads, pp at
    most its 4 layers)."""
    return [(t, p) for t in (1, 2, 4) for p in (1, 2, 3, 4) if n % (t * p) == 0]


def config(tp: int, pp: int, run_dir: str, **kw) -> TrainConfig:
    base = dict(
        SMALL,
        tp=tp,
        pp=pp,
        chunks=3,
        precision="fp64",
        optimizer="adam",
        lr=3e-3,
        warmup_steps=1,
        checkpoint_every=0,
        progress=False,
        run_dir=run_dir,
    )
    return TrainConfig.from_flat(**{**base, **kw})


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / max(want.norm().item(), 1e-300)).item()


def test_dense_slices_cover_the_gpt_and_load_back_on_every_grid():
    hvd.init()
    n = hvd.size()
    torch.manual_seed(0)
    gpt = GPT(8, 2, 4, 16).double()
    names = {k: tuple(v.shape) for k, v in gpt.named_parameters()}
    for tp, pp in grids(n):
        grid = Grid(tp=tp, pp=pp)
        for sp in (False, True) if tp > 1 else (False,):
            pipe = Pipeline(parallel_gpt(gpt, grid, sequence_parallel=sp), grid)
            slices = model_slices(pipe)
            assert set(slices) == {k for k, _ in pipe.named_parameters()}
            dense = gather_dense(pipe, grid, names)
            if hvd.rank() == 0:
                assert list(dense) == list(names)
                for k, v in gpt.named_parameters():
                    assert torch.equal(dense[k], v.detach()), k
            # other values, loaded as slices and gathered back
            other = {
                k: torch.randn(s, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
                for i, (k, s) in enumerate(names.items())
            }
            load_dense(pipe, other)
            again = gather_dense(pipe, grid, names)
            if hvd.rank() == 0:
                assert all(torch.equal(again[k], other[k]) for k in names)
            lacking = {k: v for k, v in other.items() if k != "ln.weight"}
            if grid.is_last_stage:  # the final layer norm's stage (loading is not collective)
                with pytest.raises(hvd.HpcdlArgumentError, match="the dense state has no 'ln.weight'"):
                    load_dense(pipe, lacking)
            else:
                load_dense(pipe, lacking)
            pipe.close()
        grid.close()


def variants(tp: int, pp: int) -> list[dict]:
    out = [{}]
    if pp > 1:
        out.append({"pp_schedule": "gpipe"})
    if tp > 1:
        out.append({"sequence_parallel": True})
    return out


def test_a_few_steps_on_every_grid_equal_one_process_on_the_replicas_batches(run_dir):
    """Adam in float64, 3 micro-batches per replica: after 3 steps the consolidated weights
    equal the dense GPT stepped on every replica's batch at once, to 1e-8."""
    hvd.init()
    n, steps = hvd.size(), 3
    train, _ = corpus(SMALL["block_size"])
    for tp, pp in grids(n):
        for extra in variants(tp, pp):
            zero = 1 if (tp, pp) == grids(n)[-1] and not extra else 0  # ZeroOptimizer over the replicas once
            cfg = config(tp, pp, run_dir, zero=zero, **extra)
            trainer = Trainer(cfg)
            dp = trainer.replicas
            assert dp * tp * pp == n and trainer.grid is not None
            seed, batch_size = cfg.training.seed, cfg.training.batch_size
            batches = [ShardedOrder(len(train), dp, d, seed, batch_size).batches(0) for d in range(dp)]
            losses = [trainer.train_step([batches[trainer.replica][k]]) for k in range(steps)]
            torch.manual_seed(seed)
            ref = GPT(cfg.model.block_size, cfg.model.n_layer, cfg.model.n_head, cfg.model.d_model).double()
            opt = torch.optim.Adam(ref.parameters(), lr=trainer.base_lr)
            for k in range(steps):
                for g in opt.param_groups:
                    g["lr"] = trainer.lr_at(k)
                opt.zero_grad()
                x, y = train.batch(torch.cat([b[k] for b in batches]))
                loss = F.cross_entropy(ref(x).reshape(-1, 256), y.reshape(-1))
                loss.backward()
                opt.step()
                assert losses[k] == pytest.approx(loss.item(), rel=1e-9), (tp, pp, extra, k)
            dense = gather_dense(trainer.model, trainer.grid, trainer.dense_shapes)
            worst = max(rel(dense[k], p.detach()) for k, p in ref.named_parameters()) if hvd.rank() == 0 else None
            # float64 Adam: a gradient element near 0 whose sign the order of a sum decides takes
            # a step of about lr either way, and the order differs with the replica count
            assert hvd.broadcast_object(worst, 0) <= 1e-8, (tp, pp, extra)
            trainer.close()


def test_a_checkpoint_of_one_grid_resumes_on_every_other_grid_and_without_one(run_dir, tmp_path):
    """The consolidated weights and Adam moments after resuming on another grid (or on the
    plain data-parallel path) are those the first grid saved, exactly."""
    hvd.init()
    n = hvd.size()
    shapes = grids(n)
    first = Trainer(config(*shapes[-1], run_dir))
    for k in range(2):
        first.train_step([first.order.batches(0)[k]])
        first.step += 1
    path = first.save(str(tmp_path))
    path = hvd.broadcast_object(path, 0)
    saved = first.state()
    first.close()
    for tp, pp in [*shapes[:-1], (1, 1)]:
        chunks = 1 if (tp, pp) == (1, 1) else 2  # (1, 1) with one chunk: the plain path, no grid
        other = Trainer(config(tp, pp, run_dir, chunks=chunks))
        assert (other.grid is None) == (chunks == 1)
        other.restore(path)
        got = other.state()
        if other.grid:
            other.close()
        assert hvd.broadcast_object(differences(saved, got) if hvd.rank() == 0 else None, 0) == [], (tp, pp)


def differences(saved: dict, got: dict) -> list[str]:
    """What differs between two checkpoints' step, weights and optimizer state (rank 0)."""
    out = []
    if got["step"] != saved["step"]:
        out.append(f"step {got['step']} != {saved['step']}")
    if list(got["model"]) != list(saved["model"]):
        out.append(f"names {list(got['model'])} != {list(saved['model'])}")
    out += [f"weights {k}" for k in saved["model"] if not torch.equal(got["model"][k], saved["model"][k])]
    want, have = saved["optimizer"], got["optimizer"]
    if set(have["state"]) != set(want["state"]):
        return [*out, f"optimizer ids {sorted(have['state'])} != {sorted(want['state'])}"]
    for i, entry in want["state"].items():
        for key, value in entry.items():
            if not torch.equal(torch.as_tensor(have["state"][i].get(key)), torch.as_tensor(value)):
                out.append(f"optimizer state {i} {key}")
    if have["param_groups"] != want["param_groups"]:
        out.append(f"param_groups {have['param_groups']} != {want['param_groups']}")
    return out


def test_a_grid_that_does_not_fit_the_world_is_every_ranks_run_error(run_dir):
    hvd.init()
    n = hvd.size()
    from hpcdl.train.config import RunError

    tp = 1 << n.bit_length()  # the power of two above the world size: it divides the heads, not the world
    with pytest.raises(RunError, match=rf"--tp {tp} --pp 1 on {n} ranks: Grid: .*{tp}"):
        Trainer(config(tp, 1, run_dir, n_head=tp, d_model=4 * tp))
